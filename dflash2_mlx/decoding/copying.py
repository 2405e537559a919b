"""Copy drafts: the request's own text, and earlier answers, as a drafter that costs no pass.

After each cycle's host sync, ``ContextCopy.propose`` looks up the longest earlier occurrence of
the last committed tokens (``caches/token_index``) in the request's prompt and answer so far and,
when the caller passed one, in the shared index of earlier answers (a server keeps one per API
key). The policy then decides how many of the tokens that followed it the next cycle verifies
instead of the drafter's block (``BlockPolicy.choose_copy``); a grammar cuts the copy where it
refuses a token. After the request its answer joins the shared index.

A copy draft is a deterministic proposal: a copied token is kept while it equals the target's
own pick there (greedy its argmax, sampled its keyed draw: kept with the target's probability of
it), as any draft is (``acceptance``). The output stays exactly the target's.

The lookup runs on the host, after the sync that reads the verdict: a cycle that may copy is not
drafted ahead of that sync (``likely``), which costs a copy cycle nothing (it has no draft to
compute while the verify pass runs).
"""

from __future__ import annotations

from typing import Optional, Union

import mlx.core as mx

from dflash2_mlx.caches.token_index import Match, TokenIndex
from dflash2_mlx.decoding.drafting import Draft


class NoCopy:
    """Copy drafting off: nothing is proposed or remembered."""

    likely = False

    def propose(self, committed: list[int], room: int) -> Optional[Match]:
        return None

    def remember(self, answer: list[int]) -> None:
        pass


class ContextCopy:
    """One request's copy drafts: matches in its own tokens, then in the shared index."""

    def __init__(self, committed: list[int], shared: Optional[TokenIndex]):
        """``committed``: the request's token list, indexed as it grows in place."""
        self.own = TokenIndex(source="context")
        self.own.track(committed)
        self.shared = shared
        self.likely = False  # the last lookup found a copy the policy took: draft nothing ahead

    def propose(self, committed: list[int], room: int) -> Optional[Match]:
        """The longest-agreeing match of the committed tokens' end (its own text first among
        equals), with at most ``room`` tokens after it."""
        own = self.own.longest_match(committed, room)
        shared = self.shared.longest_match(committed, room) if self.shared is not None else None
        if shared is not None and (own is None or shared.agreement > own.agreement):
            return shared
        return own

    def remember(self, answer: list[int]) -> None:
        """Keep a finished request's answer for later requests (the shared index's budget applies)."""
        if self.shared is not None and answer:
            self.shared.add(answer)


def copying_for(committed: list[int], enabled: bool, shared: Optional[TokenIndex]) -> Union[NoCopy, ContextCopy]:
    """The request's copy drafting: on by default, with the caller's shared index if any."""
    return ContextCopy(committed, shared) if enabled else NoCopy()


def copy_draft(tokens: list[int]) -> Draft:
    """The draft that verifies ``tokens`` [R]."""
    return Draft(mx.array(tokens, dtype=mx.int32))
