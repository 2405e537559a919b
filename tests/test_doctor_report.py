"""`dflash2-mlx doctor --report`: the Mac acceptance report, and its exactness rule."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dflash2_mlx.diagnostics import doctor_report
from dflash2_mlx.models.target import TargetRunner

SECTIONS = ("system", "kernels", "rollback", "lossless", "speed", "memory")


def _filled(value) -> bool:
    return (
        value not in (None, "", [], {})
        if not isinstance(value, dict)
        else all(
            k in ("divergences", "self_checks", "wired_limit_bytes", "metal_us") or _filled(v) or v in (False, 0)
            for k, v in value.items()
        )
    )


@pytest.mark.slow
def test_doctor_report_on_the_embedded_pair_fills_every_section_and_passes(tmp_path, embedded_pair):
    path = tmp_path / "report.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash2_mlx",
            "doctor",
            "--report",
            str(path),
            "--prompts",
            "8",
            "--tokens",
            "16",
            "--speed-tokens",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "lossless pass" in r.stdout
    report = json.loads(path.read_text())
    for section in SECTIONS:
        assert report[section], section
    system = report["system"]
    assert system["backend"] == "CPU" and system["mlx"] != "not installed" and system["mlx_lm"] != "not installed"
    assert system["chip"] and system["memory_for_models_bytes"] > 0 and system["os"]
    assert system["drafter_precision"].startswith("float32 activations; why: not an M1/M2 GPU")  # stored float32
    assert system["drafter_draft_vocab"] is None  # the embedded drafter scores the whole vocabulary
    kernels = report["kernels"]
    assert set(kernels["active"]) == set(kernels["timings_float32"]) == {"two_tap_conv", "select_greedy"}
    assert all(t["reference_us"] > 0 for t in kernels["timings_float32"].values())
    assert report["rollback"] == {**report["rollback"], "setting": "auto", "path": "keep"}
    lossless = report["lossless"]
    assert lossless["prompts"] == 8 and lossless["tokens_per_prompt"] == 16
    assert lossless["identical"] == 8 and lossless["divergence_rate"] == 0.0 and lossless["verdict"] == "pass"
    assert len(lossless["per_prompt"]) == 8 and all(p["tokens"] == 16 for p in lossless["per_prompt"])
    assert 0 < lossless["rounding"]["bound"] < 1e-3  # float32 rounding on the CPU
    (run,) = report["speed"]["runs"]
    assert run["generated_tokens"] == 32
    for mode in ("plain", "block_8", "auto"):
        assert run[mode]["generated"] == 32 and run[mode]["decode_tps"] > 0
        assert len(run[mode]["decode_tps_samples"]) == report["speed"]["repeats"] == 2
    assert run["block_8"]["acceptance_length"] > 1
    memory = report["memory"]
    assert memory["peak_bytes"] > memory["weights_bytes"] > 0 and memory["preflight_plan"]["total"] > 0
    assert report["verdict"] == "pass"


def test_a_divergence_passes_only_within_the_rounding_bound(hybrid_target):
    """The rule every Mac-facing check applies: where the outputs part, the target's top-2 gap
    must be within the bound; a length difference never is."""
    _, model = hybrid_target
    runner = TargetRunner(model)
    prompt, plain = [3, 1, 4], [1, 5, 9, 2, 6, 5]
    spec = plain[:4] + [(plain[4] + 1) % 200, 7]
    gap = doctor_report.top2_gap(runner, prompt + plain[:4])
    assert gap > 0
    assert doctor_report.divergence(runner, prompt, plain, plain, 0.0) is None
    tight = doctor_report.divergence(runner, prompt, plain, spec, gap / 2)
    loose = doctor_report.divergence(runner, prompt, plain, spec, gap * 2)
    assert tight == {"position": 4, "top2_gap": pytest.approx(gap), "within_bound": False}
    assert loose["within_bound"] and loose["position"] == 4
    assert not doctor_report.divergence(runner, prompt, plain, plain[:3], 1e9)["within_bound"]
    assert doctor_report.verdict_of([loose]) == "pass" and doctor_report.verdict_of([loose, tight]) == "fail"


@pytest.mark.parametrize("setting", ["keep", "replay"])
def test_the_rounding_bound_is_float32_rounding_on_the_cpu_for_either_rollback_path(
    hybrid_target, setting, monkeypatch
):
    from dflash2_mlx.caches import target as caches

    monkeypatch.setenv(caches.ROLLBACK_ENV, setting)
    _, model = hybrid_target
    runner = TargetRunner(model)
    bound = doctor_report.rounding_bound(runner, [([5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15])], 8)
    assert 0 <= bound["bound"] < 1e-3 and bound["rows"] == 8  # logits of order 100 here


def test_doctor_prints_the_active_rollback_path(run_in_process, monkeypatch):
    # in this process (the setting is read when doctor runs); test_cli_generate runs doctor as a process
    monkeypatch.setenv("DFLASH2_MLX_ROLLBACK", "replay")
    r = run_in_process("doctor", "--no-self-test")
    assert r.returncode == 0, r.stderr
    line = next(l for l in r.stdout.splitlines() if l.startswith("rollback"))
    assert "replay (forced by DFLASH2_MLX_ROLLBACK)" in line
    exactness = next(l for l in r.stdout.splitlines() if l.startswith("exactness"))
    assert "identical to plain decoding" in exactness
    monkeypatch.setenv("DFLASH2_MLX_ROLLBACK", "never")
    bad = run_in_process("doctor", "--no-self-test")
    assert bad.returncode == 2 and "DFLASH2_MLX_ROLLBACK='never' is not one of" in bad.stderr
