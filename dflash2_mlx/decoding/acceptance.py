"""The accept rules: which drafted tokens the target keeps, and the token it adds after them.

Each rule runs on the device (nothing is read): the loop reads ``accepted`` and ``bonus`` in its
one host sync per cycle. Both rules make a cycle's output the target's own: greedy equals plain
decoding token for token, sampled follows the target's exact distribution.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple, Optional

import mlx.core as mx

from dflash2_mlx.decoding.sampling import SamplingSettings, probabilities, rejection_step, sample


class Verdict(NamedTuple):
    accepted: mx.array  # [1] int32: how many drafts the target kept (a prefix of them)
    bonus: mx.array  # [1]: the target's own token after the kept drafts


def accept_greedy(
    draft_tokens: mx.array,
    verify_logits: mx.array,
    draft_q: Optional[mx.array] = None,
    candidates: Optional[mx.array] = None,
) -> Verdict:
    """Greedy acceptance of ``draft_tokens`` [R] against ``verify_logits`` [R + 1, V] (greedy
    drafts carry no distribution: ``draft_q`` and ``candidates`` are unused).

    Rule: draft i is kept if it equals the target's argmax at row i and every draft before it was
    kept (the longest agreeing prefix); the bonus is the target's argmax right after the last kept
    draft, where plain decoding would have gone on."""
    target_tokens = mx.argmax(verify_logits, axis=-1)  # [R + 1]
    agree = (draft_tokens == target_tokens[:-1]).astype(mx.int32)
    accepted = mx.cumprod(agree).sum(keepdims=True)  # [1]
    return Verdict(accepted, mx.take(target_tokens, accepted))


def accept_sampled(
    draft_tokens: mx.array,
    verify_logits: mx.array,
    draft_q: mx.array,
    candidates: Optional[mx.array],
    sampling: SamplingSettings,
) -> Verdict:
    """Speculative sampling of ``draft_tokens`` [R] drawn from ``draft_q`` (dense [R, V], or [R, k]
    over ``candidates`` [R, k]) against the target's ``verify_logits`` [R + 1, V].

    Rule: keep draft i with probability min(1, p_i(d_i) / q_i(d_i)) while every earlier one was
    kept; at the first refusal draw the bonus from normalize(max(p_i - q_i, 0)), and after a fully
    kept block from p_R (``sampling.rejection_step``)."""
    accepted, next_tokens = rejection_step(draft_tokens, probabilities(verify_logits, sampling), draft_q, candidates)
    accepted = accepted.reshape(1)
    return Verdict(accepted, mx.take(next_tokens, accepted))


def plain_step_token(verify_logits: mx.array, sampling: SamplingSettings) -> mx.array:
    """A plain step (no drafts): its one row [1, V] picked exactly as plain decoding picks it -> [1]."""
    return mx.argmax(verify_logits, axis=-1) if sampling.greedy else sample(probabilities(verify_logits, sampling))


# (draft tokens [R], verify logits [R + 1, V], draft q, candidates) -> Verdict
AcceptRule = Callable[[mx.array, mx.array, Optional[mx.array], Optional[mx.array]], Verdict]


def accept_rule(sampling: SamplingSettings) -> AcceptRule:
    """The request's rule for a block with drafts, chosen once: greedy prefix or speculative sampling."""
    return accept_greedy if sampling.greedy else partial(accept_sampled, sampling=sampling)
