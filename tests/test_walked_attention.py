"""Llama, Qwen2 and Qwen3 layers walked by the runner give mlx-lm's own forward, bit for bit.

The runner compiles these layers' halves around the KV cache update (models/attention_layers.py).
Here tiny float32 models of each kind run through the runner and through mlx-lm's own model call
(with its own KV caches) side by side: a prefill longer than a compiled pass, one-row steps, verify
passes of every block size 2..16 with tapped features, each rolled back by KV trim to a random
accepted count, as a decode loop does. With the weights' transposed views (the default, except
for float32 weights with OpenBLAS) the two are equal bit for bit, on the CPU paths and on the GPU
paths; with row-major weight copies one-row steps still are, and block passes agree within float
rounding (a GEMM over a copy sums in another order). Speculative decoding then equals plain
decoding token for token.
"""

from __future__ import annotations

import io
import random
import re

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from dflash2_mlx.backend import device
from dflash2_mlx.decoding.autoregressive import generate_autoregressive
from dflash2_mlx.decoding.speculative import generate_speculative
from dflash2_mlx.decoding.types import GenerationSettings
from dflash2_mlx.models.attention_layers import walked_kind
from dflash2_mlx.models.target import TargetRunner

LAYERS, TAPS = 3, [0, 1]
# every option of these layers the walk has to reproduce: biases (qwen2's q/k/v; llama's on every
# projection), qwen3's per-head q/k norms, tied embeddings, llama.cpp-style traditional RoPE
VARIANTS = {
    "llama": {},
    "llama-biases-tied": {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
    "llama-traditional-rope": {"rope_traditional": True},
    "qwen2": {},
    "qwen3": {},
}


def config(variant: str) -> dict:
    arch = variant.split("-")[0]
    cfg = tiny.plain_config(layers=LAYERS)
    cfg.update(model_type=arch, architectures=[f"{arch.capitalize()}ForCausalLM"], **VARIANTS[variant])
    return cfg


@pytest.fixture(scope="module", params=list(VARIANTS))
def target(request):
    cfg = config(request.param)
    return cfg, tiny.build_target(cfg, seed=0, scale=3.0)


class MlxLm:
    """mlx-lm's forward on its own caches: logits from the model's call, and the tapped layers'
    outputs from its layers called as the model calls them (a second set of caches)."""

    def __init__(self, model):
        self.model = model
        self.caches = [make_prompt_cache(model), make_prompt_cache(model)]

    def __call__(self, tokens: mx.array, taps=()) -> tuple[mx.array, mx.array]:
        logits = self.model(tokens, cache=self.caches[0])
        inner = self.model.model
        h = inner.embed_tokens(tokens)
        mask = create_attention_mask(h, self.caches[1][0])
        tapped = []
        for i, (layer, cache) in enumerate(zip(inner.layers, self.caches[1])):
            h = layer(h, mask, cache=cache)
            if i in taps:
                tapped.append(h)
        return logits, mx.concatenate(tapped, axis=-1) if tapped else None

    def trim(self, n: int) -> None:
        for caches in self.caches:
            trim_prompt_cache(caches, n)


def decode_like_a_loop(runner: TargetRunner, reference: MlxLm, check_step, check_block) -> None:
    """Prefill 20 rows, then a verify pass of each block size 1..16 in random order, each rolled
    back to a random accepted count and followed by a one-row step, in both; ``check_*`` compare."""
    rng = random.Random(0)
    cache = runner.make_cache()
    prompt = mx.array([[rng.randrange(tiny.VOCAB) for _ in range(20)]])
    check_step(runner(prompt, cache, TAPS), reference(prompt, TAPS), "prefill")
    blocks = list(range(1, 17))
    rng.shuffle(blocks)
    for b in blocks:
        block = mx.array([[rng.randrange(tiny.VOCAB) for _ in range(b)]])
        check_block(runner(block, cache, TAPS, record=[]), reference(block, TAPS), f"block of {b}")
        keep = rng.randint(1, b)
        cache.rollback([], b, keep)  # no Gated DeltaNet layers: nothing recorded, a KV trim
        reference.trim(b - keep)
        step = mx.array([[rng.randrange(tiny.VOCAB)]])
        check_step(runner(step, cache), reference(step), f"step after a block of {b} kept {keep}")
    assert cache.offset == reference.caches[0][0].offset
    for i, (ours, theirs) in enumerate(zip(cache.layers, reference.caches[0])):
        check_block(ours.state, theirs.state, f"layer {i}'s KV cache", ("keys", "values"))


def equal(ours, theirs, what: str, names=("logits", "features")) -> None:
    for a, b, name in zip(ours, theirs, names):
        if b is not None:
            assert mx.array_equal(a, b), f"{what}: {name} differ by up to {float(mx.abs(a - b).max()):.3g}"


def close(ours, theirs, what: str, names=("logits", "features")) -> None:
    for a, b, name in zip(ours, theirs, names):
        if b is not None:
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-4, err_msg=f"{what}: {name}")


@pytest.mark.parametrize("paths", ["cpu", "gpu"])
def test_walked_layers_with_weight_views_are_mlx_lms_forward_bit_for_bit(target, paths, monkeypatch):
    """Logits and tapped features equal mlx-lm's exactly for every pass, and the KV caches hold
    the same entries at the end. "gpu": the GPU code paths forced on the CPU (RoPE and the causal
    mask as mlx-lm calls them), as on Metal."""
    if paths == "gpu":
        monkeypatch.setenv(device.PATHS_ENV, "gpu")
    _, model = target
    runner = TargetRunner(model, block_weight_copies=False)
    assert [walked_kind(layer) for layer in runner.layers] == ["plain"] * LAYERS
    decode_like_a_loop(runner, MlxLm(model), equal, equal)


def test_with_row_major_weight_copies_steps_stay_exact_and_blocks_within_rounding(target):
    """The CPU default for float32 weights with OpenBLAS: block passes multiply by row-major
    copies (OpenBLAS would otherwise repack each transposed view), which round differently;
    one-row steps, which plain decoding takes, multiply by the views as mlx-lm does. The KV
    entries a block pass wrote then differ by rounding too, so only the first step is compared
    exactly."""
    _, model = target
    runner = TargetRunner(model, block_weight_copies=True)
    reference, cache = MlxLm(model), runner.make_cache()
    prompt, step = mx.array([list(range(40, 60))]), mx.array([[7]])
    equal(runner(prompt, cache, TAPS), reference(prompt, TAPS), "prefill")
    equal(runner(step, cache, TAPS), reference(step, TAPS), "first step")
    decode_like_a_loop(runner, MlxLm(model), close, close)


def test_speculative_decoding_equals_plain_decoding_with_every_accepted_count(target):
    """A drafter proposing the target's own greedy continuation, corrupted so that successive
    cycles of a 16-row block accept 0, 1, ..., 15 drafts: the output is plain decoding's."""
    cfg, model = target
    runner, prompt, block = TargetRunner(model), [5, 80, 81, 200], 16
    wanted = list(range(block))
    n_tokens = sum(a + 1 for a in wanted) + 4
    plain = [
        t for e in generate_autoregressive(runner, prompt, GenerationSettings(max_tokens=n_tokens)) for t in e.tokens
    ]
    dcfg = tiny.drafter_config(cfg, version=2, block_size=block, taps=TAPS)
    drafter = tiny.OracleDrafter(dcfg, prompt + plain, tiny.corrupted_for(len(prompt), wanted, block))
    drafter.load_weights(tree_flatten(tiny.build_drafter(dcfg).parameters()))
    settings = GenerationSettings(max_tokens=n_tokens, block_size=block)
    events = list(generate_speculative(runner, drafter, prompt, settings))
    assert [t for e in events for t in e.tokens] == plain
    assert [e.accepted for e in events if e.accepted is not None][: len(wanted)] == wanted


def test_layers_the_walk_does_not_know_are_called_as_they_are():
    """A RoPE whose call needs the offset as an int (dynamic NTK scaling) keeps the layer as
    mlx-lm calls it; the runner's output is still mlx-lm's."""
    cfg = config("llama")
    cfg["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    model = tiny.build_target(cfg, seed=0, scale=3.0)
    runner = TargetRunner(model, block_weight_copies=False)
    assert [walked_kind(layer) for layer in runner.layers] == [None] * LAYERS
    reference, cache = MlxLm(model), runner.make_cache()
    for chunk in (mx.array([list(range(30, 50))]), mx.array([[3, 4, 5]]), mx.array([[6]])):
        equal(runner(chunk, cache, TAPS), reference(chunk, TAPS), f"{chunk.shape[1]} rows")


def op_count(*outputs: mx.array) -> int:
    """Primitives MLX would run to compute ``outputs`` (as tests/test_op_budget.py counts them)."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return len(re.findall(r'label ="([A-Za-z]+)', dot.getvalue()))


# a one-row step on the CPU paths: 57 ops per walked llama layer (141 called as mlx-lm's module),
# 13 for the embedding, mask and head (MLX 0.32.4); budgets with a little room
OPS_PER_LAYER, OPS_OUTSIDE_LAYERS = 60, 20


def test_a_walked_step_runs_a_few_dozen_ops_per_layer():
    """On the CPU every op costs 5-25 us whatever its size, so op counts are what the walk saves
    (exact and deterministic, unlike timings), and they pin it against a change that quietly
    brings back mlx-lm's uncompiled layer."""
    model = tiny.build_target(config("llama"), seed=0, scale=3.0)
    runner = TargetRunner(model)
    cache = runner.make_cache()
    mx.eval(runner(mx.array([list(range(20))]), cache)[0])
    snapshot = cache.snapshot()
    counts = []
    for _ in range(2):  # the first call of a compiled function traces it; count what later calls run
        cache.restore(snapshot)
        logits, _ = runner(mx.array([[5]]), cache)
        out = mx.argmax(logits[:, -1], axis=-1)
        counts.append(op_count(out))
        mx.eval(out)
    assert counts[-1] <= OPS_PER_LAYER * LAYERS + OPS_OUTSIDE_LAYERS
