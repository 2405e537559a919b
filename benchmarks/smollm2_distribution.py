"""Issue 30's sampling check on SmolLM2: speculative sampling draws the first tokens of an answer from
the target's exact distribution (the G-test of tests/test_sampling.py, on the real pair).

    python benchmarks/smollm2_distribution.py --draft-model DIR
    python benchmarks/smollm2_distribution.py --draft-model DIR --samples 200 --prompt "What is 31 times 5?"

SmolLM2-135M-Instruct in float32 on MLX's CPU device, temperature 0.7 and top-p 0.9 (the build's
sampled setting). For each prompt (chat template applied):

1. the exact joint distribution of the first ``--positions`` generated tokens, by walking the
   target's processed next-token distributions (``diagnostics.distribution.exact_joint``: one
   forward per prefix, from a snapshot of the prompt's cache); prefixes under 5 / samples of
   mass are not expanded (their cells would be pooled anyway) and form the remainder cell;
2. ``--samples`` speculative generations of that many tokens (``generate_speculative``, one
   seed each, block size ``--block-size``), sharing a prefix cache so that the prompt is
   prefilled once: the first token is drawn from the prompt's logits, the others come from
   speculative cycles (accepted drafts and the bonus token: the target's keyed draws);
3. G-tests of the draws against the exact joint, and against its coarsening by the token at each
   position, each at ALPHA / (number of tests), so a correct sampler fails the whole check with
   probability at most ALPHA (1e-3).

Power: the same draws are tested against two wrong samplers' exact distributions, computed from
the same logits, which a broken verify could produce (positions after the first drawn at
temperature 1, or without top-p); "rejected" there means the check could tell them apart. Exit
status 1 when a test fails, 2 when the draws cannot tell either wrong sampler from the right one
on any prompt (too few samples, or prompts whose answers are near-certain).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import dflash2_mlx  # noqa: F401  (loads the BLAS before mlx.core)

# isort: split
import mlx.core as mx
import numpy as np
from smollm2_common import encode, load_cpu_pair, print_table

from dflash2_mlx import GenerationSettings, PrefixCache, SamplingSettings, generate_speculative
from dflash2_mlx.decoding.sampling import probabilities
from dflash2_mlx.diagnostics.distribution import ALPHA, Joint, exact_joint, g_test

# Two held-out prompts whose first tokens are far from certain at t=0.7, top-p 0.9 (a few likely
# first tokens, each followed by a few likely second ones), so the draws carry information.
PROMPTS = ("What is 31 times 5?", "What's a healthy way to eat?")


class PromptTree:
    """The target's next-token distributions after a prompt and each continuation of it: one forward
    of the continuation from a snapshot of the prompt's cache; the raw logits are kept, so that
    other samplings' distributions come from the same numbers."""

    def __init__(self, runner, ids: list[int]):
        self.runner = runner
        cache = runner.make_cache()
        logits, _ = runner(mx.array([ids]), cache, logits_from=len(ids) - 1)
        self.snapshot = cache.snapshot()
        self.logits = {(): logits[0, -1:]}

    def raw(self, generated: tuple) -> mx.array:
        if generated not in self.logits:
            cache = self.runner.make_cache()
            cache.restore(self.snapshot)
            out, _ = self.runner(mx.array([list(generated)]), cache, logits_from=len(generated) - 1)
            mx.eval(out)
            self.logits[generated] = out[0, -1:]
        return self.logits[generated]

    def probs(self, generated: tuple, sampling: SamplingSettings) -> np.ndarray:
        return np.array(probabilities(self.raw(generated), sampling))[0].astype(np.float64)


def wrong_sampler_joint(tree: PromptTree, joint: Joint, sampling: SamplingSettings, wrong: SamplingSettings):
    """Expected cell probabilities (as ``joint.expected()``) if the first token were drawn right and
    every later one with ``wrong``: the same cells, the remainder whatever mass they leave."""
    keys, _ = joint.expected()
    cache: dict = {}

    def p(generated, token):
        s = sampling if not generated else wrong
        if (generated, s) not in cache:
            cache[(generated, s)] = tree.probs(generated, s)
        return cache[(generated, s)][token]

    cells = np.array([np.prod([p(seq[:j], seq[j]) for j in range(len(seq))]) for seq in keys])
    return np.append(cells, max(0.0, 1.0 - cells.sum()))


def coarsen(values: np.ndarray, keys: list[tuple], position: int) -> np.ndarray:
    """Cells grouped by their token at ``position`` (the remainder cell stays apart, last)."""
    tokens = sorted({k[position] for k in keys})
    index = {t: i for i, t in enumerate(tokens)}
    out = np.zeros(len(tokens) + 1)
    for k, v in zip(keys, values[:-1]):
        out[index[k[position]]] += v
    out[-1] = values[-1]
    return out


def check_prompt(target, drafter, text: str, args, sampling: SamplingSettings, log) -> dict:
    tokenizer, runner = target.tokenizer, target.runner
    ids = encode(tokenizer, [{"role": "user", "content": text}])
    t0 = time.perf_counter()
    tree = PromptTree(runner, ids)
    joint = exact_joint(lambda g: tree.probs(g, sampling), args.positions, min_mass=5.0 / args.samples)
    walk_seconds = time.perf_counter() - t0
    keys, expected = joint.expected()
    log(
        f"  exact joint: {len(keys)} cells, remainder {joint.rest:.4f}, {joint.expanded} forwards, {walk_seconds:.0f} s"
    )

    t0 = time.perf_counter()
    prefix_cache = PrefixCache()
    draws, accepted, cycles = [], 0, 0
    for i in range(args.samples):
        settings = GenerationSettings(
            max_tokens=args.positions, sampling=sampling, seed=args.seed + i, block_size=args.block_size
        )
        events = list(generate_speculative(runner, drafter, ids, settings, prefix_cache=prefix_cache))
        draws.append([t for e in events for t in e.tokens])
        stats = events[-1].stats
        accepted += stats.accepted_tokens
        cycles += stats.verify_steps
        if (i + 1) % max(1, args.samples // 10) == 0:
            log(f"  {i + 1}/{args.samples} draws, {time.perf_counter() - t0:.0f} s")
    draw_seconds = time.perf_counter() - t0
    if any(len(d) != args.positions for d in draws):
        raise SystemExit(f"a generation gave {min(map(len, draws))} tokens, not {args.positions}")
    counts = joint.counts(draws)

    tests = {"joint": g_test(counts, expected)}
    for j in range(args.positions):
        tests[f"position {j + 1}"] = g_test(coarsen(counts, keys, j), coarsen(expected, keys, j))
    wrong = {
        "later tokens at temperature 1": SamplingSettings(temperature=1.0, top_p=sampling.top_p),
        "later tokens without top-p": SamplingSettings(temperature=sampling.temperature, top_p=1.0),
    }
    power = {name: g_test(counts, wrong_sampler_joint(tree, joint, sampling, s)) for name, s in wrong.items()}
    top = sorted(zip(expected[:-1], counts[:-1], keys), reverse=True)[:5]
    return {
        "prompt": text,
        "prompt_tokens": len(ids),
        "cells": len(keys),
        "remainder_mass": joint.rest,
        "forwards": joint.expanded,
        "walk_seconds": round(walk_seconds, 1),
        "draw_seconds": round(draw_seconds, 1),
        "acceptance_length": (cycles + accepted) / cycles if cycles else None,
        "accepted_drafts": accepted,
        "verify_cycles": cycles,
        "tests": {k: vars(v) for k, v in tests.items()},
        "power": {k: vars(v) for k, v in power.items()},
        "likeliest": [
            {"tokens": tokenizer.decode(list(k)), "expected": round(e * args.samples, 1), "observed": int(c)}
            for e, c, k in top
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-model", required=True, help="the SmolLM2 drafter directory (config.json + weights)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompt", action="append", help="a user message (repeatable; default: two held-out ones)")
    parser.add_argument("--positions", type=int, default=4, help="generated tokens tested jointly")
    parser.add_argument("--samples", type=int, default=600, help="speculative generations per prompt")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--block-size", type=int, help="the speculative block (default: the drafter's)")
    parser.add_argument("--seed", type=int, default=0, help="the first generation's seed (then +1 each)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    target, drafter = load_cpu_pair(args.model, args.draft_model)
    args.block_size = args.block_size or drafter.config.block_size
    sampling = SamplingSettings(temperature=args.temperature, top_p=args.top_p)
    prompts = args.prompt or list(PROMPTS)
    n_tests = len(prompts) * (1 + args.positions)
    alpha = ALPHA / n_tests
    print(
        f"{target.name} + {args.draft_model}, float32 on the CPU; t={args.temperature}, top-p {args.top_p}, "
        f"block {args.block_size}; first {args.positions} tokens, {args.samples} draws per prompt; "
        f"{n_tests} G-tests at {alpha:.1e} each (ALPHA {ALPHA} overall)",
        flush=True,
    )
    results = []
    for n, text in enumerate(prompts):
        log(f"prompt {n + 1}/{len(prompts)}: {text!r}")
        results.append(check_prompt(target, drafter, text, args, sampling, log))

    rows, failed, powered = [], [], False
    for n, r in enumerate(results):
        for name, t in r["tests"].items():
            ok = t["pvalue"] > alpha
            failed += [] if ok else [f"prompt {n + 1}, {name}: p = {t['pvalue']:.2e}"]
            rows.append([n + 1, f"right sampler, {name}", t["cells"], f"{t['statistic']:.1f}", t["df"],
                         f"{t['pvalue']:.3g}", "pass" if ok else "FAIL"])  # fmt: skip
        for name, t in r["power"].items():
            rejected = t["pvalue"] < alpha
            powered |= rejected
            rows.append([n + 1, f"wrong: {name}", t["cells"], f"{t['statistic']:.1f}", t["df"],
                         f"{t['pvalue']:.3g}", "rejected" if rejected else "not rejected"])  # fmt: skip
    print()
    print_table(["prompt", "test", "cells", "G", "df", "p", "result"], rows)
    print()
    for n, r in enumerate(results):
        likeliest = ", ".join(f"{c['tokens']!r} {c['observed']}/{c['expected']}" for c in r["likeliest"][:3])
        acceptance = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
        print(
            f"prompt {n + 1} ({r['prompt_tokens']} tokens): {r['cells']} cells (remainder {r['remainder_mass']:.3f}), "
            f"exact joint {r['forwards']} forwards in {r['walk_seconds']} s; draws {r['draw_seconds']} s, "
            f"{r['accepted_drafts']} drafts accepted in {r['verify_cycles']} cycles (acceptance {acceptance}); "
            f"likeliest observed/expected: {likeliest}"
        )
    seconds = time.perf_counter() - t_start
    print(f"\n{'FAIL' if failed else 'pass'}: {len(failed)} of {n_tests} tests failed ({seconds:.0f} s)")
    for f in failed:
        print(f"FAILED: {f}")
    if not powered:
        print("NO POWER: the draws did not reject either wrong sampler on any prompt; use more --samples")
    if args.json:
        report = {"settings": {k: v for k, v in vars(args).items() if k != "json"}, "results": results}
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 1 if failed else 0 if powered else 2


if __name__ == "__main__":
    sys.exit(main())
