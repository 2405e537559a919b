"""The speculative loop: draft -> verify -> accept -> roll back -> emit, one cycle at a time.

``speculative_steps`` reads as the algorithm; the pieces it calls live in ``cycle`` (the steps),
``drafting`` (the variant chosen once per request), ``acceptance`` (the rules) and ``hooks``
(grammar, profiler and clock, no-op objects when off).
"""

from __future__ import annotations

import threading
from functools import partial
from typing import Generator, Iterator, Optional, Sequence, Union

import mlx.core as mx

from dflash2_mlx.caches.prefix import PrefixCache
from dflash2_mlx.decoding.batched_verify import VerifyRequest, VerifyResult, answer_alone
from dflash2_mlx.decoding.cycle import NOTHING_AHEAD, SpeculativeRequest
from dflash2_mlx.decoding.hooks import CycleClock
from dflash2_mlx.decoding.picking import emitted_logprobs
from dflash2_mlx.decoding.prefill import prefill_and_pick
from dflash2_mlx.decoding.sampling import SamplingSettings
from dflash2_mlx.decoding.setup import start_request
from dflash2_mlx.decoding.types import GenerationEvent, GenerationSettings
from dflash2_mlx.models.drafter import Drafter
from dflash2_mlx.models.target import TargetRunner
from dflash2_mlx.policies.block_size import BlockPolicy, policy_for


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

    Each cycle's block size comes from the request's policy (``policies/block_size.py``): the break-even
    controller by default, ``settings.block_size`` pinned, or ``settings.policy``. A cycle of size
    1 is a plain step: the target runs the anchor alone and its tapped features still reach the
    drafter's context, so speculation can resume exactly where it left off."""
    max_block = drafter.config.block_size
    if settings.block_size is not None and not 1 < settings.block_size <= max_block:
        raise ValueError(f"block size must be in 2..{max_block} for this drafter, got {settings.block_size}")
    # may calibrate the pair (short requests of its own): before this request's clock starts
    policy = policy_for(runner, drafter, settings, partial(run_calibration_request, runner, drafter, settings.sampling))
    settings, stats, out = start_request(runner, prompt, settings, tokenizer)
    positions = (settings.block_size if settings.block_size and settings.policy is None else max_block) - 1
    stats.accepted_by_position, stats.drafted_by_position = [0] * positions, [0] * positions
    grammar = settings.grammar.start() if settings.grammar is not None else None
    first = yield from prefill_and_pick(runner, prompt, settings, out, drafter, prefix_cache, save_at, grammar)
    if first is None:
        yield out.cancel()
        return
    cache, context, token, processed = first
    request = SpeculativeRequest(runner, drafter, cache, context, settings, grammar, committed=list(prompt))
    profiler = request.profiler
    first_token = int(token.item())
    request.commit([first_token])
    event = out.add([first_token], logprobs=emitted_logprobs(settings.logprobs, processed, [first_token]))
    launch_ahead = settings.profiler is None  # a profile times each phase alone: nothing overlaps
    clock = CycleClock()
    anchor = mx.array([first_token], dtype=mx.int32)  # [1] the last committed token, not in the cache yet
    block_size = policy.choose(len(request.committed))
    ahead = NOTHING_AHEAD  # the next cycle, when it was launched before the previous host sync
    # the next cycle's copy of the context (a Match), when the policy takes one
    copied = request.plan_copy(policy, request.copy_match(out.room), launched_ahead=False)
    while not out.finished:
        yield event
        if settings.cancelled:
            yield out.cancel()
            return
        clock.start_cycle()
        profiler.cycle_start()
        # 1. Draft: copied tokens, or block_size - 1 from the drafter (none for a plain step)
        if copied is not None:
            draft = request.copy(copied.continuation)
        elif ahead.draft is not None:
            draft = ahead.draft
        else:
            draft = request.draft(anchor, min(block_size, out.room + 1))
        # 2. Verify [anchor, drafts] in one target pass, and the verdict: launched, nothing read
        verified = ahead.verified if ahead.verified is not None else (yield from request.verify(anchor, draft))
        size = verified.block_size
        request.queue_plain_step(verified)
        block_size = policy.choose(len(request.committed) + size)
        # Launch the next cycle while this one computes, when its size is known whatever is accepted
        clock.start_launch()
        ahead = NOTHING_AHEAD
        if launch_ahead and not request.copying.likely and out.room - size >= max(block_size - 1, 1):
            ahead = yield from request.launch_next(verified, block_size)
        clock.end_launch(next_pass_launched=ahead.verified is not None)
        # 3. Accept: the cycle's one host sync reads the verdict
        accepted, new_tokens = verified.read()  # new_tokens: the accepted drafts + the bonus
        profiler.mark("accept")
        logprobs = emitted_logprobs(settings.logprobs, verified.logits, new_tokens)
        # 4. Roll back the target's cache and the drafter's context to the kept rows
        request.roll_back(verified, accepted)
        # 5. Emit
        request.commit(new_tokens)
        anchor = verified.bonus
        source = "copy" if copied is not None else "dflash" if size > 1 else None
        event = out.add(new_tokens, accepted if size > 1 else None, size - 1, logprobs=logprobs, source=source)
        stats.count_cycle(size, accepted, len(event.tokens), source)
        # 6. Copy: the context's continuation may draft the next cycle (when nothing went ahead)
        match = request.copy_match(out.room)
        policy.observe(size, accepted, clock.cycle_seconds(), len(request.committed), copied.agreement if copied else 0)
        copied = request.plan_copy(policy, match, launched_ahead=ahead is not NOTHING_AHEAD)
    profiler.stop()
    request.copying.remember(out.tokens)
    if prefix_cache is not None:
        request.store_snapshot(prefix_cache, ahead)
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


def run_calibration_request(
    runner: TargetRunner,
    drafter: Drafter,
    sampling: SamplingSettings,
    prompt: Sequence[int],
    policy: BlockPolicy,
    max_tokens: int,
) -> None:
    """One short request the controller's calibration times (``controller.calibrate``), decoded
    with the caller's kind of sampling and the calibration's block schedule, until the schedule
    has run once. Without that end a pair that accepts little would run the schedule over and over
    to max_tokens (sized for one that accepts everything): 72 s instead of ~12 s on SmolLM2 here."""
    stop = threading.Event()
    settings = GenerationSettings(max_tokens=max_tokens, sampling=sampling, policy=policy, cancel=stop)
    for _ in generate_speculative(runner, drafter, prompt, settings):
        if getattr(policy, "finished", False):
            stop.set()  # the loop ends at its next check
