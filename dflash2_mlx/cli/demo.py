"""`dflash2-mlx demo`: the same prompt decoded by DFlash 2 and by plain decoding, side by side.

Fairness: the two runs never share the machine. Each is measured on its own, one after the
other (after an untimed warm-up of both), recording the timestamp of every event; then both are
replayed side by side, each panel advancing on its own measured clock.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import typer

from dflash2_mlx.cli.common import (
    block_size_option,
    check_positive,
    choose_models,
    controller_line,
    copy_drafting_option,
    draft_option,
    encode_line,
    fail,
    fmt_seconds,
    load_models,
    model_option,
    parse_block_size,
    preset_option,
    printable,
    sampling_settings,
    sources_line,
)

SPEC_STYLES = ("bold cyan", "green")  # alternate per verify cycle, so the drafted blocks show
COPY_STYLES = ("bold yellow", "yellow")  # cycles that verified a copy of the context


@dataclass
class Recording:
    name: str
    events: list = field(default_factory=list)  # (elapsed s, text, n tokens, accepted or None, draft source)
    tokens: list = field(default_factory=list)
    stats: object = None

    @property
    def end(self) -> float:
        return self.events[-1][0] if self.events else 0.0


def record(name: str, events) -> Recording:
    rec = Recording(name)
    for event in events:
        rec.events.append((event.elapsed, event.text, len(event.tokens), event.accepted, event.source))
        rec.tokens += event.tokens
        rec.stats = event.stats or rec.stats
    return rec


def _panel(rec: Recording, t: float, final: bool, height: int, width: int, console, speculative: bool):
    from rich.panel import Panel
    from rich.text import Text

    body = Text()
    tokens = 0
    t_first = None
    shown = [e for e in rec.events if final or e[0] <= t]
    for i, (elapsed, text, n, _accepted, source) in enumerate(shown):
        tokens += n
        if n and t_first is None:
            t_first = elapsed
        styles = COPY_STYLES if source == "copy" else SPEC_STYLES
        style = styles[i % 2] if speculative and _accepted is not None else None  # plain steps unstyled
        body.append(printable(text), style=style)
    inner = max(10, width - 4)
    lines = body.wrap(console, inner)
    lines = lines[-height:] if len(lines) > height else lines
    view = Text("\n").join(lines) if len(lines) else Text("prefilling…", style="dim")
    now = rec.end if final else min(t, rec.end)
    if final and rec.stats is not None:
        tps = rec.stats.decode_tps
    else:
        tps = (tokens - 1) / (now - t_first) if t_first is not None and tokens > 1 and now > t_first else 0.0
    done = final or t >= rec.end
    footer = f"{tokens} tokens · {tps:.1f} tok/s · {now:.2f} s"
    title = f"[bold]{rec.name}[/bold]" + (" [green]✓[/green]" if done else "")
    return Panel(
        view,
        title=title,
        subtitle=footer,
        height=height + 2,
        width=width,
        border_style="cyan" if speculative else "magenta",
    )


def _summary(spec: Recording, ar: Recording, identical: Optional[bool]):
    from rich.text import Text

    from dflash2_mlx.cli.bench import bar

    s, a = spec.stats, ar.stats
    speedup = s.decode_tps / a.decode_tps if a.decode_tps else None
    out = Text()
    out.append(f"speedup {speedup:.2f}x" if speedup else "speedup n/a", style="bold green")
    out.append(
        f"  DFlash 2 {s.decode_tps:.1f} tok/s vs autoregressive {a.decode_tps:.1f} tok/s decode; "
        f"whole run {fmt_seconds(spec.end)} vs {fmt_seconds(ar.end)}\n"
    )
    out.append(f"acceptance length {s.acceptance_length:.2f}", style="bold")
    out.append(f" tokens per verify cycle ({s.verify_steps} cycles)")
    if identical is not None:
        out.append(" · outputs identical: ")
        out.append("yes" if identical else "NO", style="green" if identical else "bold red")
    drafts = sources_line(s.by_source)
    if drafts:
        out.append("\ndrafts: ", style="bold")
        out.append(drafts)
    if s.controller:
        out.append("\nblock size: ", style="bold")
        out.append(
            controller_line(s)
            + (f" · last switch {s.controller['last_switch']}" if s.controller.get("last_switch") else "")
        )
    out.append("\nacceptance by draft position\n", style="bold")
    for i, rate in enumerate(s.acceptance_by_position):
        out.append(f"  {i + 1:>2} ")
        out.append(bar(rate, 30), style="green")
        out.append(f" {100 * rate:5.1f}%\n")
    return out


def frame(spec: Recording, ar: Recording, t: float, final: bool, console, height: int, identical=None):
    from rich.console import Group
    from rich.table import Table

    width = max(40, console.width)
    half = (width - 1) // 2
    grid = Table.grid(padding=(0, 1))
    grid.add_column(width=half)
    grid.add_column(width=half)
    grid.add_row(
        _panel(spec, t, final, height, half, console, True), _panel(ar, t, final, height, half, console, False)
    )
    if not final:
        return grid
    return Group(grid, _summary(spec, ar, identical))


def demo_command(
    model: Optional[str] = model_option(),
    draft_model: Optional[str] = draft_option(),
    preset: Optional[str] = preset_option(),
    prompt: Optional[str] = typer.Option(
        None,
        "--prompt",
        "-p",
        help="The prompt (through the chat template). Default: the embedded pair's demo prompt, or a built-in one.",
    ),
    ignore_chat_template: bool = typer.Option(False, "--ignore-chat-template", help="Feed --prompt as is."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Tokens to generate in each run."),
    temp: float = typer.Option(
        0.0, "--temp", help="Sampling temperature; 0 is greedy (then the two outputs must be identical)."
    ),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed (set before each run)."),
    block_size: str = block_size_option(),
    no_copy_drafting: bool = copy_drafting_option(),
    replay_speed: float = typer.Option(
        1.0, "--replay-speed", help="Replay clock rate: 1 is the measured pace, 2 twice as fast."
    ),
    height: int = typer.Option(16, "--height", help="Text lines shown in each panel."),
    export: Optional[Path] = typer.Option(None, "--export", help="Save the final frame as FILE.svg or FILE.html."),
) -> None:
    """DFlash 2 and plain autoregressive decoding of the same prompt, side by side.

    Fair by construction: the two runs are measured one after the other, never at once (after an
    untimed warm-up of both), recording the timestamp of every event; then both are replayed in
    two live panels at their measured pace, each panel advancing on its own measured clock. Each
    panel shows the text (DFlash 2's colored per verify cycle), tokens, decode tok/s and elapsed
    time; the end shows the speedup, the acceptance length and the acceptance rate per draft
    position. With no arguments it runs the default pair (SmolLM2 and its drafter when installed, else
    the embedded tiny pair, each on its own demo request).
    """
    from dataclasses import replace

    from rich.console import Console
    from rich.live import Live

    from dflash2_mlx.cli.common import decode_settings
    from dflash2_mlx.decoding.autoregressive import generate_autoregressive
    from dflash2_mlx.decoding.speculative import generate_speculative
    from dflash2_mlx.diagnostics.bench import BUILTIN_PROMPTS

    check_positive("--max-tokens", max_tokens)
    check_positive("--height", height, 2)
    if replay_speed <= 0:
        fail(f"--replay-speed must be positive, got {replay_speed}")
    if export is not None and export.suffix.lower() not in (".svg", ".html", ".htm"):
        fail(f"--export saves .svg or .html, got {export}")
    sampling = sampling_settings(temp)
    choice = choose_models(model, draft_model, preset)
    if prompt is None and choice.embedded:
        from dflash2_mlx.assets import DEMO_REQUEST

        prompt = DEMO_REQUEST
    elif prompt is None:
        from dflash2_mlx.models.named import named_model

        known = named_model(choice.target)
        prompt = known.demo_request if known is not None else None
    if prompt is not None:
        line = {"prompt": prompt} if ignore_chat_template else {"messages": [{"role": "user", "content": prompt}]}
    else:
        line = BUILTIN_PROMPTS[0]
    block_size = parse_block_size(block_size)
    target, drafter = load_models(choice, block_size)
    tokenizer = target.tokenizer
    if "messages" in line and not getattr(tokenizer, "chat_template", None):
        line = {"prompt": line["messages"][-1]["content"]}
    ids = encode_line(tokenizer, line)
    settings = decode_settings(tokenizer, max_tokens, sampling, seed, block_size, copy_drafting=not no_copy_drafting)
    console = Console(highlight=False)
    shown = line["prompt"] if "prompt" in line else line["messages"][-1]["content"]
    console.print(f"[bold]prompt[/bold] ({len(ids)} tokens): ", end="")
    console.print(printable(shown if len(shown) <= 400 else shown[:400] + "…"), markup=False)
    console.print(
        f"[dim]{choice.label}: warming up, then measuring DFlash 2 and autoregressive one after the other…[/dim]"
    )
    short = replace(settings, max_tokens=min(max_tokens, 16))
    record("warm-up", generate_speculative(target.runner, drafter, ids, short, tokenizer))
    record("warm-up", generate_autoregressive(target.runner, ids, short, tokenizer))
    name = "DFlash 2" if drafter.config.is_dflash2 else "DFlash"
    spec = record(f"{name} (speculative)", generate_speculative(target.runner, drafter, ids, settings, tokenizer))
    ar = record("Autoregressive", generate_autoregressive(target.runner, ids, settings, tokenizer))
    identical = (spec.tokens == ar.tokens) if sampling.greedy else None
    console.print(
        f"[dim]measured: {name} {len(spec.tokens)} tokens in {fmt_seconds(spec.end)}, autoregressive "
        f"{len(ar.tokens)} tokens in {fmt_seconds(ar.end)}; replaying side by side at "
        f"{'the measured pace' if replay_speed == 1 else f'{replay_speed:g}x the measured pace'}[/dim]"
    )
    end = max(spec.end, ar.end)
    start = time.perf_counter()
    with Live(
        frame(spec, ar, 0.0, False, console, height), console=console, refresh_per_second=20, auto_refresh=False
    ) as live:
        try:
            while True:
                t = (time.perf_counter() - start) * replay_speed
                if t >= end:
                    break
                live.update(frame(spec, ar, t, False, console, height), refresh=True)
                time.sleep(1 / 30)
        except KeyboardInterrupt:
            pass  # skip to the end
        live.update(frame(spec, ar, end, True, console, height, identical), refresh=True)
    if export is not None:
        rec = Console(
            record=True,
            width=max(console.width, 100),
            file=io.StringIO(),
            force_terminal=True,
            color_system="truecolor",
        )
        rec.print(frame(spec, ar, end, True, rec, height, identical))
        try:
            if export.suffix.lower() == ".svg":
                export.write_text(
                    spaces_kept(rec.export_svg(title=f"dflash2-mlx demo: {choice.label}")), encoding="utf-8"
                )
            else:
                rec.save_html(str(export))
        except OSError as e:
            fail(f"cannot write {export}: {e.strerror or e}")
        console.print(f"[dim]final frame saved to {export}[/dim]")


def spaces_kept(svg: str) -> str:
    """rich's SVG puts each styled run in its own <text>, starting or ending with a (non-breaking)
    space where a token does; SVG renderers strip those unless told to keep whitespace, which
    glues tokens together ("notisinstance(other ,"). Keep it, as the terminal does."""
    return svg.replace("<svg ", '<svg xml:space="preserve" style="white-space: pre" ', 1)
