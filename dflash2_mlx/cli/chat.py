"""`dflash2-mlx chat`: a streaming multi-turn terminal chat.

``chat_command`` parses the options, loads the pair, builds the generation settings and the
prefix cache (in memory, optionally on disk) and runs a ``ChatSession`` (``chat_session.py``)
until the user leaves.
"""

from __future__ import annotations

from typing import Optional

import typer

from dflash2_mlx.cli.chat_session import ChatSession
from dflash2_mlx.cli.common import (
    block_size_option,
    chat_sampling,
    check_positive,
    choose_models,
    copy_drafting_option,
    draft_option,
    fail,
    load_models,
    model_option,
    parse_block_size,
    preset_option,
    prompt_cache_location,
    prompt_cache_option,
    read_json_schema,
)
from dflash2_mlx.models.generation_config import generation_defaults

DEFAULT_MAX_TOKENS = 2048  # when neither --max-tokens nor the model's generation_config.json sets one


def chat_command(
    model: Optional[str] = model_option(),
    draft_model: Optional[str] = draft_option(),
    preset: Optional[str] = preset_option(),
    system: Optional[str] = typer.Option(None, "--system", "-s", help="System prompt (change it later with /system)."),
    max_tokens: Optional[int] = typer.Option(
        None,
        "--max-tokens",
        help="Maximum tokens per answer (reasoning included). Default: generation_config.json's max_new_tokens, else "
        "2048.",
    ),
    temp: Optional[float] = typer.Option(
        None, "--temp", help="Sampling temperature; 0 is greedy. Default: the model's generation_config.json, else 0."
    ),
    top_p: Optional[float] = typer.Option(
        None, "--top-p", help="Nucleus sampling mass (0, 1]. Default: generation_config.json, else 1."
    ),
    top_k: Optional[int] = typer.Option(
        None,
        "--top-k",
        help="Sample among the k most likely tokens; 0 disables. Default: generation_config.json, else 0.",
    ),
    min_p: Optional[float] = typer.Option(
        None,
        "--min-p",
        help="Drop tokens below min_p times the top probability. Default: generation_config.json, else 0.",
    ),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampling."),
    block_size: str = block_size_option(),
    no_copy_drafting: bool = copy_drafting_option(),
    no_draft: bool = typer.Option(
        False, "--no-draft", help="Plain autoregressive decoding (no drafter), for comparison."
    ),
    thinking: Optional[bool] = typer.Option(
        None,
        "--thinking/--no-thinking",
        help="Turn the model's reasoning on or off (chat template enable_thinking). Default: the template's.",
    ),
    show_thinking: bool = typer.Option(
        False, "--show-thinking", help="Print reasoning in full (dimmed) instead of collapsing it to one line."
    ),
    cache_gb: float = typer.Option(
        2.0,
        "--cache-gb",
        help="Memory budget of the prefix cache that lets later turns skip re-reading the conversation.",
    ),
    prompt_cache_dir: Optional[str] = prompt_cache_option(),
    prompt_cache_gb: float = typer.Option(
        8.0, "--prompt-cache-gb", help="Disk budget of the prompt cache directory, in GB."
    ),
    json_schema: Optional[str] = typer.Option(
        None, "--json-schema", help="Force every answer into this JSON Schema (a file; change it with /schema)."
    ),
) -> None:
    """Chat in the terminal with streaming answers, using the model's chat template.

    Each answer streams as it is decoded; reasoning (text inside the model's own thinking tags,
    e.g. <think>) is shown dimmed while it is
    written and then collapsed to one line (/think shows it, --show-thinking keeps it). After
    each answer one line gives the tokens, decode tok/s, acceptance length (tokens per verify
    cycle), time to first token and how much of the prompt was prefilled versus restored from
    the session's prefix cache: later turns only prefill what is new.

    Input: a line ending in a backslash continues on the next line; a line with only \"\"\"
    starts paste mode, ended by another \"\"\" line. Ctrl-C stops the current answer and the
    chat goes on; Ctrl-D or /exit leaves. Commands: /help, /clear, /system [TEXT],
    /schema [FILE], /stats, /think, /save FILE, /load FILE, /exit.
    """
    from rich.console import Console

    from dflash2_mlx.decoding.types import GenerationSettings

    if max_tokens is not None:
        check_positive("--max-tokens", max_tokens)
    schema = read_json_schema(json_schema) if json_schema is not None else None
    if cache_gb < 0:
        fail(f"--cache-gb must be 0 or more, got {cache_gb}")
    if prompt_cache_gb < 0:
        fail(f"--prompt-cache-gb must be 0 or more, got {prompt_cache_gb}")
    cache_dir = prompt_cache_location(prompt_cache_dir)
    if no_draft and draft_model is not None:
        fail("--no-draft and --draft-model contradict each other: pick one")
    choice = choose_models(model, draft_model, preset, need_draft=not no_draft)
    block_size = parse_block_size(block_size)
    target, drafter = load_models(choice, block_size)
    sampling = chat_sampling(target.path, temp, top_p, top_k, min_p)
    if max_tokens is None:
        max_tokens = int(generation_defaults(target.path).get("max_new_tokens", DEFAULT_MAX_TOKENS))
    settings = GenerationSettings(
        max_tokens=max_tokens,
        sampling=sampling,
        seed=seed,
        block_size=block_size,
        copy_drafting=not no_copy_drafting,
        stop_token_ids=sorted(target.tokenizer.eos_token_ids),
    )
    console = Console(highlight=False)
    disk = None
    if cache_dir is not None and prompt_cache_gb > 0:
        from dflash2_mlx.caches.disk import open_disk_cache

        disk = open_disk_cache(cache_dir, int(prompt_cache_gb * 2**30), target, drafter)
    session = ChatSession(
        target,
        drafter,
        settings,
        console,
        system,
        thinking,
        show_thinking,
        int(cache_gb * 2**30),
        choice.label,
        disk,
        schema,
        json_schema,
    )
    blocks = f"block {block_size}" if block_size else "auto block size"
    mode = (
        f"DFlash 2, {blocks}"
        if drafter is not None and drafter.config.is_dflash2
        else f"DFlash, {blocks}"
        if drafter is not None
        else "plain decoding"
    )
    samp = "greedy" if sampling.greedy else f"T={sampling.temperature:g}"
    console.print(f"dflash2-mlx chat · {choice.label} · {mode} · {samp}", style="bold", markup=False)
    console.print("/help for commands · Ctrl-C stops an answer · Ctrl-D or /exit leaves", style="dim", markup=False)
    try:
        session.run()
    finally:
        if disk is not None:
            disk.flush(timeout=30)  # the last turns' snapshots: written before the process ends
