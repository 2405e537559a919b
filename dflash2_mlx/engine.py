"""The decode loops: speculative (draft -> verify -> accept -> roll back) and plain autoregressive.

Both yield ``GenerationEvent``s; the last one carries ``GenerationStats``. State between
speculative cycles: committed tokens t[0..n]; the target cache covers t[0..n-1]; t[n] (the
anchor) is not in it yet; the drafter's context cache holds the projected target features of the
committed positions before the ones in ``new_features``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Generator, Iterator, Optional, Sequence, Union

import mlx.core as mx

from dflash2_mlx.caches.prefix import PrefixCache, PrefixEntry
from dflash2_mlx.constraints.grammar import Grammar, GrammarState
from dflash2_mlx.decoding.batched_verify import VerifyRequest, VerifyResult, answer_alone
from dflash2_mlx.decoding.profiling import CycleProfiler
from dflash2_mlx.decoding.sampling import (
    LogitsProcessor,
    SamplingSettings,
    apply_processors,
    probabilities,
    rejection_step,
    sample,
)
from dflash2_mlx.models.drafter import Drafter
from dflash2_mlx.models.target import TargetRunner
from dflash2_mlx.policies.block_size import BlockPolicy, policy_for
from dflash2_mlx.text.stops import StopStrings

UNSEEN_BATCH = 32  # plain steps' feature rows are moved into the drafter's context this many at a time


class PromptTooLong(ValueError):
    """The prompt does not fit the target's context."""


@dataclass
class GenerationSettings:
    max_tokens: int = 256
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    seed: Optional[int] = None
    block_size: Optional[int] = None  # None: the break-even controller picks each cycle's (2..B, or plain)
    policy: Optional[BlockPolicy] = None  # overrides block_size (tests force schedules with it)
    stop_token_ids: Sequence[int] = ()
    stop_strings: Sequence[str] = ()
    logits_processors: Sequence[LogitsProcessor] = ()
    prefill_step_size: int = 512
    logprobs: int = 0  # 0: off; n: each token's log-probability and the top n alternatives
    cancel: Optional[threading.Event] = None  # set it to stop (checked between chunks and cycles)
    grammar: Optional[Grammar] = None  # constrained output: masks every picked and verified token
    # DFlash 2 under a grammar: the selector's walk skips candidates the grammar refuses (greedy
    # and sampled). Only acceptance changes, the verify masks keep the output exact. None: walk
    # while the drafter's proposals are often refused (GrammarState.walk_pays); True: every
    # block; False: never (benchmarks/draft_masking.py compares them).
    mask_drafts: Optional[bool] = None
    # An empty event between prefill chunks, so that a caller interleaving several generations
    # (the server's scheduler) can run others' cycles while a long prompt is read.
    yield_during_prefill: bool = False
    # bench --profile: time per cycle phase (adds host syncs, and drafts every block after the
    # previous cycle's sync instead of ahead of it, so that the phases do not overlap)
    profiler: Optional[CycleProfiler] = None


@dataclass
class GenerationStats:
    """What a generation did. Speculative cycles count in ``verify_steps``/``cycle_tokens``; the
    controller's plain steps in ``plain_steps``/``plain_tokens`` (so ``acceptance_length`` stays the
    drafter's tokens per speculative cycle)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache, not prefilled
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
    plain_steps: int = 0
    plain_tokens: int = 0
    controller: Optional[dict] = None  # the policy's summary (controller.BlockPolicy.summary)

    def count_cycle(self, block_size: int, accepted: int, emitted: int) -> None:
        """One cycle of the speculative loop emitted ``emitted`` tokens (after clipping)."""
        if block_size == 1:
            self.plain_steps += 1
            self.plain_tokens += emitted
            return
        self.verify_steps += 1
        self.cycle_tokens += emitted
        self.drafted_tokens += block_size - 1
        self.accepted_tokens += accepted
        for i in range(block_size - 1):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += int(i < accepted)

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
            "cached_tokens": self.cached_tokens,
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
            "plain_steps": self.plain_steps,
            "controller": self.controller,
        }


@dataclass
class GenerationEvent:
    tokens: list[int]  # new tokens of this step
    text: str  # their text (held back while it may still become a stop string)
    accepted: Optional[int] = None  # drafted tokens accepted this cycle (None: not a cycle)
    drafted: int = 0
    stats: Optional[GenerationStats] = None  # on the final event only
    finish_reason: Optional[str] = None
    elapsed: float = 0.0  # seconds from the start of generation (prefill included) to this event
    logprobs: Optional[list] = None  # per token: (logprob, [(token_id, logprob), ...]) when asked


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

    def add(self, new: list[int], accepted: Optional[int] = None, drafted: int = 0, logprobs=None) -> GenerationEvent:
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
        return GenerationEvent(
            kept,
            text,
            accepted,
            drafted,
            finish_reason=self.finished,
            elapsed=now - self.t_start,
            logprobs=logprobs[: len(kept)] if logprobs is not None else None,
        )

    def cancel(self) -> GenerationEvent:
        """The final event of a cancelled request (whatever text was held back is dropped)."""
        self.finished = "cancelled"
        return self.finish(
            GenerationEvent([], "", finish_reason="cancelled", elapsed=time.perf_counter() - self.t_start)
        )

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
            f"the prompt has {len(prompt)} tokens but the model's context is {runner.max_context}; shorten the prompt"
        )
    room = (runner.max_context - len(prompt)) if runner.max_context else settings.max_tokens
    return min(settings.max_tokens, room)


class Cancelled(Exception):
    """Raised inside prefill when the request's cancel event is set."""


def prefill(
    runner: TargetRunner,
    prompt: Sequence[int],
    settings: GenerationSettings,
    drafter: Optional[Drafter] = None,
    prefix_cache: Optional[PrefixCache] = None,
    save_at: Sequence[int] = (),
):
    """Feed the prompt in chunks -> (last logits [1, V], target cache, drafter context, cached tokens).

    With a drafter, the tapped features of every prompt position a later block can still see go
    into the drafter's context cache as they are computed. With a prefix cache, the longest
    stored prefix of the prompt is restored first, and snapshots are stored at each position of
    ``save_at`` and at the end of the prompt (chunks are split there).
    """
    chunks = _prefill_chunks(runner, prompt, settings, drafter, prefix_cache, save_at)
    while True:
        try:
            next(chunks)
        except StopIteration as done:
            return done.value


def _prefill_chunks(runner, prompt, settings, drafter, prefix_cache, save_at):
    """``prefill`` as a generator: yields after each chunk but the last, returns prefill's result."""
    total = len(prompt)
    cache = runner.make_cache()
    context = drafter.make_cache() if drafter is not None else None
    taps = drafter.config.target_layer_ids if drafter is not None else None
    window = drafter.config.context_window if drafter is not None else None
    pos, logits = 0, None
    hit = prefix_cache.lookup(prompt, need_context=drafter is not None) if prefix_cache is not None else None
    if hit is not None:
        cache.restore(hit.target)
        if context is not None:
            context = hit.context.copy()
        pos, logits = len(hit.tokens), hit.last_logits
    cached = pos
    tokens = mx.array(prompt, dtype=mx.int32)[None]
    points = sorted({p for p in save_at if pos < p < total} | ({total} if pos < total else set()))
    for point in points:
        while pos < point:
            _check_cancel(settings)
            end = min(pos + settings.prefill_step_size, point)
            logits_from = end - pos - 1 if end == total else end - pos  # only the prompt's last row
            logits, features = runner(tokens[:, pos:end], cache, taps, logits_from=logits_from)
            if context is not None:
                # rows before `point - window` can never be seen by a block from `point` on
                first = pos if window is None else max(pos, point - window)
                context.skip(first - context.offset)
                drafter.absorb(features[:, first - pos :], context)
            mx.eval(
                [c.state for c in cache.layers],
                [a for a in [logits, *(context.keys if context else [])] if a is not None],
            )
            pos = end
            if pos < total:
                yield
        if prefix_cache is not None:
            prefix_cache.store(
                PrefixEntry(
                    tuple(prompt[:point]),
                    cache.snapshot(),
                    context.copy() if context is not None else None,
                    logits[:, -1] if point == total else None,
                )
            )
    return logits.reshape(1, -1), cache, context, cached


def _check_cancel(settings: GenerationSettings) -> None:
    if settings.cancel is not None and settings.cancel.is_set():
        raise Cancelled()


def _pick(
    logits: mx.array,
    history: Union[list[int], mx.array],
    settings: GenerationSettings,
    grammar: Optional[GrammarState] = None,
) -> mx.array:
    """The next token from one row of logits [1, V], exactly as plain decoding picks it."""
    if settings.logits_processors:
        if not isinstance(history, mx.array):
            history = mx.array(history, dtype=mx.int32)
        logits = apply_processors(settings.logits_processors, history, logits)
    if grammar is not None:
        logits = grammar.mask_next(logits)
    if settings.sampling.greedy:
        return mx.argmax(logits, axis=-1), logits
    return sample(probabilities(logits, settings.sampling)), logits


def _logprobs(logits: mx.array, tokens: mx.array, n: int):
    """Log-probabilities [R] of ``tokens`` [R] under processed logits [R, V], plus the top n."""
    logp = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    top = mx.argsort(-logp, axis=-1)[:, :n] if n > 0 else None
    return chosen, top, (mx.take_along_axis(logp, top, axis=-1) if top is not None else None)


def _logprob_list(chosen, top, top_values, rows: int):
    out = []
    for i in range(rows):
        alts = list(zip(top[i].tolist(), top_values[i].tolist())) if top is not None else []
        out.append((float(chosen[i].item()), alts))
    return out


def _start(runner, prompt, settings, tokenizer):
    """Common set-up: checks, seed, statistics and the output collector."""
    max_tokens = _check_prompt(prompt, runner, settings)
    settings = _with_max(settings, max_tokens)
    if settings.seed is not None:
        mx.random.seed(settings.seed)
    stats = GenerationStats(prompt_tokens=len(prompt))
    return settings, stats, _Output(settings, tokenizer, stats, time.perf_counter())


def _prefill_and_pick(runner, prompt, settings, out, drafter, prefix_cache, save_at, grammar=None):
    """Prefill, then the first generated token -> (cache, context, token, processed logits), or
    None when cancelled during prefill. A generator: with ``settings.yield_during_prefill`` it
    yields an empty event between prefill chunks (use it with ``yield from``)."""
    chunks = _prefill_chunks(runner, prompt, settings, drafter, prefix_cache, save_at)
    try:
        while True:
            try:
                next(chunks)
            except StopIteration as done:
                logits, cache, context, out.stats.cached_tokens = done.value
                break
            if settings.yield_during_prefill:
                yield GenerationEvent([], "", elapsed=time.perf_counter() - out.t_start)
    except Cancelled:
        return None
    token, processed = _pick(logits, list(prompt), settings, grammar)
    mx.eval(token)
    out.stats.prefill_seconds = time.perf_counter() - out.t_start
    return cache, context, token, processed


def generate_autoregressive(
    runner: TargetRunner,
    prompt: Sequence[int],
    settings: GenerationSettings,
    tokenizer=None,
    prefix_cache: Optional[PrefixCache] = None,
    save_at: Sequence[int] = (),
) -> Iterator[GenerationEvent]:
    """Plain decoding with the same target, processing and events (the baseline)."""
    settings, stats, out = _start(runner, prompt, settings, tokenizer)
    grammar = settings.grammar.start() if settings.grammar is not None else None
    first = yield from _prefill_and_pick(runner, prompt, settings, out, None, prefix_cache, save_at, grammar)
    if first is None:
        yield out.cancel()
        return
    cache, _, token, processed = first
    history = list(prompt)
    while True:
        # Launch the next step on the still-lazy token before reading it (as mlx-lm does): building
        # its graph overlaps this step's compute. Past a stop token the step is wasted, not wrong.
        ahead = None
        if len(history) - len(prompt) + 1 < settings.max_tokens:
            logits, _ = runner(token.reshape(1, 1).astype(mx.int32), cache)
            lazy_history = (
                mx.concatenate([mx.array(history, dtype=mx.int32), token.reshape(1).astype(mx.int32)])
                if settings.logits_processors
                else None
            )
            if grammar is not None:  # the next mask needs this token: read it while the step computes
                mx.async_eval(logits)
                grammar.commit([int(token.item())])
            ahead = _pick(logits[:, -1], lazy_history, settings, grammar)
            mx.async_eval(ahead[0])
        t = int(token.item())
        logprobs = None
        if settings.logprobs:
            logprobs = _logprob_list(*_logprobs(processed, token, settings.logprobs), 1)
        history.append(t)
        event = out.add([t], logprobs=logprobs)
        if out.finished:
            if prefix_cache is not None:  # the cache covers every token, or all but the last
                covered = history if ahead is not None else history[:-1]
                prefix_cache.store(PrefixEntry(tuple(covered), cache.snapshot(), None, None))
            yield out.finish(event)
            return
        yield event
        if settings.cancel is not None and settings.cancel.is_set():
            yield out.cancel()
            return
        token, processed = ahead


def speculative_steps(
    runner: TargetRunner,
    drafter: Drafter,
    prompt: Sequence[int],
    settings: GenerationSettings,
    tokenizer=None,
    prefix_cache: Optional[PrefixCache] = None,
    save_at: Sequence[int] = (),
) -> Generator[Union[GenerationEvent, VerifyRequest], Optional[VerifyResult], None]:
    """``generate_speculative``'s loop, which leaves its verify passes to its driver: it yields
    events and, once per cycle, a ``VerifyRequest``, to be answered with ``send(VerifyResult)``
    (``batched_verify.answer_alone`` runs each alone; a server batches several sequences').

    Each cycle's block size comes from the request's policy (``controller.py``): the break-even
    controller by default, ``settings.block_size`` pinned, or ``settings.policy``. A cycle of size
    1 is a plain step: the target runs the anchor alone and its tapped features still reach the
    drafter's context, so speculation can resume exactly where it left off."""
    cfg = drafter.config
    if settings.block_size is not None and not 1 < settings.block_size <= cfg.block_size:
        raise ValueError(f"block size must be in 2..{cfg.block_size} for this drafter, got {settings.block_size}")
    policy = policy_for(runner, drafter, settings)  # may calibrate the pair: before the clock starts
    settings, stats, out = _start(runner, prompt, settings, tokenizer)
    sampling, greedy = settings.sampling, settings.sampling.greedy
    taps = cfg.target_layer_ids
    positions = (settings.block_size if settings.block_size and settings.policy is None else cfg.block_size) - 1
    stats.accepted_by_position, stats.drafted_by_position = [0] * positions, [0] * positions
    grammar = settings.grammar.start() if settings.grammar is not None else None
    first = yield from _prefill_and_pick(runner, prompt, settings, out, drafter, prefix_cache, save_at, grammar)
    if first is None:
        yield out.cancel()
        return
    cache, context, token, processed = first
    committed = list(prompt)
    anchor = int(token.item())
    committed.append(anchor)
    if grammar is not None:
        grammar.commit([anchor])
    logprobs = _logprob_list(*_logprobs(processed, token, settings.logprobs), 1) if settings.logprobs else None
    event = out.add([anchor], logprobs=logprobs)
    unseen: list[mx.array] = []  # target features [1, r, F] of committed positions the context lacks
    mask_id = cfg.mask_token_id
    hybrid = "gdn" in runner.kinds
    # DFlash 2 drafts the grammar refuses are skipped in the selector walk (measured under a JSON
    # schema: +18% acceptance greedy, +9% sampled at T 0.7). The walk needs the committed tokens:
    # a block drafted ahead is walked once they are known.
    masked_drafts = grammar is not None and cfg.is_dflash2 and settings.mask_drafts is not False
    prof = settings.profiler
    # A plain step's draft and acceptance, computed once: on this machine's CPU every op costs a
    # few microseconds of the cores the target's step runs on, and plain steps are most of a
    # request where speculation does not pay (the controller then must not cost speed).
    no_draft, none_accepted = mx.zeros((0,), dtype=mx.int32), mx.zeros((1,), dtype=mx.int32)
    mx.eval(no_draft, none_accepted)

    def absorb_unseen():
        if unseen:
            drafter.absorb(mx.concatenate(unseen, axis=1) if len(unseen) > 1 else unseen[0], context)
            unseen.clear()

    def history(*lazy: mx.array) -> Optional[mx.array]:
        """Committed tokens [n] (+ ones not read yet), for history-dependent logits processors."""
        if not settings.logits_processors:
            return None
        return mx.concatenate([mx.array(committed, dtype=mx.int32), *lazy])

    def draft_block(anchor: mx.array, bs: int):
        """Draft the block [anchor [1], MASK * (bs-1)] after the context cache -> (draft tokens
        [bs-1], candidates, q, the grammar's walk inputs) on their way to being computed (nothing
        is read). bs 1: no draft."""
        if bs == 1:
            return no_draft, None, None, None
        absorb_unseen()
        block = mx.concatenate([anchor, mx.full((bs - 1,), mask_id, dtype=mx.int32)])[None]
        block_embeds = runner.embed(block)
        if cfg.input_embedding_scale != 1.0:
            block_embeds = block_embeds * cfg.input_embedding_scale
        hidden = drafter(block_embeds, None, context)[:, 1:]  # [1, bs-1, H]
        draft_logits = drafter.logits(hidden, runner.lm_head)  # [1, bs-1, V]
        # Start computing the draft while Python builds the selector's and the verify pass's
        # graphs (mlx is lazy: without this nothing runs until the cycle's one host sync).
        mx.async_eval(hidden, draft_logits)
        if prof:
            prof.mark("draft", draft_logits)
        candidates = q = walk = None
        if masked_drafts and (settings.mask_drafts or grammar.walk_pays):  # walked once committed (walk_block)
            walked, pairs = drafter.candidate_selector.pair_scores(hidden, draft_logits, block[:, 0])
            walk = (walked[0], pairs[0], None if greedy else mx.random.uniform(shape=(bs - 1,)))
            mx.async_eval(*walk[:2])
        if walk is not None and not greedy:
            draft = None  # drawn on the host by the walk
        elif cfg.is_dflash2 and greedy:
            draft = drafter.select_greedy(hidden, draft_logits, block[:, 0])[0]
        elif cfg.is_dflash2:
            uniforms = mx.random.uniform(shape=(1, bs - 1))
            draft, candidates, q = drafter.candidate_selector.sampled(
                hidden, draft_logits, block[:, 0], sampling.temperature, uniforms
            )
            draft, candidates, q = draft[0], candidates[0], q[0]
        elif greedy:
            draft = mx.argmax(draft_logits[0], axis=-1)
        else:
            q = probabilities(draft_logits[0], sampling)
            draft = sample(q)
        if draft is not None:
            draft = draft.astype(mx.int32)  # [bs-1]
            mx.async_eval(draft)
        if prof:
            prof.mark("select", draft if draft is not None else walk[:2])
        return draft, candidates, q, walk

    def walk_block(draft: Optional[mx.array], walk) -> tuple[list[int], Optional[mx.array], Optional[mx.array]]:
        """The grammar's walk of the selector's candidates (walk: candidates [bs-1, k], pair
        scores, uniforms) -> (draft tokens [bs-1], candidates, q). Done on the host when the block
        is verified: it needs the matcher after the commit."""
        walked, pairs, uniforms = walk
        if greedy:  # the selector's own path when the grammar allows all of it (no pair scores read)
            return grammar.greedy_path(walked, pairs, unmasked=draft.tolist()), None, None
        tokens, q = grammar.sampled_path(walked, pairs, sampling.temperature, uniforms)
        return tokens, walked, mx.array(q)

    def verify_block(anchor: mx.array, drafted, seen: Optional[mx.array]):
        """The target's pass over [anchor, d1..d(bs-1)] and the acceptance test, launched (a
        sub-generator: the pass is asked of the driver) -> (draft tokens [bs-1], features [1, bs, F],
        GDN inputs for rollback, processed logits [bs, V], accepted [1], bonus [1])."""
        draft, candidates, q, walk = drafted
        if walk is not None:  # the grammar's walk of the selector's candidates decides the drafts
            draft_list, candidates, q = walk_block(draft, walk)
            draft = mx.array(draft_list, dtype=mx.int32)
        verify_in = mx.concatenate([anchor, draft])[None] if draft.shape[0] else anchor.reshape(1, 1)
        # the driver runs the pass: alone, or batched with other sequences' passes; a plain step
        # keeps its row whatever follows, so it records nothing for a rollback
        verified = yield VerifyRequest(verify_in, cache, taps, record=hybrid and draft.shape[0] > 0)
        verify_logits, verify_features, recorded = verified.logits[0], verified.features, verified.recorded
        if settings.logits_processors:  # row i sees committed + d1..di, as plain decoding did
            verify_logits = apply_processors(settings.logits_processors, mx.concatenate([seen, draft]), verify_logits)
        if grammar is not None:  # built on the host while the device computes the pass
            mx.async_eval(verify_logits)
            verify_logits = grammar.mask_verify(verify_logits, draft_list if walk is not None else draft.tolist())
        if prof:
            prof.mark("verify", verify_logits, verify_features)
        # Accept, on the device: the longest agreeing prefix (greedy) or rejection sampling; a
        # plain step (no draft) picks from its one row exactly as plain decoding does.
        if not draft.shape[0]:
            bonus = mx.argmax(verify_logits, axis=-1) if greedy else sample(probabilities(verify_logits, sampling))
            return draft, verify_features, recorded, verify_logits, none_accepted, bonus
        elif greedy:
            next_tokens = mx.argmax(verify_logits, axis=-1)  # [bs]
            agree = (draft == next_tokens[:-1]).astype(mx.int32)
            accepted_arr = mx.cumprod(agree).sum(keepdims=True)  # [1]
        else:
            accepted_arr, next_tokens = rejection_step(draft, probabilities(verify_logits, sampling), q, candidates)
            accepted_arr = accepted_arr.reshape(1)
        return draft, verify_features, recorded, verify_logits, accepted_arr, mx.take(next_tokens, accepted_arr)

    # The next cycle's draft (and, after a plain step, its verify pass too), when it was launched
    # before the previous cycle's host sync.
    drafted = verified = None
    anchor_in = mx.array([anchor], dtype=mx.int32)  # [1]
    planned = policy.choose(len(committed))
    built_ahead = 0.0  # seconds the previous resumption spent launching this cycle
    while not out.finished:
        yield event
        if settings.cancel is not None and settings.cancel.is_set():
            yield out.cancel()
            return
        resumed = time.perf_counter()  # a cycle is timed within one resumption, never across a yield
        if prof:
            prof.cycle_start()
        if drafted is None:
            drafted = draft_block(anchor_in, min(planned, settings.max_tokens - len(out.tokens) + 1))
        if verified is None:
            verified = yield from verify_block(anchor_in, drafted, history())
        draft, verify_features, recorded, verify_logits, accepted_arr, bonus_arr = verified
        drafted = verified = None
        bs = draft.shape[0] + 1
        if bs == 1:
            unseen.append(verify_features)  # a plain step's row is committed whatever follows
        planned = policy.choose(len(committed) + bs)
        # Launch the next cycle now if its size is known whatever is accepted: Python builds its
        # graph while this one computes. After a plain step the target cache is final, so the
        # whole next cycle goes; after a block, its draft (the context cache takes this pass's
        # rows tentatively, keeping accepted + 1 of them).
        launching = time.perf_counter()
        if not prof and settings.max_tokens - (len(out.tokens) + bs) >= max(planned - 1, 1):
            if bs == 1 and grammar is None:  # a grammar's next mask needs this step's token first
                drafted = draft_block(bonus_arr, planned)
                verified = yield from verify_block(bonus_arr, drafted, history(bonus_arr))
                mx.async_eval(verified[-1])
            elif bs > 1 and planned > 1:  # (under a grammar its walk waits for the commit)
                mx.async_eval(accepted_arr, bonus_arr, verify_features)
                drafter.absorb(verify_features, context, valid=accepted_arr + 1)
                drafted = draft_block(bonus_arr, planned)
        ahead_seconds = time.perf_counter() - launching  # building the next cycle: its cost, not this one's
        mx.eval(draft, accepted_arr, bonus_arr)  # the cycle's one host sync
        drafts, accepted, bonus = draft.tolist(), accepted_arr.item(), bonus_arr.item()
        new_tokens = drafts[:accepted] + [bonus]
        if prof:
            prof.mark("accept")
        logprobs = None
        if settings.logprobs:  # verify row i is what plain decoding saw for emitted token i
            lp = _logprobs(verify_logits[: accepted + 1], mx.array(new_tokens, dtype=mx.int32), settings.logprobs)
            logprobs = _logprob_list(*lp, accepted + 1)
        # Roll back: the target keeps n+accepted+1 positions; the drafter gets the new rows
        # (already, tentatively, when the next block was drafted ahead).
        cache.rollback(recorded or [], fed=bs, keep=accepted + 1)
        if prof:
            prof.mark("rollback", [c.state for c in cache.layers])
        if context.tentative is not None:
            context.commit(accepted + 1)
        elif bs > 1:
            unseen.append(verify_features[:, : accepted + 1])
        if len(unseen) >= UNSEEN_BATCH:
            absorb_unseen()
        committed += new_tokens
        if grammar is not None:
            grammar.commit(new_tokens)
        anchor_in = bonus_arr
        event = out.add(new_tokens, accepted if bs > 1 else None, bs - 1, logprobs=logprobs)
        stats.count_cycle(bs, accepted, len(event.tokens))
        policy.observe(bs, accepted, time.perf_counter() - resumed - ahead_seconds + built_ahead, len(committed))
        built_ahead = ahead_seconds
    if prof:
        prof.stop()
    if prefix_cache is not None:
        # The next chat turn starts with this prompt and answer: keep the caches as they are now.
        # They cover every committed token but the last (the anchor), whatever clipping showed,
        # unless a verify pass was launched ahead: then it keeps just the anchor's row.
        covered = committed[:-1]
        if verified is not None:
            cache.rollback(verified[2] or [], fed=verified[0].shape[0] + 1, keep=1)
            unseen.append(verified[1][:, :1])
            covered = committed
        absorb_unseen()
        prefix_cache.store(PrefixEntry(tuple(covered), cache.snapshot(), context.copy(), None))
    stats.controller = policy.summary()
    yield out.finish(event)


def generate_speculative(
    runner: TargetRunner,
    drafter: Drafter,
    prompt: Sequence[int],
    settings: GenerationSettings,
    tokenizer=None,
    prefix_cache: Optional[PrefixCache] = None,
    save_at: Sequence[int] = (),
) -> Iterator[GenerationEvent]:
    """Lossless speculative decoding: greedy output equals ``generate_autoregressive``'s token for
    token; sampled output follows exactly the target's distribution."""
    return answer_alone(runner, speculative_steps(runner, drafter, prompt, settings, tokenizer, prefix_cache, save_at))


def collect(events: Iterator[GenerationEvent]) -> tuple[list[int], Optional[GenerationStats]]:
    """Run a generation to its end: (all its tokens, the final statistics)."""
    tokens, stats = [], None
    for event in events:
        tokens += event.tokens
        stats = event.stats or stats
    return tokens, stats


def _with_max(settings: GenerationSettings, max_tokens: int) -> GenerationSettings:
    if max_tokens == settings.max_tokens:
        return settings
    from dataclasses import replace

    return replace(settings, max_tokens=max_tokens)
