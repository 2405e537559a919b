"""`dflash2-mlx convert` round trips (target 4/8-bit via mlx-lm, drafter 8-bit linears with bf16
codebooks/convs/norms) and `dflash2-mlx download`'s one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
import tiny
from mlx.utils import tree_flatten

LINEARS = {"fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def cli(capsys, monkeypatch, *args):
    """Run the console entry point in process -> (exit code, stdout, stderr)."""
    from dflash2_mlx.cli.app import main

    monkeypatch.setattr(sys, "argv", ["dflash2-mlx", *args])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(code, err):
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert code != 0 and len(lines) == 1 and lines[0].startswith("error:"), err
    return lines[0]


def tokens(events):
    return [t for e in events for t in e.tokens]


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory, hybrid_target):
    """The tiny target in the original Hugging Face layout, and a DFlash 2 drafter (float32)."""
    root = tmp_path_factory.mktemp("hf")
    cfg, model = hybrid_target
    target = tiny.save_target(model, cfg, root / "target", hf_layout=True)
    drafter = tiny.save_drafter(tiny.build_drafter(tiny.drafter_config(cfg, version=2, block_size=8)), root / "drafter")
    return target, drafter


@pytest.fixture(scope="module")
def drafter8(hf_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("d8") / "drafter-8bit"
    from dflash2_mlx.cli.convert import convert_drafter

    convert_drafter(hf_checkpoints[1], out, quantize=True, bits=8, group_size=64, dtype="bfloat16")
    return out


@pytest.mark.parametrize("bits", [4, 8])
def test_target_conversion_round_trip_is_lossless(hf_checkpoints, drafter8, tmp_path, capsys, monkeypatch, bits):
    from dflash2_mlx.engine import GenerationSettings, generate_autoregressive, generate_speculative
    from dflash2_mlx.models.loading import load_drafter, load_target

    src, _ = hf_checkpoints
    out = tmp_path / f"target-{bits}bit"
    code, stdout, err = cli(
        capsys, monkeypatch, "convert", "--hf-path", str(src), "--out", str(out), "--quantize", "--q-bits", str(bits)
    )
    assert code == 0, err
    assert f"{bits}-bit" in stdout and "loads with dflash2-mlx" in stdout
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == bits and config["quantization"]["group_size"] == 64
    weights = mx.load(str(out / "model.safetensors"))
    assert any(k.endswith(".scales") for k in weights) and not any(
        k.startswith(("mtp.", "model.visual")) for k in weights
    )
    target = load_target(str(out))
    assert target.tokenizer.chat_template
    drafter = load_drafter(str(drafter8))
    prompt = target.tokenizer.encode("def f(x):")
    settings = GenerationSettings(max_tokens=24, block_size=8)
    plain = tokens(generate_autoregressive(target.runner, prompt, settings))
    assert tokens(generate_speculative(target.runner, drafter, prompt, settings)) == plain
    # A drafter that proposes the quantized target's own continuation (corrupted at a few
    # positions), carrying the converted 8-bit weights: multi-token acceptances on the quantized target.
    oracle = tiny.OracleDrafter(drafter.config, prompt + plain, corrupt={len(prompt) + 3, len(prompt) + 11})
    file_weights = mx.load(str(drafter8 / "model.safetensors"))
    nn.quantize(oracle, group_size=64, bits=8, class_predicate=lambda p, m: f"{p}.scales" in file_weights)
    oracle.load_weights(list(file_weights.items()))
    events = list(generate_speculative(target.runner, oracle, prompt, settings))
    assert tokens(events) == plain
    assert max(e.accepted for e in events if e.accepted is not None) == 7  # a full block was accepted


def test_drafter_conversion_keeps_codebooks_convs_norms_in_bf16(hf_checkpoints, drafter8, capsys, monkeypatch):
    from dflash2_mlx.models.loading import load_drafter

    src = hf_checkpoints[1]
    config = json.loads((drafter8 / "config.json").read_text())
    assert config["quantization"]["bits"] == 8 and config["dtype"] == "bfloat16"
    weights = mx.load(str(drafter8 / "model.safetensors"))
    quantized = {k[: -len(".scales")] for k in weights if k.endswith(".scales")}
    for name, w in weights.items():
        module = name.rsplit(".", 1)[0]
        if module in quantized:
            assert module.split(".")[-1] in LINEARS, name
            assert name.endswith((".weight", ".scales", ".biases"))
            if name.endswith(".weight"):
                assert w.dtype == mx.uint32
        else:
            assert w.dtype == mx.bfloat16, name  # codebooks, base kernels, kernel projections, norms
    assert all(m.split(".")[-1] in LINEARS for m in quantized)
    assert len(quantized) == 1 + 2 * 7  # fc + (4 attention + 3 MLP projections) x 2 layers
    for kept in (
        "candidate_selector.predecessor_codebook",
        "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight",
        "layers.0.attention_conv.base_kernel",
        "layers.0.attention_conv.kernel_projection.weight",
        "layers.1.mlp_conv.kernel_projection.weight",
        "norm.weight",
        "hidden_norm.weight",
        "layers.0.input_layernorm.weight",
    ):
        assert weights[kept].dtype == mx.bfloat16, kept
    # Round trip: load_drafter rebuilds exactly the stored tensors.
    loaded = load_drafter(str(drafter8))
    params = dict(tree_flatten(loaded.parameters()))
    assert set(params) == set(weights)
    for name, w in weights.items():
        assert params[name].dtype == w.dtype and mx.array_equal(params[name], w).item(), name
    # The 8-bit drafter computes what the float one does, up to quantization error.
    original = load_drafter(str(src))
    mx.random.seed(0)
    cfg = original.config
    features = mx.random.normal((1, 12, len(cfg.target_layer_ids) * cfg.hidden_size))
    block = mx.random.normal((1, cfg.block_size, cfg.hidden_size))
    a = original(block, features, original.make_cache())
    b = loaded(block.astype(mx.bfloat16), features.astype(mx.bfloat16), loaded.make_cache()).astype(mx.float32)
    rel = (mx.linalg.norm(a - b) / mx.linalg.norm(a)).item()
    assert rel < 0.05, rel


def test_convert_cli_drafter_default_and_errors(hf_checkpoints, tmp_path, capsys, monkeypatch):
    target, drafter = hf_checkpoints
    out = tmp_path / "d"
    code, stdout, err = cli(capsys, monkeypatch, "convert", "--hf-path", str(drafter), "--out", str(out))
    assert code == 0, err
    assert "drafter, 15 linear layers 8-bit" in stdout and "bfloat16" in stdout  # 8-bit is the drafter default
    # a 4-bit drafter converts, with a warning about acceptance
    code, stdout, err = cli(
        capsys,
        monkeypatch,
        "convert",
        "--hf-path",
        str(drafter),
        "--out",
        str(tmp_path / "d4"),
        "--draft",
        "--q-bits",
        "4",
    )
    assert code == 0 and "collapse acceptance" in err
    assert json.loads((tmp_path / "d4" / "config.json").read_text())["quantization"]["bits"] == 4
    base = ["convert", "--hf-path", str(target)]
    assert "already exists" in one_line_error(*cli(capsys, monkeypatch, *base, "--out", str(out))[::2])
    assert "--q-bits" in one_line_error(
        *cli(capsys, monkeypatch, *base, "--out", str(tmp_path / "x"), "--quantize", "--q-bits", "3")[::2]
    )
    assert "not a DFlash drafter" in one_line_error(
        *cli(capsys, monkeypatch, *base, "--out", str(tmp_path / "y"), "--draft")[::2]
    )
    assert "does not exist" in one_line_error(
        *cli(capsys, monkeypatch, "convert", "--hf-path", str(tmp_path / "nope"), "--out", str(tmp_path / "z"))[::2]
    )


def test_download_one_line_errors(tmp_path, capsys, monkeypatch):
    code, _, err = cli(capsys, monkeypatch, "download")
    assert "repo id" in one_line_error(code, err)
    code, _, err = cli(capsys, monkeypatch, "download", str(tmp_path))
    assert "local path" in one_line_error(code, err)
    code, _, err = cli(capsys, monkeypatch, "download", "--preset", "nope")
    assert "unknown preset" in one_line_error(code, err)
    # Offline with an empty cache: a clear line, no traceback, no network.
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    r = subprocess.run(
        [sys.executable, "-m", "dflash2_mlx", "download", "some-org/some-model", "--draft"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    line = one_line_error(r.returncode, r.stderr.replace("downloading draft model some-org/some-model ...", ""))
    assert "offline" in line and "some-org/some-model" in line
