"""The shared file helpers (sha256 of a file, JSONL reading) and the one progress bar."""

from __future__ import annotations

import hashlib

import pytest

from dflash2_mlx.backend.files import JsonlError, read_jsonl, sha256_file
from dflash2_mlx.backend.progress import ProgressBar


def test_sha256_file_is_the_sha256_of_the_whole_file_across_read_chunks(tmp_path):
    data = bytes(range(256)) * (5 * 2**12 + 3)  # a little over 5 MiB: several 1 MiB chunks
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()
    (tmp_path / "empty").write_bytes(b"")
    assert sha256_file(str(tmp_path / "empty")) == hashlib.sha256(b"").hexdigest()


def test_training_the_demo_build_and_the_prompt_cache_hash_files_with_the_shared_function():
    from dflash2_mlx.caches import disk as disk_cache
    from dflash2_mlx.cli import train
    from dflash2_mlx.training.demo_pair import build as build_demo_pair
    from dflash2_mlx.training.drafter import checkpoint as drafter_checkpoint

    for module in (build_demo_pair, drafter_checkpoint, train, disk_cache):
        assert module.sha256_file is sha256_file, module.__name__


def test_read_jsonl_gives_each_non_blank_line_with_its_number(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n  \n["x", 1]\n"text"\n', encoding="utf-8")
    assert read_jsonl(path) == [(1, {"prompt": "a"}), (4, ["x", 1]), (5, "text")]


def test_read_jsonl_errors_are_one_line_and_name_the_file_or_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(JsonlError, match=r"bad\.jsonl:2: not valid JSON"):
        read_jsonl(bad)
    with pytest.raises(JsonlError, match=r"^prompt file .*missing\.jsonl does not exist$"):
        read_jsonl(tmp_path / "missing.jsonl", "prompt file")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"text": "\xe9"}\n')
    with pytest.raises(JsonlError, match="is not UTF-8 text"):
        read_jsonl(latin, "data file")
    assert issubclass(JsonlError, ValueError)  # callers that catch ValueError keep working


def test_bench_prompts_and_training_data_are_read_by_the_shared_jsonl_reader(tmp_path):
    from dflash2_mlx.cli.train import read_corpus
    from dflash2_mlx.diagnostics.bench import PromptFileError, read_prompts

    path = tmp_path / "mixed.jsonl"
    path.write_text('{"prompt": "p", "text": "t"}\n{oops\n')
    with pytest.raises(PromptFileError, match=r"mixed\.jsonl:2: not valid JSON"):
        read_prompts(path)
    with pytest.raises(ValueError, match=r"mixed\.jsonl:2: not valid JSON .*\{\"text\": \.\.\.\} object per line"):
        read_corpus(path)


def test_a_disabled_progress_bar_accepts_every_call_and_shows_nothing(capsys):
    bar = ProgressBar(10, "work", "steps", enabled=False)
    bar.advance(3)
    bar.update(5, "loss 1.0")
    bar.close()
    assert capsys.readouterr() == ("", "")


def test_the_progress_bar_counts_what_is_done_and_carries_a_note():
    bar = ProgressBar(100, "generating", "tokens")
    try:
        bar.advance(30)
        bar.advance(20)
        assert bar.progress.tasks[0].completed == 50
        bar.update(80, "loss 0.5")
        task = bar.progress.tasks[0]
        assert (task.completed, task.total, task.fields["note"]) == (80, 100, "loss 0.5")
    finally:
        bar.close()
