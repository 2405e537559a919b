"""Microbenchmark of the DFlash 2 kernels at the real widths.

Times, per call (dispatch + evaluation, median over iterations):
- the composed reference MLX ops (``reference_*`` in dflash2_mlx.kernels.reference), eagerly and under
  ``mx.compile``;
- the fused Metal kernels (``metal/*.metal`` through ``mx.fast.metal_kernel``) when Metal is
  available and the default device is the GPU; elsewhere only the reference is timed, and the
  output says so.

Defaults are the real drafter/selector widths: one block of B=8 rows, hidden 5120, group size 16
(G=320), k=16 candidates, rank 256, codebooks of V=248320 rows in float32; the selector walks
R=B-1 rows. The pair-score work gathers only the k*R rows it needs, so its cost hardly depends on
V: pass e.g. ``--vocab 32000`` to save memory (2 x V x rank x 4 bytes = 0.5 GB at the default).

    python benchmarks/kernels_microbench.py [--json] [--iters 50] [--vocab 248320]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dflash2_mlx.diagnostics.doctor_report import time_us  # noqa: E402
from dflash2_mlx.kernels import dispatch as kernels  # noqa: E402
from dflash2_mlx.kernels import plans, reference  # noqa: E402


def _time(fn, iters: int, warmup: int) -> dict:
    samples = time_us(fn, iters, warmup)
    return {
        "median_us": statistics.median(samples),
        "p10_us": samples[max(0, int(0.1 * len(samples)) - 1)],
        "p90_us": samples[min(len(samples) - 1, int(0.9 * len(samples)))],
        "iters": iters,
    }


def _metal_call(name, *args):
    plan = plans.PLANNERS[name](*args)
    if plan is None:
        raise RuntimeError(f"{name}: these shapes are not supported by the Metal kernel")
    return plan.finish(kernels._run_metal(plan))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-size", type=int, default=8, help="rows per block B (selector: B-1)")
    ap.add_argument("--blocks", type=int, default=1, help="independent blocks N")
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--k", type=int, default=16, help="candidates per row")
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float16", "bfloat16"],
        help="dtype of the conv input x (codebooks stay float32)",
    )
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)

    n, b, h = args.blocks, args.block_size, args.hidden
    g = h // args.group_size
    rows, k, r, v = max(1, b - 1), args.k, args.rank, args.vocab
    dtype = getattr(mx, args.dtype)
    key = mx.random.key(0)
    ks = mx.random.split(key, 8)
    x = mx.random.normal((n, b, h), key=ks[0]).astype(dtype)
    dyn = (0.1 * mx.random.normal((n, b, 2, g), key=ks[1])).astype(dtype)
    base = mx.random.normal((2, h), key=ks[2]).astype(dtype)
    anchor = mx.random.randint(0, v, (n,), key=ks[3]).astype(mx.int32)
    cand = mx.random.randint(0, v, (n, rows, k), key=ks[4]).astype(mx.int32)
    unary = mx.random.normal((n, rows, k), key=ks[5])
    hidden = mx.random.normal((n, rows, r), key=ks[6])
    cb = mx.random.normal((2, v, r), key=ks[7]) * (r**-0.5)
    pred_cb, succ_cb = cb[0], cb[1]
    mx.eval(x, dyn, base, anchor, cand, unary, hidden, pred_cb, succ_cb)

    conv_args = (x, dyn, base)
    pair_args = (anchor, cand, unary, hidden, pred_cb, succ_cb)
    cases = {
        "two_tap_conv": (reference.reference_two_tap_conv, conv_args),
        "select_greedy": (reference.reference_select_greedy, pair_args),
    }

    metal = kernels._metal_device() and not kernels._forced_reference()
    status = kernels.prepare() if metal else kernels.active_kernels()
    results = []
    for name, (ref, call_args) in cases.items():
        results.append(
            {"kernel": name, "impl": "reference ops", **_time(lambda: ref(*call_args), args.iters, args.warmup)}
        )
        compiled = mx.compile(ref)
        results.append(
            {
                "kernel": name,
                "impl": "reference ops (mx.compile)",
                **_time(lambda: compiled(*call_args), args.iters, args.warmup),
            }
        )
        if metal and status.get(name) == "metal":
            results.append(
                {
                    "kernel": name,
                    "impl": "fused Metal kernel",
                    **_time(lambda: _metal_call(name, *call_args), args.iters, args.warmup),
                }
            )

    note = (
        "Metal available: fused kernels timed"
        if metal
        else "Metal not available on this machine (default device "
        f"{mx.default_device()}): only the reference ops were timed"
    )
    report = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "mlx": mx.__version__,
            "device": str(mx.default_device()),
        },
        "shapes": {
            "blocks": n,
            "block_size": b,
            "hidden": h,
            "groups": g,
            "selector_rows": rows,
            "k": k,
            "rank": r,
            "vocab": v,
            "conv_dtype": args.dtype,
            "codebook_dtype": "float32",
        },
        "active_kernels": status,
        "note": note,
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"# {note}")
    print(
        f"# N={n} B={b} H={h} G={g} (conv x {args.dtype}); selector R={rows} k={k} r={r} "
        f"V={v} (float32 codebooks); mlx {mx.__version__} on {mx.default_device()}"
    )
    print(f"{'kernel':<16} {'implementation':<28} {'median us':>10} {'p10 us':>10} {'p90 us':>10}")
    for row in results:
        print(
            f"{row['kernel']:<16} {row['impl']:<28} {row['median_us']:>10.1f} "
            f"{row['p10_us']:>10.1f} {row['p90_us']:>10.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
