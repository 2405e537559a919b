"""What both loops do before their first token: check the prompt, clip max tokens to the
context, key the request's draws (its seed, or one drawn for it), and make the statistics and the
output collector."""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

from dflash2_mlx.decoding.output import OutputCollector
from dflash2_mlx.decoding.sampling import request_seed
from dflash2_mlx.decoding.types import GenerationSettings, GenerationStats, PromptTooLong
from dflash2_mlx.models.target import TargetRunner


def check_prompt(prompt: Sequence[int], runner: TargetRunner, settings: GenerationSettings) -> int:
    """The max tokens this prompt leaves room for; a one-line error for a prompt that cannot run."""
    if len(prompt) == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if runner.max_context and len(prompt) >= runner.max_context:
        raise PromptTooLong(
            f"the prompt has {len(prompt)} tokens but the model's context is {runner.max_context}; shorten the prompt"
        )
    room = (runner.max_context - len(prompt)) if runner.max_context else settings.max_tokens
    return min(settings.max_tokens, room)


def start_request(
    runner: TargetRunner, prompt: Sequence[int], settings: GenerationSettings, tokenizer
) -> tuple[GenerationSettings, GenerationStats, OutputCollector]:
    """Checks, the draws' key, statistics and the output collector (its clock starts now)."""
    max_tokens = check_prompt(prompt, runner, settings)
    if max_tokens != settings.max_tokens:
        settings = dataclasses.replace(settings, max_tokens=max_tokens)
    if not settings.sampling.greedy:  # the key of the request's draws (sampling.request_seed)
        settings = dataclasses.replace(settings, seed=request_seed(settings.seed))
    stats = GenerationStats(prompt_tokens=len(prompt))
    return settings, stats, OutputCollector(settings, tokenizer, stats, time.perf_counter())
