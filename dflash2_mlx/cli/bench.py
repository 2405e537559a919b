"""`dflash2-mlx bench`: acceptance length and throughput, speculative against autoregressive."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from dflash2_mlx.cli.common import (
    block_size_option,
    check_positive,
    choose_models,
    copy_drafting_option,
    draft_option,
    embedded_prompts,
    encode_line,
    fail,
    load_models,
    model_option,
    parse_block_size,
    preset_option,
    sampling_settings,
    sources_line,
)

# the held-out prompts a drafter build writes beside the drafter (training/smollm2/build.py)
HELDOUT_FILE = "heldout_prompts.jsonl"


def heldout_prompts(model: str) -> list[dict]:
    """The prompts held out from the training of a named model's shipped drafter (the file its
    build writes beside it), as bench lines; [] when there are none."""
    from dflash2_mlx.diagnostics import bench
    from dflash2_mlx.models.named import shipped_drafter

    drafter = shipped_drafter(model)
    if drafter is None or not (drafter / HELDOUT_FILE).is_file():
        return []
    return bench.read_prompts(drafter / HELDOUT_FILE)


def bench_command(
    model: Optional[str] = model_option(),
    draft_model: Optional[str] = draft_option(),
    preset: Optional[str] = preset_option(),
    prompts: Optional[Path] = typer.Option(
        None,
        "--prompts",
        help='JSON-lines prompt file: {"prompt": "..."} per line (fed as is) or '
        '{"messages": [...]} (chat template applied). Default: the pair\'s own set (the embedded '
        "pair's prompts; the prompts held out from the training of smollm2's drafter), else a built-in one.",
    ),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Tokens generated per prompt and mode."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature; 0 is greedy (then `identical` is checked)."),
    block_size: str = block_size_option(),
    no_copy_drafting: bool = copy_drafting_option(),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed, set before each run."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Only the first N prompts."),
    as_json: bool = typer.Option(
        False, "--json", help='Print one JSON object {"mean": {...}, "prompts": [...]} on stdout.'
    ),
    plot: Optional[Path] = typer.Option(
        None, "--plot", help="Save a PNG chart (needs the `plot` extra: pip install 'dflash2-mlx\\[plot]')."
    ),
    profile: bool = typer.Option(
        False,
        "--profile",
        help="Then decode the prompts once more with a host sync after every phase and "
        "report where a cycle's time goes (draft, selector, verify, accept, rollback, other) as shares "
        'of the cycle; with --json, under "profile".',
    ),
) -> None:
    """Acceptance length and decode throughput over a prompt set, DFlash 2 against plain decoding.

    For each prompt the speculative and the autoregressive run follow each other (alternating which
    goes first), after one untimed warm-up of both. Per prompt and mean: acceptance length (tokens
    per verify cycle), decode tok/s of both, speedup, and whether the greedy outputs are identical.
    mean.acceptance_length = all cycle tokens / all cycles; mean tok/s are means over prompts;
    mean.speedup = mean spec tok/s / mean AR tok/s.
    """
    from rich.console import Console

    from dflash2_mlx.cli.common import decode_settings
    from dflash2_mlx.diagnostics import bench

    check_positive("--max-tokens", max_tokens)
    check_positive("--limit", limit)
    sampling = sampling_settings(temp)
    if plot is not None:
        if plot.suffix.lower() != ".png":
            fail(f"--plot writes a PNG: give a file name ending in .png, got {plot}")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            fail("--plot needs matplotlib: pip install 'dflash2-mlx[plot]'")
    choice = choose_models(model, draft_model, preset)
    try:
        if prompts is not None:
            lines = bench.read_prompts(prompts)
        else:
            lines = (embedded_prompts() if choice.embedded else heldout_prompts(choice.target)) or list(
                bench.BUILTIN_PROMPTS
            )
    except bench.PromptFileError as e:
        fail(str(e))
    if limit is not None:
        lines = lines[:limit]
    block_size = parse_block_size(block_size)
    target, drafter = load_models(choice, block_size)
    tokenizer = target.tokenizer
    settings = decode_settings(tokenizer, max_tokens, sampling, seed, block_size, copy_drafting=not no_copy_drafting)
    err = Console(stderr=True)

    def progress(i: int, r: dict) -> None:
        if as_json and not err.is_terminal:
            return
        speed = f"{r['speedup']:.2f}x" if r["speedup"] else "n/a"
        same = {True: "identical", False: f"DIFFERS at token {r['first_difference']}", None: "sampled"}[r["identical"]]
        err.print(
            f"[dim]prompt {i + 1}/{len(lines)}: acceptance {r['acceptance_length']:.2f}, "
            f"{r['spec_decode_tps']:.1f} vs {r['ar_decode_tps']:.1f} tok/s ({speed}), {same}[/dim]",
            highlight=False,
        )

    result = bench.run_bench(
        target, drafter, lines, settings, lambda line: encode_line(tokenizer, line), on_prompt=progress
    )
    if plot is not None:
        bench.plot(result, plot, title=f"{choice.label}, {max_tokens} tokens, T={temp:g}")
    profiled = None
    if profile:
        profiled = bench.profile_cycles(target, drafter, lines, settings, lambda line: encode_line(tokenizer, line))
        ar_tps = result.contract["mean"]["ar_decode_tps"]
        profiled["ar_step_ms"] = 1000 / ar_tps if ar_tps else None
    if as_json:
        extra = {"acceptance_by_position": result.acceptance_by_position}
        print(json.dumps({**result.contract, **extra, **({"profile": profiled} if profiled else {})}))
        if plot is not None:
            err.print(f"plot saved to {plot}", highlight=False)
        return
    out = Console()
    out.print(_table(result, choice.label, max_tokens, temp, settings.block_size or "auto"))
    out.print(_position_bars(result.acceptance_by_position))
    drafts = sources_line(result.contract["mean"]["by_source"])
    if drafts:
        out.print(f"drafts: {drafts}", highlight=False)
    if profiled is not None:
        out.print(_profile_table(profiled))
    if plot is not None:
        out.print(f"plot saved to {plot}", highlight=False)
    if any(r["identical"] is False for r in result.contract["prompts"]):
        err.print(
            "[yellow]warning: some greedy outputs differ between speculative and plain decoding "
            "(expected only for bf16/quantized models on Apple GPUs, at near-ties)[/yellow]"
        )


def _table(result, label: str, max_tokens: int, temp: float, block_size):
    from rich.table import Table

    table = Table(
        title=f"DFlash 2 vs autoregressive: {label}, {max_tokens} tokens, T={temp:g}, block {block_size}",
        title_justify="left",
    )
    table.add_column("#", justify="right")
    table.add_column("prompt", overflow="ellipsis", no_wrap=True, max_width=44)
    table.add_column("tokens", justify="right")
    table.add_column("accept len", justify="right")
    table.add_column("DFlash 2 tok/s", justify="right")
    table.add_column("AR tok/s", justify="right")
    table.add_column("speedup", justify="right")
    table.add_column("same", justify="center")
    table.add_column(
        "speculative / copy / plain / probe tokens, blocks", overflow="ellipsis", no_wrap=True, max_width=44
    )
    for i, (r, d) in enumerate(zip(result.contract["prompts"], result.details)):
        same = {True: "[green]yes[/green]", False: f"[red]no @{d['first_difference']}[/red]", None: "–"}[r["identical"]]
        table.add_row(
            str(i + 1),
            d["prompt"],
            str(d["generation_tokens"]),
            f"{r['acceptance_length']:.2f}",
            f"{r['spec_decode_tps']:.1f}",
            f"{r['ar_decode_tps']:.1f}",
            _x(r["speedup"]),
            same,
            _modes(r["controller"]),
        )
    m = result.contract["mean"]
    table.add_section()
    table.add_row(
        "",
        "[bold]mean[/bold]",
        "",
        f"[bold]{m['acceptance_length']:.2f}[/bold]",
        f"[bold]{m['spec_decode_tps']:.1f}[/bold]",
        f"[bold]{m['ar_decode_tps']:.1f}[/bold]",
        f"[bold]{_x(m['speedup'])}[/bold]",
        "",
        _modes(m["controller"]),
    )
    return table


def _modes(controller: Optional[dict]) -> str:
    if not controller:
        return ""
    share = controller["share_by_mode"]
    sizes = " ".join(f"{b}:{n}" for b, n in controller["block_sizes"].items())
    modes = "/".join(f"{100 * share.get(m, 0.0):.0f}" for m in ("speculative", "copy", "plain", "probe"))
    return f"{modes}%  {sizes}"


def _profile_table(profiled: dict):
    from rich.table import Table

    from dflash2_mlx.decoding.profiling import DESCRIPTIONS, PHASES

    step = profiled.get("ar_step_ms")
    per_cycle = profiled["ms_per_cycle"]
    title = (
        f"Where a cycle goes: {per_cycle:.1f} ms per cycle (profiled, with a sync per phase) over "
        f"{profiled['cycles']} cycles" + (f"; one autoregressive step {step:.1f} ms" if step else "")
    )
    table = Table(title=title, title_justify="left")
    table.add_column("phase")
    table.add_column("share", justify="right")
    table.add_column("ms / cycle", justify="right")
    table.add_column("what")
    for phase in PHASES:
        table.add_row(
            phase, f"{100 * profiled['shares'][phase]:.1f}%", f"{profiled['ms'][phase]:.2f}", DESCRIPTIONS[phase]
        )
    return table


def _x(v: Optional[float]) -> str:
    return f"{v:.2f}x" if v else "n/a"


def _position_bars(by_position: list[float]):
    """Acceptance rate per draft position as a bar chart in text."""
    from rich.text import Text

    text = Text("acceptance by draft position\n", style="bold")
    for i, rate in enumerate(by_position):
        text.append(f"  {i + 1:>2} ")
        text.append(bar(rate, 30), style="green")
        text.append(f" {100 * rate:5.1f}%\n")
    return text


def bar(fraction: float, width: int) -> str:
    """A horizontal bar with eighth-block resolution."""
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + ("▏▎▍▌▋▊▉"[part - 1] if part else "")).ljust(width, "·")
