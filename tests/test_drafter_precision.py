"""Drafters compute in float32 on GPUs without native bf16 (M1/M2), or when
DFLASH2_MLX_DRAFTER_ACTIVATIONS=float32 forces it (as here, on the CPU): 16-bit checkpoints are
upcast, 4/8-bit ones run as w4a32/w8a32, and they accept exactly what a float32 drafter with the
same weights accepts, cycle for cycle, on the embedded pair."""

from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from dflash2_mlx import assets
from dflash2_mlx.backend import device
from dflash2_mlx.cli.convert import convert_drafter, drafter_warnings
from dflash2_mlx.engine import GenerationSettings, generate_speculative
from dflash2_mlx.models import memory
from dflash2_mlx.models.drafter_precision import ACTIVATIONS_ENV, ActivationChoice, choose_activations, describe
from dflash2_mlx.models.drafter_step import DraftStep
from dflash2_mlx.models.loading import LoadError, load_drafter, load_target

AS_STORED = ActivationChoice(None, "as stored (the reference)")
PROMPTS = 3
MAX_TOKENS = 48


@pytest.fixture(autouse=True)
def no_activation_setting(monkeypatch):
    monkeypatch.delenv(ACTIVATIONS_ENV, raising=False)


@pytest.mark.parametrize(
    "architecture, emulated",
    [
        ("applegpu_g13s", True),
        ("applegpu_g13g", True),
        ("applegpu_g14d", True),  # M1 Max, M1, M2 Ultra
        ("applegpu_g15s", False),
        ("applegpu_g16p", False),
        ("applegpu_g17s", False),  # M3, M4, M5
        ("x86_64", False),
        ("", False),  # MLX's CPU backend reports the CPU's architecture
    ],
)
def test_m1_and_m2_gpus_are_the_ones_detected_without_native_bf16(architecture, emulated):
    assert device.emulates_bf16(architecture) is emulated
    choice = choose_activations(architecture)
    assert choice.dtype == (mx.float32 if emulated else None)
    if emulated:
        assert architecture in choice.reason and "no native bf16" in choice.reason


def test_the_environment_setting_overrides_the_chip(monkeypatch):
    monkeypatch.setenv(ACTIVATIONS_ENV, "float32")
    assert choose_activations("x86_64").dtype == mx.float32
    assert ACTIVATIONS_ENV in choose_activations("applegpu_g16s").reason
    monkeypatch.setenv(ACTIVATIONS_ENV, "native")
    assert choose_activations("applegpu_g13s").dtype is None
    monkeypatch.setenv(ACTIVATIONS_ENV, "auto")
    assert choose_activations("applegpu_g13s").dtype == mx.float32


def test_a_drafter_loaded_on_an_m1_gpu_runs_in_float32_without_any_setting(monkeypatch, converted):
    monkeypatch.setattr(device, "gpu_architecture", lambda: "applegpu_g13s")
    drafter = load_drafter(str(converted["w8"]))
    assert drafter.activation_dtype == mx.float32
    assert describe(drafter) == (
        "w8a32 (8-bit weights, float32 activations); why: applegpu_g13s is an M1/M2-family GPU: no native bf16"
    )
    monkeypatch.setattr(device, "gpu_architecture", lambda: "applegpu_g15s")
    assert load_drafter(str(converted["w8"])).activation_dtype is None


def test_a_bad_environment_setting_is_a_one_line_load_error(monkeypatch, embedded_pair):
    monkeypatch.setenv(ACTIVATIONS_ENV, "fp32")
    with pytest.raises(LoadError) as e:
        load_drafter(str(embedded_pair[1]))
    assert "\n" not in str(e.value) and "float32, native or auto" in str(e.value)


def test_16_bit_inputs_become_float32_and_the_head_runs_in_the_targets_dtype(monkeypatch, embedded_pair):
    monkeypatch.setenv(ACTIVATIONS_ENV, "float32")
    drafter = load_drafter(str(embedded_pair[1]))
    cfg = drafter.config
    # what a bf16 target hands over on a Mac: embeddings and tapped features in bf16
    features = mx.random.normal((1, 12, len(cfg.target_layer_ids) * cfg.hidden_size)).astype(mx.bfloat16)
    block = mx.random.normal((1, cfg.block_size, cfg.hidden_size)).astype(mx.bfloat16)
    cache = drafter.make_cache()
    hidden = drafter(block, features, cache)
    assert hidden.dtype == mx.float32 and cache.keys[0].dtype == mx.float32 and cache.values[0].dtype == mx.float32
    head_inputs = []
    head_weight = mx.random.normal((cfg.vocab_size, cfg.hidden_size)).astype(mx.bfloat16)

    def bf16_head(rows):
        head_inputs.append(rows.dtype)
        return rows @ head_weight.T

    logits = drafter.logits(hidden, bf16_head)
    assert head_inputs == [mx.bfloat16]  # the target's head in its own dtype: no upcast weight
    assert logits.dtype == mx.float32  # the selector scores in float32


def doctor(activations: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **{ACTIVATIONS_ENV: activations})
    return subprocess.run(
        [sys.executable, "-m", "dflash2_mlx", "doctor", "--no-self-test"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_doctor_says_which_precision_the_drafter_runs_in_and_why():
    out = doctor("float32")
    assert out.returncode == 0, out.stderr
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("drafter")]
    assert "float32 activations" in line and "w4a32/w8a32" in line and f"{ACTIVATIONS_ENV}=float32 forces it" in line
    out = doctor("fp32")
    assert out.returncode != 0 and out.stderr.strip().count("\n") == 0 and ACTIVATIONS_ENV in out.stderr


@pytest.fixture(scope="module")
def converted(embedded_pair, tmp_path_factory):
    """The embedded drafter (stored in float32) written as a bf16 checkpoint and as 8-bit and
    4-bit ones (bf16 scales, codebooks, convolutions and norms), as `convert --draft` writes them."""
    root = tmp_path_factory.mktemp("drafters")
    paths = {}
    for name, quantize, bits in (("bf16", False, 8), ("w8", True, 8), ("w4", True, 4)):
        convert_drafter(embedded_pair[1], root / name, quantize, bits, 64, "bfloat16")
        paths[name] = root / name
    return paths


@pytest.fixture(scope="module")
def target(embedded_pair):
    return load_target(str(embedded_pair[0]))


@pytest.fixture(scope="module")
def original_acceptance(target, embedded_pair) -> float:
    """The acceptance length of the embedded float32 drafter as shipped."""
    return acceptance_length(accepted_per_cycle(target, load_drafter(str(embedded_pair[1]), AS_STORED)))


def accepted_per_cycle(target, drafter) -> list[list[int]]:
    """Drafted tokens accepted in each verify cycle, per held-out prompt (greedy, block 8)."""
    tok = target.tokenizer
    settings = GenerationSettings(max_tokens=MAX_TOKENS, block_size=8, stop_token_ids=sorted(tok.eos_token_ids))
    runs = []
    for prompt in assets.demo_prompts()[:PROMPTS]:
        ids = tok.encode(prompt, add_special_tokens=False)
        events = generate_speculative(target.runner, drafter, ids, settings, tok)
        runs.append([event.accepted for event in events if event.accepted is not None])
    return runs


def acceptance_length(runs: list[list[int]]) -> float:
    cycles = [accepted for run in runs for accepted in run]
    return (sum(cycles) + len(cycles)) / len(cycles)


def float32_twin(drafter) -> nn.Module:
    """A float32 drafter, loaded as stored from the embedded checkpoint, holding exactly the
    weights ``drafter`` computes with: 16-bit values widened, quantized weights dequantized."""
    twin = load_drafter(str(assets.demo_drafter_path()), AS_STORED)
    weights = {}
    for name, module in drafter.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            weights[f"{name}.weight"] = mx.dequantize(
                module.weight,
                module.scales.astype(mx.float32),
                module.biases.astype(mx.float32),
                module.group_size,
                module.bits,
            )
    for name, value in tree_flatten(drafter.parameters()):
        module_name, leaf = name.rsplit(".", 1)
        if leaf in ("scales", "biases") or (leaf == "weight" and f"{module_name}.weight" in weights):
            continue
        weights[name] = value.astype(mx.float32)
    twin.load_weights(list(weights.items()))
    return twin


def record_drafter_input_dtypes():
    """Patch the decode step so every block and context-row call records its input's dtype."""
    seen = []
    block, context_rows = DraftStep.block, DraftStep.context_rows

    def recording_block(self, block_embeds, cache):
        seen.append(block_embeds.dtype)
        return block(self, block_embeds, cache)

    def recording_context_rows(self, features, offset):
        seen.append(features.dtype)
        return context_rows(self, features, offset)

    patches = (
        mock.patch.object(DraftStep, "block", recording_block),
        mock.patch.object(DraftStep, "context_rows", recording_context_rows),
    )
    return seen, patches


@pytest.mark.parametrize("checkpoint, bits", [("bf16", None), ("w8", 8), ("w4", 4)])
def test_float32_activation_drafter_accepts_what_the_float32_drafter_accepts(
    checkpoint, bits, converted, target, original_acceptance, monkeypatch
):
    monkeypatch.setenv(ACTIVATIONS_ENV, "float32")
    drafter = load_drafter(str(converted[checkpoint]))
    # the path is really taken: every float parameter is float32, quantized weights stay packed
    params = dict(tree_flatten(drafter.parameters()))
    assert {v.dtype for v in params.values() if mx.issubdtype(v.dtype, mx.floating)} == {mx.float32}
    quantized = [m for _, m in drafter.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert (len(quantized) > 0) == (bits is not None)
    assert all(m.bits == bits and m.weight.dtype == mx.uint32 and m.scales.dtype == mx.float32 for m in quantized)
    assert describe(drafter).startswith(f"w{bits}a32" if bits else "float32 activations")
    seen, patches = record_drafter_input_dtypes()
    with patches[0], patches[1]:
        float32_activations = accepted_per_cycle(target, drafter)
    assert seen and set(seen) == {mx.float32}

    monkeypatch.delenv(ACTIVATIONS_ENV)
    reference = accepted_per_cycle(target, float32_twin(drafter))
    assert float32_activations == reference  # cycle for cycle, prompt for prompt
    # and quantizing or rounding the weights did not collapse acceptance (measured: equal)
    assert acceptance_length(float32_activations) >= 0.9 * original_acceptance > 1.5


def test_the_memory_preflight_counts_the_float32_upcast_of_a_16_bit_drafter(converted, embedded_pair, monkeypatch):
    monkeypatch.setenv(memory.MEMORY_ENV, "64")
    target = str(embedded_pair[0])
    stored = {name: sum(f.stat().st_size for f in path.glob("*.safetensors")) for name, path in converted.items()}
    native = memory.preflight(target, str(converted["bf16"]))
    assert native.drafter_weights == stored["bf16"]
    monkeypatch.setenv(ACTIVATIONS_ENV, "float32")
    upcast = memory.preflight(target, str(converted["bf16"]))
    assert upcast.drafter_weights == 2 * stored["bf16"] and upcast.drafter_context == 2 * native.drafter_context
    assert memory.preflight(target, str(converted["w8"])).drafter_weights == stored["w8"]  # packed weights stay


def test_convert_names_the_safer_choice_for_drafter_formats_known_to_collapse():
    assert drafter_warnings(quantize=True, bits=8, dtype="bfloat16") == []
    assert drafter_warnings(quantize=False, bits=4, dtype="float32") == []
    (four_bit,) = drafter_warnings(quantize=True, bits=4, dtype="bfloat16")
    assert "collapse acceptance" in four_bit and "--q-bits 8" in four_bit
    (half,) = drafter_warnings(quantize=True, bits=8, dtype="float16")
    assert "collapse acceptance" in half and "--dtype bfloat16" in half
    assert len(drafter_warnings(quantize=True, bits=4, dtype="float16")) == 2
