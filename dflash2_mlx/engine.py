"""The decode loops: speculative (draft -> verify -> accept -> roll back) and plain autoregressive.

Both yield ``GenerationEvent``s; the last one carries ``GenerationStats``. State between
speculative cycles: committed tokens t[0..n]; the target cache covers t[0..n-1]; t[n] (the
anchor) is not in it yet; the drafter's context cache holds the projected target features of the
committed positions before the ones in ``new_features``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import mlx.core as mx

from .drafter import Drafter
from .sampling import LogitsProcessor, SamplingSettings, apply_processors, probabilities, rejection_step, sample
from .target import TargetRunner
from .text import StopStrings


class PromptTooLong(ValueError):
    """The prompt does not fit the target's context."""


@dataclass
class GenerationSettings:
    max_tokens: int = 256
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    seed: Optional[int] = None
    block_size: Optional[int] = None  # None: the drafter's own
    stop_token_ids: Sequence[int] = ()
    stop_strings: Sequence[str] = ()
    logits_processors: Sequence[LogitsProcessor] = ()
    prefill_step_size: int = 512


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    verify_steps: int = 0
    cycle_tokens: int = 0  # tokens emitted by verify cycles (all but the prefill's)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    peak_memory_gb: float = 0.0
    finish_reason: Optional[str] = None

    @property
    def acceptance_length(self) -> float:
        return self.cycle_tokens / self.verify_steps if self.verify_steps else 1.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        n = self.generation_tokens - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "verify_steps": self.verify_steps,
            "acceptance_length": self.acceptance_length,
            "draft_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_by_position": self.acceptance_by_position,
            "prefill_tps": self.prefill_tps,
            "decode_tps": self.decode_tps,
            "peak_memory_gb": self.peak_memory_gb,
            "finish_reason": self.finish_reason,
        }


@dataclass
class GenerationEvent:
    tokens: list[int]  # new tokens of this step
    text: str  # their text (held back while it may still become a stop string)
    accepted: Optional[int] = None  # drafted tokens accepted this cycle (None: not a cycle)
    drafted: int = 0
    stats: Optional[GenerationStats] = None  # on the final event only
    finish_reason: Optional[str] = None


class _Output:
    """Collects tokens, applies stop tokens / strings / max tokens, and builds events."""

    def __init__(self, settings: GenerationSettings, tokenizer, stats: GenerationStats, t_start: float):
        self.settings, self.stats, self.t_start = settings, stats, t_start
        self.stop_ids = set(settings.stop_token_ids)
        self.detok = tokenizer.detokenizer if tokenizer is not None else None
        if self.detok is not None:
            self.detok.reset()
        self.stops = StopStrings(settings.stop_strings)
        self.tokens: list[int] = []
        self.t_first = self.t_last = None
        self.finished: Optional[str] = None

    def add(self, new: list[int], accepted: Optional[int] = None, drafted: int = 0) -> GenerationEvent:
        """Clip ``new`` at a stop token or max tokens; returns the event for what was kept."""
        kept = []
        for t in new:
            if len(self.tokens) + len(kept) >= self.settings.max_tokens:
                self.finished = "length"
                break
            kept.append(t)
            if t in self.stop_ids:
                self.finished = "stop"
                break
        if not self.finished and len(self.tokens) + len(kept) >= self.settings.max_tokens:
            self.finished = "length"
        self.tokens += kept
        now = time.perf_counter()
        self.t_first = self.t_first or now
        self.t_last = now
        text = ""
        if self.detok is not None:
            for t in kept:
                if t not in self.stop_ids:
                    self.detok.add_token(t)
            if self.finished:
                self.detok.finalize()
            text = self.detok.last_segment
            text, hit = self.stops.feed(text, final=self.finished is not None)
            if hit:
                self.finished = "stop"
        if self.finished:
            text += self.stops.flush() if not self.stops.hit else ""
        return GenerationEvent(kept, text, accepted, drafted, finish_reason=self.finished)

    def finish(self, event: GenerationEvent) -> GenerationEvent:
        s = self.stats
        s.generation_tokens = len(self.tokens)
        s.decode_seconds = (self.t_last - self.t_first) if self.t_first else 0.0
        s.peak_memory_gb = mx.get_peak_memory() / 1e9
        s.finish_reason = self.finished or "length"
        event.stats, event.finish_reason = s, s.finish_reason
        return event


def _check_prompt(prompt: Sequence[int], runner: TargetRunner, settings: GenerationSettings) -> int:
    if len(prompt) == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if runner.max_context and len(prompt) >= runner.max_context:
        raise PromptTooLong(
            f"the prompt has {len(prompt)} tokens but the model's context is {runner.max_context}; "
            "shorten the prompt"
        )
    room = (runner.max_context - len(prompt)) if runner.max_context else settings.max_tokens
    return min(settings.max_tokens, room)


def prefill(runner, prompt, cache, taps=None, keep_features=None, step=512):
    """Feed the prompt in chunks; returns the last row's logits [1, V] and the tapped features of
    the last ``keep_features`` prompt positions (all when None)."""
    tokens = mx.array(prompt, dtype=mx.int32)[None]
    features = []
    start, total = 0, len(prompt)
    while start < total:
        end = min(start + step, total)
        is_last = end == total
        logits, feats = runner(tokens[:, start:end], cache, taps, logits_from=(end - start - 1) if is_last else end - start)
        if taps:
            features.append(feats)
            if keep_features is not None:
                kept = mx.concatenate(features, axis=1)[:, -keep_features:]
                features = [kept]
        if not is_last:
            mx.eval([c.state for c in cache.layers], features)
        start = end
    feats = mx.concatenate(features, axis=1) if features else None
    return logits[:, -1], feats


def _pick(logits: mx.array, history: mx.array, settings: GenerationSettings) -> mx.array:
    """The next token from one row of logits [1, V], exactly as plain decoding picks it."""
    logits = apply_processors(settings.logits_processors, history, logits)
    if settings.sampling.greedy:
        return mx.argmax(logits, axis=-1)
    return sample(probabilities(logits, settings.sampling))


def generate_autoregressive(
    runner: TargetRunner, prompt: Sequence[int], settings: GenerationSettings, tokenizer=None
) -> Iterator[GenerationEvent]:
    """Plain decoding with the same target, processing and events (the baseline)."""
    max_tokens = _check_prompt(prompt, runner, settings)
    settings = _with_max(settings, max_tokens)
    if settings.seed is not None:
        mx.random.seed(settings.seed)
    stats = GenerationStats(prompt_tokens=len(prompt))
    t0 = time.perf_counter()
    out = _Output(settings, tokenizer, stats, t0)
    cache = runner.make_cache()
    history = list(prompt)
    logits, _ = prefill(runner, prompt, cache, step=settings.prefill_step_size)
    token = _pick(logits, mx.array(history), settings)
    mx.eval(token)
    stats.prefill_seconds = time.perf_counter() - t0
    while True:
        t = int(token.item())
        history.append(t)
        event = out.add([t])
        if out.finished:
            yield out.finish(event)
            return
        yield event
        logits, _ = runner(mx.array([[t]]), cache)
        token = _pick(logits[:, -1], mx.array(history), settings)
        mx.async_eval(token)


def generate_speculative(
    runner: TargetRunner,
    drafter: Drafter,
    prompt: Sequence[int],
    settings: GenerationSettings,
    tokenizer=None,
) -> Iterator[GenerationEvent]:
    """Lossless speculative decoding: greedy output equals ``generate_autoregressive``'s token for
    token; sampled output follows exactly the target's distribution."""
    cfg = drafter.config
    block_size = settings.block_size or cfg.block_size
    if not 1 < block_size <= cfg.block_size:
        raise ValueError(f"block size must be in 2..{cfg.block_size} for this drafter, got {block_size}")
    max_tokens = _check_prompt(prompt, runner, settings)
    settings = _with_max(settings, max_tokens)
    if settings.seed is not None:
        mx.random.seed(settings.seed)
    sampling, greedy = settings.sampling, settings.sampling.greedy
    taps = cfg.target_layer_ids
    stats = GenerationStats(prompt_tokens=len(prompt))
    stats.accepted_by_position = [0] * (block_size - 1)
    stats.drafted_by_position = [0] * (block_size - 1)
    t0 = time.perf_counter()
    out = _Output(settings, tokenizer, stats, t0)
    cache, context = runner.make_cache(), drafter.make_cache()
    window = cfg.context_window
    logits, new_features = prefill(runner, prompt, cache, taps, window, settings.prefill_step_size)
    context.skip(len(prompt) - new_features.shape[1])  # rows no drafter layer can see
    committed = list(prompt)
    token = _pick(logits, mx.array(committed), settings)
    mx.eval(token)
    stats.prefill_seconds = time.perf_counter() - t0
    anchor = int(token.item())
    committed.append(anchor)
    event = out.add([anchor])
    mask_id = cfg.mask_token_id
    hybrid = "gdn" in runner.kinds
    while not out.finished:
        yield event
        bs = min(block_size, max_tokens - len(out.tokens) + 1)  # never draft past max_tokens
        # Draft: block = [anchor, MASK * (bs-1)] at positions n..n+bs-1.
        block = mx.array([[anchor] + [mask_id] * (bs - 1)], dtype=mx.int32)
        block_embeds = runner.embed(block) * cfg.input_embedding_scale
        hidden = drafter(block_embeds, new_features, context)[:, 1:]  # [1, bs-1, H]
        draft_logits = drafter.logits(hidden, runner.lm_head)  # [1, bs-1, V]
        candidates = q = None
        if cfg.is_dflash2 and greedy:
            draft = drafter.candidate_selector.greedy(hidden, draft_logits, block[:, 0])[0]
        elif cfg.is_dflash2:
            uniforms = mx.random.uniform(shape=(1, bs - 1))
            draft, candidates, q = drafter.candidate_selector.sampled(
                hidden, draft_logits, block[:, 0], sampling.temperature, uniforms)
            draft, candidates, q = draft[0], candidates[0], q[0]
        elif greedy:
            draft = mx.argmax(draft_logits[0], axis=-1)
        else:
            q = probabilities(draft_logits[0], sampling)
            draft = sample(q)
        draft = draft.astype(mx.int32)  # [bs-1]
        # Verify: the target runs [anchor, d1..d(bs-1)] in one pass.
        recorded = [] if hybrid else None
        verify_logits, verify_features = runner(mx.concatenate([block[0, :1], draft])[None], cache, taps, recorded)
        history = mx.concatenate([mx.array(committed, dtype=mx.int32), draft])
        verify_logits = apply_processors(settings.logits_processors, history, verify_logits[0])
        # Accept: the longest agreeing prefix (greedy) or rejection sampling; one host sync.
        if greedy:
            target_tokens = mx.argmax(verify_logits, axis=-1)
            mx.eval(draft, target_tokens)
            drafted, targeted = draft.tolist(), target_tokens.tolist()
            accepted = next((i for i, (d, t) in enumerate(zip(drafted, targeted)) if d != t), bs - 1)
            bonus = targeted[accepted]
        else:
            p = probabilities(verify_logits, sampling)
            accepted_arr, next_tokens = rejection_step(draft, p, q, candidates)
            mx.eval(draft, accepted_arr, next_tokens)
            drafted, accepted = draft.tolist(), int(accepted_arr.item())
            bonus = int(next_tokens[accepted].item())
        new_tokens = drafted[:accepted] + [bonus]
        # Roll back: the target keeps n+accepted+1 positions; the drafter gets the new rows next cycle.
        cache.rollback(recorded or [], fed=bs, keep=accepted + 1)
        new_features = verify_features[:, : accepted + 1]
        committed += new_tokens
        anchor = bonus
        event = out.add(new_tokens, accepted, bs - 1)
        stats.verify_steps += 1
        stats.cycle_tokens += len(event.tokens)
        stats.drafted_tokens += bs - 1
        stats.accepted_tokens += accepted
        for i in range(bs - 1):
            stats.drafted_by_position[i] += 1
            stats.accepted_by_position[i] += int(i < accepted)
    yield out.finish(event)


def _with_max(settings: GenerationSettings, max_tokens: int) -> GenerationSettings:
    if max_tokens == settings.max_tokens:
        return settings
    from dataclasses import replace
    return replace(settings, max_tokens=max_tokens)
