"""The decode loop's op counts stay within budget on the embedded pair.

On MLX's CPU backend every op costs about 5-25 us whatever its size (the stream thread is woken
per op), so at the demo pair's widths a cycle's time is mostly its op count (docs/benchmarks.md).
These counts are exact and deterministic, unlike timings: they pin the compiled layers, the
drafter's packed step and the selector's pointer walk against a change that quietly brings back
hundreds of small ops. Budgets are the session-4 counts (367 / 483 / 311) plus about 10%.
"""

from __future__ import annotations

import collections
import io
import re

import mlx.core as mx
import pytest

from dflash2_mlx.engine import GenerationSettings, prefill
from dflash2_mlx.models.loading import load_drafter, load_target


def op_count(*outputs: mx.array) -> int:
    """Primitives MLX would run to compute ``outputs`` from what is already evaluated."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return sum(collections.Counter(re.findall(r'label ="([A-Za-z]+)', dot.getvalue())).values())


@pytest.fixture(scope="module")
def primed(embedded_pair):
    target_dir, drafter_dir = embedded_pair
    target, drafter = load_target(str(target_dir)), load_drafter(str(drafter_dir))
    prompt = list(range(100, 356))
    _, cache, context, _ = prefill(target.runner, prompt, GenerationSettings(), drafter)
    return target.runner, drafter, cache, context


def _warm(fn):
    fn()  # the first call of a compiled function traces it; count what later calls run
    return fn()


def test_an_autoregressive_step_runs_at_most_400_ops(primed):
    runner, _, cache, _ = primed
    snapshot = cache.snapshot()

    def step():
        cache.restore(snapshot)
        logits, _ = runner(mx.array([[5]], dtype=mx.int32), cache)
        out = mx.argmax(logits[:, -1], axis=-1)
        count = op_count(out)
        mx.eval(out)
        return count

    assert _warm(step) <= 400


def test_an_8_row_verify_pass_runs_at_most_545_ops(primed):
    runner, drafter, cache, _ = primed
    snapshot = cache.snapshot()

    def verify():
        cache.restore(snapshot)
        record = []
        logits, features = runner(
            mx.array([list(range(5, 13))], dtype=mx.int32), cache, drafter.config.target_layer_ids, record
        )
        outputs = [mx.argmax(logits, axis=-1), features, *[r.states for r in record]]
        count = op_count(*outputs)
        mx.eval(outputs)
        return count

    assert _warm(verify) <= 545


def test_a_draft_with_its_selector_runs_at_most_345_ops(primed):
    runner, drafter, _, context = primed
    cfg = drafter.config
    features = mx.random.normal((1, 6, len(cfg.target_layer_ids) * runner.hidden_size))
    block = mx.array([[5] + [cfg.mask_token_id] * 7], dtype=mx.int32)

    def draft():
        cache = context.copy()
        hidden = drafter(runner.embed(block) * cfg.input_embedding_scale, features, cache)[:, 1:]
        tokens = drafter.select_greedy(hidden, drafter.logits(hidden, runner.lm_head), block[:, 0])
        count = op_count(tokens, *cache.keys, *cache.values, cache.positions)
        mx.eval(tokens)
        return count

    assert _warm(draft) <= 345
