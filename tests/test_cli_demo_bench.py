"""`dflash2-mlx demo` through a pseudo-terminal and `dflash2-mlx bench`'s JSON contract."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from xml.etree import ElementTree

import pytest

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def svg_screen(path) -> list[str]:
    """The lines of a rich SVG export as a renderer lays them out: each <text> run at its own
    column (x / cell width) after SVG's whitespace handling, where, unless the document says
    xml:space="preserve", a run's leading and trailing spaces are dropped (librsvg, browsers)."""
    root = ElementTree.parse(path).getroot()
    preserve = root.get("{http://www.w3.org/XML/1998/namespace}space") == "preserve"
    rows: dict[float, dict[int, str]] = {}
    for run in root.iter("{http://www.w3.org/2000/svg}text"):
        text = run.text or ""
        if run.get("textLength") is None or not text:
            continue  # the window title
        column = round(float(run.get("x")) / (float(run.get("textLength")) / len(text)))
        if not preserve:
            text = text.strip(" \xa0")
        cells = rows.setdefault(float(run.get("y")), {})
        for i, ch in enumerate(text.replace("\xa0", " ")):
            cells[column + i] = ch
    return ["".join(cells.get(i, " ") for i in range(max(cells, default=-1) + 1)) for _, cells in sorted(rows.items())]


def test_svg_screen_sees_a_space_lost_at_a_run_boundary(tmp_path):
    """The check below can fail: two runs "not" + " isinstance" read "notisinstance" unless the
    SVG keeps whitespace."""
    runs = (
        '<text x="0" y="20" textLength="36.6">not</text>'
        '<text x="36.6" y="20" textLength="134.2">&#160;isinstance</text>'
    )
    for root, seen in (
        ('<svg xmlns="http://www.w3.org/2000/svg">', "notisinstance"),
        ('<svg xml:space="preserve" xmlns="http://www.w3.org/2000/svg">', "not isinstance"),
    ):
        (tmp_path / "a.svg").write_text(root + runs + "</svg>")
        assert svg_screen(tmp_path / "a.svg")[0].rstrip() == seen


@pytest.mark.slow
def test_demo_side_by_side_in_a_terminal_and_export(embedded_pair, tmp_path):
    """No --model and no --prompt: the embedded pair on its own fitting prompt."""
    pexpect = pytest.importorskip("pexpect")
    svg = tmp_path / "demo.svg"
    env = dict(os.environ, TERM="xterm", COLUMNS="120", LINES="40")
    child = pexpect.spawn(
        sys.executable,
        # --replay-speed: the replay still animates, without waiting out the measured time again
        [
            "-m",
            "dflash2_mlx",
            "demo",
            "--max-tokens",
            "40",
            "--block-size",
            "4",
            "--height",
            "6",
            "--export",
            str(svg),
            "--replay-speed",
            "20",
        ],
        env=env,
        encoding="utf-8",
        timeout=120,
        dimensions=(40, 120),
    )
    try:
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    screen = ANSI.sub("", child.before)
    assert child.exitstatus == 0, screen
    measured = re.search(r"measured: DFlash 2 (\d+) tokens.*autoregressive (\d+) tokens", screen)
    assert measured and measured.group(1) == measured.group(2) and 0 < int(measured.group(1)) <= 40
    assert "DFlash 2 (speculative)" in screen and "Autoregressive" in screen
    assert re.search(r"speedup [\d.]+x", screen) and "outputs identical: yes" in screen
    lines = svg_screen(svg)
    text = "\n".join(lines)
    # Both panels show the same tokens, the left one styled run by run: the same text, space for space.
    panels = [line.split("│") for line in lines if line.count("│") == 4]
    assert panels and [p[1] for p in panels] == [p[3] for p in panels]
    assert "DFlash 2 (speculative)" in text and "Autoregressive" in text  # both panels
    assert len(re.findall(rf"{measured.group(1)} tokens · [\d.]+ tok/s · [\d.]+ s", text)) == 2
    assert re.search(r"speedup [\d.]+x +DFlash 2 [\d.]+ tok/s vs autoregressive [\d.]+ tok/s", text)
    assert re.search(r"acceptance length [\d.]+ tokens per verify cycle", text)
    assert "acceptance by draft position" in text and text.count("%") >= 3  # one bar per position (block 4)


@pytest.mark.slow
def test_bench_json_contract(tiny_checkpoints, tmp_path):
    target, drafter = tiny_checkpoints
    prompts = tmp_path / "p.jsonl"
    lines = [
        {"prompt": "def f(x):"},
        {"messages": [{"role": "user", "content": "hello there"}]},
        {"prompt": "The cat sat"},
    ]
    prompts.write_text("\n".join(json.dumps(l) for l in lines) + "\n\n")
    png = tmp_path / "bench.png"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash2_mlx",
            "bench",
            "--model",
            str(target),
            "--draft-model",
            str(drafter),
            "--prompts",
            str(prompts),
            "--max-tokens",
            "12",
            "--json",
            "--plot",
            str(png),
            "--block-size",
            "4",
            "--profile",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # exactly one JSON object on stdout
    profile = out.pop("profile")  # --profile adds where a cycle's time goes
    assert sum(profile["shares"].values()) == pytest.approx(1.0) and profile["cycles"] > 0 and profile["ar_step_ms"] > 0
    by_position = out.pop("acceptance_by_position")  # one share per draft position of the block (4: 3 positions)
    assert len(by_position) == 3 and all(0.0 <= share <= 1.0 for share in by_position)
    assert set(out) == {"mean", "prompts"}
    mean, per = out["mean"], out["prompts"]
    assert set(mean) == {"acceptance_length", "spec_decode_tps", "ar_decode_tps", "speedup", "by_source", "controller"}
    assert mean["controller"]["policy"] == "fixed" and set(mean["controller"]["block_sizes"]) <= {"2", "3", "4"}
    # a pinned block size is the drafter alone: every drafted token is the drafter's
    assert mean["by_source"]["copy"]["drafted"] == 0 and mean["by_source"]["dflash"]["cycles"] > 0
    assert len(per) == 3
    for p in per:
        assert set(p) == set(mean) | {"identical"}
        assert p["identical"] is True  # temperature 0: speculative == autoregressive
        assert p["speedup"] == pytest.approx(p["spec_decode_tps"] / p["ar_decode_tps"])
        assert 1.0 <= p["acceptance_length"] <= 4
    assert mean["spec_decode_tps"] == pytest.approx(sum(p["spec_decode_tps"] for p in per) / 3)
    assert mean["ar_decode_tps"] == pytest.approx(sum(p["ar_decode_tps"] for p in per) / 3)
    assert mean["speedup"] == pytest.approx(mean["spec_decode_tps"] / mean["ar_decode_tps"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_library_order_templates_and_pooled_acceptance(tiny_checkpoints):
    """In process: prompts run in file order, messages lines go through the chat template, the
    mean acceptance length pools cycles, and `identical` is null when sampling."""
    from dflash2_mlx.cli.common import encode_line
    from dflash2_mlx.decoding.sampling import SamplingSettings
    from dflash2_mlx.decoding.types import GenerationSettings
    from dflash2_mlx.diagnostics import bench
    from dflash2_mlx.models.loading import load_drafter, load_target

    target_dir, drafter_dir = tiny_checkpoints
    target, drafter = load_target(str(target_dir)), load_drafter(str(drafter_dir))
    tok = target.tokenizer
    lines = [{"prompt": "a"}, {"messages": [{"role": "user", "content": "bb"}]}, {"prompt": "ccc dd"}]
    seen = []

    def encode(line):
        ids = encode_line(tok, line)
        seen.append(ids)
        return ids

    order = []
    settings = GenerationSettings(max_tokens=10, block_size=4, stop_token_ids=sorted(tok.eos_token_ids))
    res = bench.run_bench(
        target, drafter, lines, settings, encode, on_prompt=lambda i, r: order.append((i, r["prompt"]))
    )
    assert order == [(0, "a"), (1, "bb"), (2, "ccc dd")]
    templated = tok.apply_chat_template(lines[1]["messages"], add_generation_prompt=True, tokenize=True)
    assert seen[1] == list(templated) and [d["prompt_tokens"] for d in res.details] == [len(s) for s in seen]
    assert seen[0] == tok.encode("a")  # a "prompt" line is fed as is
    cycles = sum(d["verify_steps"] for d in res.details)
    tokens = sum(d["generation_tokens"] - 1 for d in res.details)  # all but each prefill token
    assert res.contract["mean"]["acceptance_length"] == pytest.approx(tokens / cycles)
    sampled = replace_settings(settings, sampling=SamplingSettings(temperature=1.0), seed=3)
    res = bench.run_bench(target, drafter, lines[:1], sampled, encode, warmup=False)
    assert res.contract["prompts"][0]["identical"] is None


def replace_settings(settings, **kw):
    from dataclasses import replace

    return replace(settings, **kw)


def test_prompt_file_errors_are_one_line(tiny_checkpoints, tmp_path, capsys, monkeypatch):
    from dflash2_mlx.cli.app import main

    target, drafter = tiny_checkpoints

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["dflash2-mlx", *args])
        with pytest.raises(SystemExit) as e:
            main()
        err = capsys.readouterr().err
        lines = [l for l in err.strip().splitlines() if l.strip()]
        assert e.value.code != 0 and len(lines) == 1 and lines[0].startswith("error:"), err
        return lines[0]

    base = ["bench", "--model", str(target), "--draft-model", str(drafter), "--prompts"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": \n')
    assert "bad.jsonl:2" in run(*base, str(bad))
    bad.write_text('{"text": "x"}\n')
    assert '"prompt" or "messages"' in run(*base, str(bad))
    assert "does not exist" in run(*base, str(tmp_path / "missing.jsonl"))
    assert "block-size" in run(*base[:-1], "--block-size", "99")
    assert ".png" in run(*base[:-1], "--plot", str(tmp_path / "x.jpg"))
    assert "--export" in run("demo", "--model", str(target), "--draft-model", str(drafter), "--export", "x.txt")
    assert "--draft-model" in run("demo", "--model", str(target))


def test_presets_and_embedded_defaults(monkeypatch, capsys):
    from dflash2_mlx.cli import common
    from dflash2_mlx.models.presets import PRESETS, get_preset

    p = get_preset("Qwen3.8-27B")
    assert p.target and p.drafter and 14 <= p.target_gb <= 16 and 2 <= p.drafter_gb <= 4
    assert "GB" in p.memory_line()
    choice = common.choose_models(None, None, "qwen3.8-27b")
    assert (choice.target, choice.drafter) == (p.target, p.drafter)
    # Without the embedded pair, a command with no --model asks for one in one line.
    monkeypatch.setattr(common, "embedded_pair", lambda: None)
    with pytest.raises(common.UserError, match="embedded demo pair is not installed"):
        common.choose_models(None, None, None)
    assert set(PRESETS) >= {"qwen3.8-27b"}


@pytest.mark.slow
def test_doctor_self_test_and_demo_on_the_embedded_pair(embedded_pair, run_in_process):
    # in this process: the real-process runs of both commands are in test_cli_generate (doctor) and
    # test_demo_side_by_side_in_a_terminal_and_export above
    r = run_in_process("doctor")
    assert r.returncode == 0, r.stderr
    line = next(l for l in r.stdout.splitlines() if l.startswith("self-test"))
    assert "lossless" in line and "acceptance length" in line
    r = run_in_process("demo", "--max-tokens", "32", "--replay-speed", "100")
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())  # rich wraps at 80 columns when not on a terminal
    assert "speedup" in out and "outputs identical: yes" in out
