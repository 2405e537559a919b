"""dflash2-mlx: the typer app.

Every error a user can cause ends in one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import json
import sys
from typing import List, Optional

import typer

app = typer.Typer(
    name="dflash2-mlx",
    help="Lossless DFlash 2 speculative decoding on MLX.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Lossless DFlash 2 speculative decoding on MLX."""


from dflash2_mlx.cli.common import (  # noqa: E402
    UserError,  # noqa: E402  (re-exported: commands raise it, main() prints it)
    block_size_option,
    copy_drafting_option,
    draft_option,
    model_option,
    preset_option,
)


@app.command()
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt text."),
    model: Optional[str] = model_option(),
    draft_model: Optional[str] = draft_option(),
    preset: Optional[str] = preset_option(),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Maximum number of tokens to generate."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature; 0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (0, 1]."),
    top_k: int = typer.Option(0, "--top-k", help="Sample among the k most likely tokens; 0 disables."),
    min_p: float = typer.Option(0.0, "--min-p", help="Drop tokens below min_p times the top probability."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed (sampling and the selector's draws)."),
    block_size: str = block_size_option(),
    no_copy_drafting: bool = copy_drafting_option(),
    stop: List[str] = typer.Option([], "--stop", help="Stop string (repeatable); the text stops before it."),
    no_draft: bool = typer.Option(False, "--no-draft", help="Plain autoregressive decoding with the same target."),
    ignore_chat_template: bool = typer.Option(False, "--ignore-chat-template", help="Feed the prompt text as is."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt (with the chat template)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with the text, tokens and statistics."),
    json_schema: Optional[str] = typer.Option(
        None,
        "--json-schema",
        help="Force the answer into this JSON Schema (a file); constrained decoding stays speculative and lossless.",
    ),
) -> None:
    """Generate a completion, speculatively (default) or autoregressively (--no-draft).

    With no --model it runs the default pair: SmolLM2-135M-Instruct (fetched on first use) and its
    shipped drafter. --model tiny is the embedded tiny code-completion demo pair (a code model: pair
    it with --ignore-chat-template and a code prefix, e.g. --prompt "def fibonacci(n):").
    $DFLASH2_MLX_MODEL (e.g. tiny) changes the default.
    """
    from dflash2_mlx.cli.common import (
        check_positive,
        choose_models,
        controller_line,
        decode_settings,
        load_models,
        parse_block_size,
        read_json_schema,
        sampling_settings,
        schema_grammar,
    )
    from dflash2_mlx.decoding.autoregressive import generate_autoregressive
    from dflash2_mlx.decoding.speculative import generate_speculative
    from dflash2_mlx.text.stops import encode_prompt

    check_positive("--max-tokens", max_tokens)
    schema = read_json_schema(json_schema) if json_schema is not None else None
    sampling = sampling_settings(temp, top_p, top_k, min_p)
    choice = choose_models(model, draft_model, preset, need_draft=not no_draft)
    block_size = parse_block_size(block_size)
    target, drafter = load_models(choice, None if no_draft else block_size, quiet=True)
    tokenizer = target.tokenizer
    ids = encode_prompt(tokenizer, prompt, use_chat_template=not ignore_chat_template, system=system)
    settings = decode_settings(
        tokenizer,
        max_tokens,
        sampling,
        seed,
        block_size,
        copy_drafting=not no_copy_drafting,
        stop_strings=stop,
        grammar=schema_grammar(schema, tokenizer, ids) if schema is not None else None,
    )
    if no_draft:
        events = generate_autoregressive(target.runner, ids, settings, tokenizer)
    else:
        events = generate_speculative(target.runner, drafter, ids, settings, tokenizer)
    tokens, pieces, stats = [], [], None
    for event in events:
        tokens += event.tokens
        pieces.append(event.text)
        if not as_json:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        stats = event.stats or stats
    text = "".join(pieces)
    if not no_draft and stats.verify_steps >= 8 and stats.acceptance_length < 1.5:
        typer.echo(
            f"warning: acceptance length {stats.acceptance_length:.2f} is far below what a matched drafter reaches; "
            "is this drafter made for this target (and its quantization)?",
            err=True,
        )
    if as_json:
        out = {"text": text, "tokens": tokens, **stats.as_dict()}
        if no_draft:
            out["verify_steps"], out["acceptance_length"] = 0, 1.0
        print(json.dumps(out))
        return
    print()
    mode = (
        "autoregressive"
        if no_draft
        else (
            f"acceptance length {stats.acceptance_length:.2f} over {stats.verify_steps} cycles; "
            + controller_line(stats)
        )
    )
    typer.echo(
        f"{stats.prompt_tokens} prompt tokens at {stats.prefill_tps:.1f} tok/s; "
        f"{stats.generation_tokens} tokens at {stats.decode_tps:.1f} tok/s; {mode}; "
        f"peak memory {stats.peak_memory_gb:.2f} GB",
        err=True,
    )


@app.command()
def doctor(
    self_test: bool = typer.Option(
        True, "--self-test/--no-self-test", help="Run the five-second lossless self-test on the embedded pair."
    ),
    report: Optional[str] = typer.Option(
        None,
        "--report",
        help="Write the acceptance report (one JSON file: system, kernels, rollback, lossless, speed, memory) to this "
        "file.",
    ),
    model: Optional[str] = model_option(),
    draft_model: Optional[str] = draft_option(),
    preset: Optional[str] = preset_option(),
    prompts: int = typer.Option(8, "--prompts", help="Report: prompts in the lossless section."),
    tokens: int = typer.Option(256, "--tokens", help="Report: greedy tokens per prompt in the lossless section."),
    speed_tokens: int = typer.Option(1024, "--speed-tokens", help="Report: generated tokens per speed run."),
    long: bool = typer.Option(False, "--long", help="Report: also measure speed at 8K generated tokens."),
) -> None:
    """Report the MLX backend, BLAS, kernels, rollback path, memory and model cache; run a lossless self-test.

    The self-test (about five seconds) decodes the embedded tiny pair's demo prompt speculatively
    and autoregressively (greedy) and compares the outputs: on the CPU in float32 they must be
    identical; on Metal with bf16 or quantized weights a divergence passes only at a near-tie of
    the target's top two logits (within the rounding bound measured on the spot). With --report
    FILE it writes the Mac acceptance report for the default pair or the pair given (see docs/mac.md).
    """
    import platform

    import mlx.core as mx
    from huggingface_hub import constants as hf

    from dflash2_mlx import __version__
    from dflash2_mlx.backend import blas, device
    from dflash2_mlx.caches import target as caches
    from dflash2_mlx.cli.common import check_positive, fail
    from dflash2_mlx.kernels import dispatch as kernels
    from dflash2_mlx.models import drafter_precision, named

    backend = device.backend()
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    try:
        rollback = caches.rollback_setting()
        drafter_line = drafter_precision.policy_line()
    except ValueError as e:
        fail(str(e))
    rows = [
        (
            "dflash2-mlx",
            f"{__version__} (Python {platform.python_version()}, {platform.system()} {platform.machine()})",
        ),
        (
            "MLX",
            f"{_version('mlx')} on {backend} ({info.get('device_name', 'unknown device')}); mlx-lm "
            f"{_version('mlx-lm')}",
        ),
        ("BLAS", blas.status if backend == "CPU" else "not used (GPU backend)"),
        ("kernels", ", ".join(f"{name}: {where}" for name, where in kernels.active_kernels().items())),
        ("rollback", _rollback_line(rollback)),
        ("exactness", _exactness_line(backend)),
        ("drafter", drafter_line),
        ("memory", _memory_line(info)),
        ("model cache", str(hf.HF_HUB_CACHE)),
        ("named models", str(named.cache_dir())),
        *((f"  {name}", where) for name, where in named.listing()),
    ]
    if model is not None:
        rows += _gguf_rows(model)
    width = max(len(k) for k, _ in rows + [("self-test", "")])
    for key, value in rows:
        typer.echo(f"{key:<{width}}  {value}")
    if report is not None:
        for name, value in (("--prompts", prompts), ("--tokens", tokens), ("--speed-tokens", speed_tokens)):
            check_positive(name, value, 2 if name == "--tokens" else 1)
        ok = _write_report(report, model, draft_model, preset, prompts, tokens, speed_tokens, long)
        if not ok:
            raise typer.Exit(1)
        return
    if self_test:
        ok, line = _self_test()
        typer.echo(f"{'self-test':<{width}}  {line}")
        if not ok:
            raise typer.Exit(1)


def _gguf_rows(model: str) -> list[tuple[str, str]]:
    """Where a GGUF target's weights run (quantized on Metal, float32 on the CPU) and why."""
    from dflash2_mlx.models import gguf

    try:
        found = gguf.find_gguf(model, fetch_missing=False)
    except ValueError as e:  # a named model not fetched yet, several .gguf files: say so in the report
        return [("GGUF", str(e))]
    return [] if found is None else [("GGUF", f"{found.name}: {gguf.placement_line()}")]


def _rollback_line(setting: str) -> str:
    from dflash2_mlx.backend import device

    where = (
        "CPU: each verify pass keeps its per-step states"
        if not device.metal_gpu()
        else "Metal: rollback replays the recurrence from the verify pass's recorded inputs"
    )
    path = {
        "keep": "keep (forced by DFLASH2_MLX_ROLLBACK)",
        "replay": "replay (forced by DFLASH2_MLX_ROLLBACK)",
        "auto": f"auto ({where}; DFLASH2_MLX_ROLLBACK=keep|replay overrides)",
    }[setting]
    return path


def _exactness_line(backend: str) -> str:
    if backend == "CPU":
        return "CPU float32: speculative output is identical to plain decoding, token for token"
    return (
        "bf16/quantized on the GPU: equal to plain decoding up to floating-point near-ties "
        "(verify rows and plain steps round differently); float32 models: identical"
    )


def _write_report(path, model, draft_model, preset, prompts, tokens, speed_tokens, long) -> bool:
    from dflash2_mlx.cli.common import choose_models, embedded_prompts, encode_line, encode_messages, load_models
    from dflash2_mlx.diagnostics import doctor_report

    choice = choose_models(model, draft_model, preset)
    target, drafter = load_models(choice, quiet=True)
    if choice.embedded:
        lines = embedded_prompts()
        ids = [encode_line(target.tokenizer, line) for line in lines]
    elif getattr(target.tokenizer, "chat_template", None):
        ids = [encode_messages(target.tokenizer, [{"role": "user", "content": p}]) for p in doctor_report.CHAT_PROMPTS]
    else:
        ids = [list(target.tokenizer.encode(p)) for p in doctor_report.CHAT_PROMPTS]
    ids = (ids * ((prompts + len(ids) - 1) // len(ids)))[:prompts]
    options = doctor_report.ReportOptions(prompts=prompts, tokens=tokens, speed_tokens=speed_tokens, long=long)
    result = doctor_report.build_report(
        target, drafter, ids, choice.label, options, progress=lambda line: typer.echo(f"report: {line}", err=True)
    )
    doctor_report.write_report(result, path)
    lossless = result["lossless"]
    typer.echo(
        f"report: {path}: lossless {lossless['verdict']} ({lossless['identical']}/{lossless['prompts']} "
        f"identical, rounding bound {lossless['rounding']['bound']:.3g}); attach it to your issue"
    )
    return lossless["verdict"] == "pass"


def _self_test(max_tokens: int = 48) -> tuple[bool, str]:
    """Speculative == autoregressive greedy on the embedded pair's first demo prompt (a
    divergence passes only within the measured rounding bound, see doctor_report)."""
    import time

    from dflash2_mlx.cli.common import ModelChoice, embedded_pair, embedded_prompts, encode_line, load_models
    from dflash2_mlx.decoding.autoregressive import generate_autoregressive
    from dflash2_mlx.decoding.speculative import generate_speculative
    from dflash2_mlx.decoding.types import GenerationSettings
    from dflash2_mlx.diagnostics import doctor_report
    from dflash2_mlx.models.loading import LoadError

    pair = embedded_pair()
    if pair is None:
        return True, "skipped: the embedded demo pair is not installed (dflash2_mlx/assets)"
    t0 = time.perf_counter()
    try:
        target, drafter = load_models(ModelChoice(str(pair[0]), str(pair[1]), "embedded tiny pair", True), quiet=True)
    except LoadError as e:
        return False, f"FAILED: the embedded pair does not load: {e}"
    lines = embedded_prompts() or [{"prompt": "The"}]
    ids = encode_line(target.tokenizer, lines[0])
    settings = GenerationSettings(max_tokens=max_tokens, stop_token_ids=sorted(target.tokenizer.eos_token_ids))
    spec, stats = [], None
    for event in generate_speculative(target.runner, drafter, ids, settings, target.tokenizer):
        spec += event.tokens
        stats = event.stats or stats
    plain = [
        t for event in generate_autoregressive(target.runner, ids, settings, target.tokenizer) for t in event.tokens
    ]
    seconds = time.perf_counter() - t0
    if spec != plain:
        bound = doctor_report.rounding_bound(target.runner, [(ids, plain)], drafter.config.block_size)["bound"]
        found = doctor_report.divergence(target.runner, ids, plain, spec, bound)
        where = f"outputs part at token {found['position']} of {len(plain)}"
        if not found["within_bound"]:
            gap = "no gap: one output is longer" if found["top2_gap"] is None else f"top-2 gap {found['top2_gap']:.3g}"
            return False, f"FAILED: {where} ({gap}, rounding bound {bound:.3g})"
        return True, (
            f"lossless up to a near-tie: {where}, top-2 gap {found['top2_gap']:.3g} within the "
            f"rounding bound {bound:.3g} ({seconds:.1f} s)"
        )
    return True, (
        f"lossless: speculative == autoregressive greedy on {len(plain)} tokens, "
        f"acceptance length {stats.acceptance_length:.2f} ({seconds:.1f} s)"
    )


def _register() -> None:
    """The commands that live in their own modules (imported here so `--help` lists them)."""
    from dflash2_mlx.cli.bench import bench_command
    from dflash2_mlx.cli.chat import chat_command
    from dflash2_mlx.cli.convert import convert_command
    from dflash2_mlx.cli.demo import demo_command
    from dflash2_mlx.cli.download import download_command
    from dflash2_mlx.cli.serve import serve_command
    from dflash2_mlx.cli.train import train_drafter_command

    app.command("chat")(chat_command)
    app.command("demo")(demo_command)
    app.command("bench")(bench_command)
    app.command("serve")(serve_command)
    app.command("convert")(convert_command)
    app.command("download")(download_command)
    app.command("train-drafter")(train_drafter_command)


_register()


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def _memory_line(info: dict) -> str:
    import os

    total = info.get("memory_size")
    if total is None and hasattr(os, "sysconf"):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            total = None
    line = f"{total / 2**30:.1f} GiB total" if total else "unknown total"
    if info.get("max_recommended_working_set_size"):
        line += f", {info['max_recommended_working_set_size'] / 2**30:.1f} GiB recommended working set"
    return line


def main() -> None:
    """Console entry point: runs the app and turns user errors into one line on stderr."""
    from dflash2_mlx.decoding.types import PromptTooLong
    from dflash2_mlx.models.loading import LoadError

    try:
        app(standalone_mode=False)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except (UserError, LoadError, PromptTooLong) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:
        # Click's usage errors (typer vendors click, so match on the interface, not the class).
        if not hasattr(e, "format_message") or not hasattr(e, "exit_code"):
            raise
        if e.exit_code == 0 or type(e).__name__ == "NoArgsIsHelpError":
            sys.exit(0)
        ctx = getattr(e, "ctx", None)
        command = f"dflash2-mlx {ctx.info_name} --help" if ctx is not None and ctx.parent else "dflash2-mlx --help"
        print(f"error: {e.format_message()} (see `{command}`)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
