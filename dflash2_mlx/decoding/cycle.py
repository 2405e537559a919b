"""One request's speculative state and the steps of a cycle, for the loop in ``speculative``.

State between cycles: committed tokens t[0..n]; the target cache covers t[0..n-1]; t[n] (the
anchor) is not in it yet; the drafter's context holds the projected target features of the
committed positions before the ones still queued in its ``ContextFeed``.

A cycle's device work is launched without reading anything: draft, verify pass, verdict. The loop
reads the verdict in one host sync, after launching the next cycle when its size is known.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Generator, NamedTuple, Optional, Sequence

import mlx.core as mx

from dflash2_mlx.caches.drafter_context import ContextCache
from dflash2_mlx.caches.prefix import PrefixCache, PrefixEntry
from dflash2_mlx.caches.target import TargetCache
from dflash2_mlx.caches.token_index import Match
from dflash2_mlx.constraints.grammar import GrammarState
from dflash2_mlx.decoding.acceptance import Verdict, accept_rule, plain_step_token
from dflash2_mlx.decoding.batched_verify import VerifyRequest, VerifyResult
from dflash2_mlx.decoding.context_feed import ContextFeed
from dflash2_mlx.decoding.copying import copy_draft, copying_for
from dflash2_mlx.decoding.drafting import Draft, Drafting, pick_for
from dflash2_mlx.decoding.hooks import grammar_hooks, profiler_or_none
from dflash2_mlx.decoding.sampling import apply_processors
from dflash2_mlx.decoding.types import GenerationSettings
from dflash2_mlx.models.drafter import Drafter
from dflash2_mlx.models.target import TargetRunner
from dflash2_mlx.policies.block_size import BlockPolicy


class Verified(NamedTuple):
    """A verified block, still on the device (R = block size - 1 drafts; 0 for a plain step)."""

    draft_tokens: mx.array  # [R] the drafts the pass verified
    features: mx.array  # [1, R + 1, F] the target's tapped features of the pass's rows
    recorded: Optional[list]  # Gated DeltaNet inputs, to roll back the rows not kept
    logits: mx.array  # [R + 1, V] processed: row i as plain decoding saw it after committed + d1..di
    accepted: mx.array  # [1] drafts kept
    bonus: mx.array  # [1] the target's token after them: the next anchor

    @property
    def block_size(self) -> int:
        return self.draft_tokens.shape[0] + 1

    def read(self) -> tuple[int, list[int]]:
        """The cycle's one host sync -> (drafts accepted, the tokens it emits)."""
        mx.eval(self.draft_tokens, self.accepted, self.bonus)
        accepted = self.accepted.item()
        return accepted, self.draft_tokens.tolist()[:accepted] + [self.bonus.item()]


class Ahead(NamedTuple):
    """The next cycle, launched before this one's host sync: its draft, and after a plain step
    its verify pass too."""

    draft: Optional[Draft] = None
    verified: Optional[Verified] = None


NOTHING_AHEAD = Ahead()

# What a cycle step yields to the loop's driver and gets back (batched_verify.answer_alone, or a
# server batching several sequences' passes).
VerifyStep = Generator[VerifyRequest, VerifyResult, Verified]


class SpeculativeRequest:
    """One request's target cache, drafter context, drafting, grammar, profiler and history."""

    def __init__(
        self,
        runner: TargetRunner,
        drafter: Drafter,
        cache: TargetCache,
        context: ContextCache,
        settings: GenerationSettings,
        grammar: Optional[GrammarState],
        committed: list[int],
    ):
        """Everything a request's cycles use, chosen once after its prefill: the draft variant,
        the accept rule, and the grammar and profiler (no-op objects when off)."""
        self.cache, self.committed = cache, committed
        self.sampling, self.logits_processors = settings.sampling, settings.logits_processors
        self.grammar, self.profiler = grammar_hooks(grammar), profiler_or_none(settings.profiler)
        self.feed = ContextFeed(drafter, context)
        variant = pick_for(drafter, settings.sampling, grammar, settings.mask_drafts, settings.seed)
        self.drafting = Drafting(runner, drafter, self.feed, variant, self.profiler)
        self.taps = drafter.config.target_layer_ids
        self.hybrid = "gdn" in runner.kinds  # Gated DeltaNet state is rolled back by replaying inputs
        self.seed = settings.seed  # sampled: the key of the request's draws (setup.start_request)
        self.accept_drafts = accept_rule(settings.sampling, settings.seed)
        self.none_accepted = mx.zeros((1,), dtype=mx.int32)  # a plain step's verdict, made once
        mx.eval(self.none_accepted)
        self.copying = copying_for(committed, settings.copy_drafting, settings.copy_index)

    def copy_match(self, room: int) -> Optional[Match]:
        """The context's copy draft after the committed tokens (host work), cut where the grammar
        refuses a token; None when there is none."""
        match = self.copying.propose(self.committed, room)
        if match is None:
            return None
        allowed = self.grammar.allowed_prefix(match.continuation)
        if allowed == len(match.continuation):
            return match
        return replace(match, continuation=match.continuation[:allowed]) if allowed else None

    def plan_copy(self, policy: BlockPolicy, match: Optional[Match], launched_ahead: bool) -> Optional[Match]:
        """The next cycle's copy: as many of ``match``'s tokens as the policy takes, unless the
        next cycle was already launched (its draft went ahead: the copy waits a cycle, and the
        cycle after it is not drafted ahead)."""
        copies = policy.choose_copy(len(self.committed), match.agreement, len(match.continuation)) if match else 0
        self.copying.likely = copies > 0
        if not copies or launched_ahead:
            return None
        return replace(match, continuation=match.continuation[:copies])

    def draft(self, anchor: mx.array, block_size: int) -> Draft:
        return self.drafting.propose(anchor, block_size)

    def copy(self, tokens: list[int]) -> Draft:
        """A copy of the context as the next block's drafts; the drafter's context takes this
        block's kept rows later (``keep_block``), as after any block not drafted ahead."""
        return copy_draft(tokens)

    def verify(self, anchor: mx.array, draft: Draft, pending: Sequence[mx.array] = ()) -> VerifyStep:
        """The target's pass over [anchor, d1..dR] (asked of the driver) and the verdict, launched.
        ``pending``: tokens [1] committed before the anchor but not read yet."""
        anchor_position = len(self.committed) + len(pending) - 1  # row i predicts the one i + 1 after
        draft = self.drafting.resolve(draft)
        drafts = draft.tokens  # [R]
        verify_in = mx.concatenate([anchor, drafts])[None] if drafts.shape[0] else anchor.reshape(1, 1)
        # a plain step keeps its row whatever follows, so it records nothing for a rollback
        result = yield VerifyRequest(verify_in, self.cache, self.taps, record=self.hybrid and drafts.shape[0] > 0)
        logits = result.logits[0]  # [R + 1, V]
        if self.logits_processors:  # row i sees committed + d1..di, as plain decoding did
            history = mx.concatenate([mx.array(self.committed, dtype=mx.int32), *pending, drafts])
            logits = apply_processors(self.logits_processors, history, logits)
        logits = self.grammar.mask_verify(logits, drafts)
        self.profiler.mark("verify", logits, result.features)
        if drafts.shape[0]:
            verdict = self.accept_drafts(drafts, logits, anchor_position)
        else:  # a plain step picks from its one row exactly as plain decoding does
            token = plain_step_token(logits, self.sampling, self.seed, anchor_position + 1)
            verdict = Verdict(self.none_accepted, token)
        # Launched as soon as built, so the pass computes in the resumption that built it (the
        # cycle clock charges it there; on the CPU backend this waits for most of it)
        mx.async_eval(verdict.accepted, verdict.bonus, result.features)
        return Verified(drafts, result.features, result.recorded, logits, *verdict)

    def queue_plain_step(self, verified: Verified) -> None:
        """A plain step's row is committed whatever follows: it goes to the drafter's context."""
        if verified.block_size == 1:
            self.feed.queue(verified.features)

    def launch_next(self, verified: Verified, block_size: int) -> Generator[VerifyRequest, VerifyResult, Ahead]:
        """Launch the next cycle (of ``block_size``) while ``verified`` computes. After a plain step
        the target cache is final: the whole next cycle goes (unless a grammar needs this step's
        token first). After a block, its draft: the context takes this pass's rows tentatively,
        keeping accepted + 1 of them (under a grammar the walk waits for the commit)."""
        if verified.block_size == 1 and self.grammar.verify_ahead_of_commit:
            draft = self.draft(verified.bonus, block_size)
            next_verified = yield from self.verify(verified.bonus, draft, pending=[verified.bonus])
            return Ahead(draft, next_verified)
        if verified.block_size > 1 and block_size > 1:
            self.feed.absorb_tentatively(verified.features, keep=verified.accepted + 1)
            return Ahead(self.draft(verified.bonus, block_size))
        return NOTHING_AHEAD

    def roll_back(self, verified: Verified, accepted: int) -> None:
        """The target keeps n + accepted + 1 positions; the drafter the same rows (already,
        tentatively, when the next block was drafted ahead)."""
        self.cache.rollback(verified.recorded or [], fed=verified.block_size, keep=accepted + 1)
        self.profiler.mark("rollback", [c.state for c in self.cache.layers])
        self.feed.keep_block(verified.features, verified.block_size, accepted)

    def commit(self, tokens: list[int]) -> None:
        self.committed += tokens
        self.grammar.commit(tokens)

    def store_snapshot(self, prefix_cache: PrefixCache, ahead: Ahead) -> None:
        """The next chat turn starts with this prompt and answer: keep the caches as they are now.
        They cover every committed token but the last (the anchor), whatever clipping showed,
        unless a verify pass was launched ahead: then it keeps just the anchor's row."""
        covered = self.committed[:-1]
        if ahead.verified is not None:
            self.cache.rollback(ahead.verified.recorded or [], fed=ahead.verified.block_size, keep=1)
            self.feed.queue(ahead.verified.features[:, :1])
            covered = self.committed
        self.feed.absorb_queued()
        prefix_cache.store(PrefixEntry(tuple(covered), self.cache.snapshot(), self.feed.context.copy(), None))
