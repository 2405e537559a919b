"""`dflash2-mlx generate`, run as a user runs it: a real process, checkpoints on disk.

The bad-input cases run the same console entry point (``main()``, which turns errors into one
line) in this process, capturing file descriptors 1 and 2, so each case does not pay a fresh
interpreter's start-up; one of them still runs in a real process.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import warnings

import pytest


def run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "dflash2_mlx", *args], capture_output=True, text=True, timeout=timeout)


def test_generate_json_speculative_equals_no_draft(tiny_checkpoints):
    target, drafter = tiny_checkpoints
    common = ["generate", "--model", str(target), "--prompt", "def f(x):", "--max-tokens", "24", "--json"]
    spec = run(*common, "--draft-model", str(drafter))
    plain = run(*common, "--no-draft")
    assert spec.returncode == 0, spec.stderr
    assert plain.returncode == 0, plain.stderr
    s, p = json.loads(spec.stdout), json.loads(plain.stdout)  # exactly one JSON object on stdout
    assert s["tokens"] == p["tokens"] and s["text"] == p["text"]
    for key in (
        "text",
        "tokens",
        "prompt_tokens",
        "generation_tokens",
        "verify_steps",
        "acceptance_length",
        "decode_tps",
        "prefill_tps",
        "peak_memory_gb",
    ):
        assert key in s
    assert s["generation_tokens"] == len(s["tokens"]) <= 24
    controller = s["controller"]  # auto by default: speculative cycles, plain steps and probes
    assert controller["policy"] == "auto" and sum(controller["tokens_by_mode"].values()) >= len(s["tokens"]) - 1
    assert sum(int(n) for n in controller["block_sizes"].values()) == s["verify_steps"] + s["plain_steps"]
    assert p["verify_steps"] == 0 and p["acceptance_length"] == 1.0
    pinned = json.loads(run(*common, "--draft-model", str(drafter), "--block-size", "4").stdout)
    assert pinned["tokens"] == p["tokens"] and pinned["verify_steps"] > 0 and pinned["plain_steps"] == 0
    assert pinned["acceptance_length"] == (len(pinned["tokens"]) - 1) / pinned["verify_steps"]
    assert pinned["controller"]["policy"] == "fixed"


def test_generate_without_model_runs_the_embedded_pair(embedded_pair):
    common = [
        "generate",
        "--ignore-chat-template",
        "--prompt",
        "class Parser:\n    def __init__(self",
        "--max-tokens",
        "48",
        "--json",
    ]
    spec, plain = run(*common, "--block-size", "8"), run(*common, "--no-draft")
    assert spec.returncode == 0 and plain.returncode == 0, spec.stderr + plain.stderr
    s, p = json.loads(spec.stdout), json.loads(plain.stdout)
    assert s["tokens"] == p["tokens"] and len(s["tokens"]) == 48
    assert s["acceptance_length"] >= 3.0  # at the drafter's own block size (auto may pick smaller ones)
    assert "needs --model" in _one_line_error(run("generate", "--prompt", "x", "--draft-model", str(embedded_pair[1])))


def test_generate_streams_text_and_a_summary_line(tiny_checkpoints):
    target, drafter = tiny_checkpoints
    out = run(
        "generate",
        "--model",
        str(target),
        "--draft-model",
        str(drafter),
        "--prompt",
        "hello",
        "--max-tokens",
        "8",
        "--ignore-chat-template",
        "--block-size",
        "4",
    )
    assert out.returncode == 0, out.stderr
    assert "tok/s" in out.stderr and "acceptance length" in out.stderr


def _one_line_error(result):
    assert result.returncode != 0
    lines = [l for l in result.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.fixture
def run_in_process(capfd, caplog, monkeypatch):
    """run_in_process(*args): ``dflash2-mlx *args`` through the console entry point ``main()`` in
    this process -> a CompletedProcess-like result: the exit code, what reached fds 1 and 2, and on
    stderr also what a fresh interpreter would have printed there but pytest intercepts (Python
    warnings under the interpreter's default filters, log records at WARNING and above)."""
    from dflash2_mlx.cli.app import main

    def run_main(*args):
        capfd.readouterr()  # drop anything written before
        caplog.clear()
        monkeypatch.setattr(sys, "argv", ["dflash2-mlx", *args])
        code = 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.resetwarnings()
            warnings.simplefilter("always")
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.filterwarnings("ignore", category=category)
            try:
                main()
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        out, err = capfd.readouterr()
        err += "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)
        err += "".join(f"{r.levelname}: {r.getMessage()}\n" for r in caplog.records if r.levelno >= logging.WARNING)
        return subprocess.CompletedProcess(["dflash2-mlx", *args], code, out, err)

    return run_main


def test_bad_input_ends_in_one_line(tiny_checkpoints, tmp_path, run_in_process):
    target, drafter = tiny_checkpoints
    base = ["generate", "--prompt", "x"]
    # one case as a real process: exit code and stderr exactly as a user sees them
    assert "No such option" in _one_line_error(run(*base, "--bogus"))
    cli = run_in_process  # the other cases: the same entry point, in this process
    assert "does not exist" in _one_line_error(cli(*base, "--model", str(tmp_path / "nope"), "--no-draft"))
    assert "--draft-model" in _one_line_error(cli(*base, "--model", str(target)))
    assert "drafter" in _one_line_error(cli(*base, "--model", str(drafter), "--no-draft"))
    assert "block-size" in _one_line_error(
        cli(*base, "--model", str(target), "--draft-model", str(drafter), "--block-size", "9")
    )
    assert "auto or a whole number" in _one_line_error(
        cli(*base, "--model", str(target), "--draft-model", str(drafter), "--block-size", "x")
    )
    assert "top_p" in _one_line_error(cli(*base, "--model", str(target), "--no-draft", "--top-p", "0"))
    assert "max-tokens" in _one_line_error(cli(*base, "--model", str(target), "--no-draft", "--max-tokens", "0"))
    # a drafter made for another target (hidden size 32 instead of 64)
    import tiny

    other = tiny.save_drafter(tiny.build_drafter(tiny.drafter_config(tiny.plain_config(hidden=32))), tmp_path / "other")
    line = _one_line_error(cli(*base, "--model", str(target), "--draft-model", str(other)))
    assert "32" in line and "64" in line and "another target" in line
    # a corrupt weight file
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in drafter.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert "corrupt" in _one_line_error(cli(*base, "--model", str(target), "--draft-model", str(broken)))
    # a prompt longer than the context (the tiny target's context is 4096 tokens)
    assert "context" in _one_line_error(
        cli("generate", "--model", str(target), "--no-draft", "--ignore-chat-template", "--prompt", "ab" * 2100)
    )


def test_doctor_reports_backend_blas_and_kernels():
    # --no-self-test: test_cli_demo_bench runs the full `doctor` and checks its self-test line
    out = run("doctor", "--no-self-test")
    assert out.returncode == 0, out.stderr
    for key in ("MLX", "BLAS", "kernels", "two_tap_conv: reference", "select_greedy: reference", "model cache"):
        assert key in out.stdout


BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "kind": {"enum": ["fn", "class"]},
        "lines": {"type": "integer", "minimum": 1, "maximum": 99},
    },
    "required": ["name", "kind", "lines"],
    "additionalProperties": False,
}


def test_generate_json_schema_forces_a_valid_answer_and_stays_lossless(embedded_pair, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(BOUNDED_SCHEMA))
    common = [
        "generate",
        "--ignore-chat-template",
        "--prompt",
        "def f(x):",
        "--max-tokens",
        "80",
        "--json",
        "--json-schema",
        str(schema),
    ]
    spec, plain = run(*common), run(*common, "--no-draft")
    assert spec.returncode == 0, spec.stderr
    s, p = json.loads(spec.stdout), json.loads(plain.stdout)
    assert s["tokens"] == p["tokens"] and s["finish_reason"] == "stop" and s["verify_steps"] > 0
    jsonschema.validate(json.loads(s["text"]), BOUNDED_SCHEMA)


def test_generate_json_schema_errors_are_one_line(tmp_path, run_in_process):
    base = ["generate", "--prompt", "x", "--no-draft", "--json-schema"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "array", "uniqueItems": True}))
    assert "'uniqueItems'" in _one_line_error(run_in_process(*base, str(bad)))
    bad.write_text("{not json")
    assert "is not JSON" in _one_line_error(run_in_process(*base, str(bad)))
    assert "cannot read" in _one_line_error(run_in_process(*base, str(tmp_path / "missing.json")))
