"""The accept rules: which drafted tokens the target keeps, and the token it adds after them.

One rule for both kinds of decoding: the target picks its own token at every verify row, and the
drafts are kept while they equal those picks. Greedy, the target's pick is the row's argmax;
sampled, it is the request's keyed draw for that row's position (``sampling.keyed_draw``:
``argmax(log p + G_n)``), the very token plain sampled decoding draws there with the same seed.
So a cycle's output is the target's own token for token, greedy or sampled, whatever the
drafts were (a draft only decides how many of the target's tokens one pass yields).

Each rule runs on the device (nothing is read): the loop reads ``accepted`` and ``bonus`` in its
one host sync per cycle.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import mlx.core as mx

from dflash2_mlx.decoding.sampling import SamplingSettings, keyed_draw


class Verdict(NamedTuple):
    accepted: mx.array  # [1] int32: how many drafts the target kept (a prefix of them)
    bonus: mx.array  # [1]: the target's own token after the kept drafts


def keep_agreeing(draft_tokens: mx.array, target_tokens: mx.array) -> Verdict:
    """Drafts [R] against the target's picks [R + 1]: draft i is kept if it equals the target's pick
    at row i and every draft before it was kept (the longest agreeing prefix); the bonus is the
    target's pick right after the last kept draft, where plain decoding would have gone on."""
    agree = (draft_tokens == target_tokens[:-1]).astype(mx.int32)
    accepted = mx.cumprod(agree).sum(keepdims=True)  # [1]
    return Verdict(accepted, mx.take(target_tokens, accepted))


def accept_greedy(draft_tokens: mx.array, verify_logits: mx.array, anchor_position: int = 0) -> Verdict:
    """Greedy acceptance of ``draft_tokens`` [R] against ``verify_logits`` [R + 1, V]: the target's
    pick at each row is its argmax (the anchor's position does not matter)."""
    return keep_agreeing(draft_tokens, mx.argmax(verify_logits, axis=-1))


def accept_sampled(
    draft_tokens: mx.array, verify_logits: mx.array, anchor_position: int, sampling: SamplingSettings, seed: int
) -> Verdict:
    """Sampled acceptance of ``draft_tokens`` [R] against ``verify_logits`` [R + 1, V] verifying the
    block after the anchor at sequence position ``anchor_position``: row i predicts position
    anchor_position + 1 + i, and the target's pick there is its keyed draw ``argmax(log p_i +
    G_{anchor_position + 1 + i})``. Lossless: the emitted tokens are those draws, which plain
    decoding with the same seed makes too; a draft d_i is kept with probability p_i(d_i)."""
    return keep_agreeing(draft_tokens, keyed_draw(verify_logits, sampling, seed, anchor_position + 1))


def plain_step_token(verify_logits: mx.array, sampling: SamplingSettings, seed: int, position: int) -> mx.array:
    """A plain step (no drafts): its one row [1, V], predicting sequence position ``position``, picked
    exactly as plain decoding picks it -> [1]."""
    if sampling.greedy:
        return mx.argmax(verify_logits, axis=-1)
    return keyed_draw(verify_logits, sampling, seed, position)


# (draft tokens [R], verify logits [R + 1, V], the anchor's sequence position) -> Verdict
AcceptRule = Callable[[mx.array, mx.array, int], Verdict]


def accept_rule(sampling: SamplingSettings, seed: int) -> AcceptRule:
    """The request's rule for a block with drafts, chosen once: greedy picks or keyed draws."""
    return accept_greedy if sampling.greedy else partial(accept_sampled, sampling=sampling, seed=seed)
