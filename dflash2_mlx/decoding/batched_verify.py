"""Several sequences' verify passes as one target call, each exactly as its own pass would be.

A decode loop does not call the target for its verify pass itself: it hands a ``VerifyRequest``
(the block ``[anchor, d1..d(b-1)]`` and its sequence's ``TargetCache``) to its driver and gets a
``VerifyResult`` back. ``verify_one`` answers a request alone; ``verify_batch`` answers the
requests of several sequences with one target pass, which on a weight-bandwidth-bound GPU costs
little more than one of them (every weight is read once for all the rows).

The batch is the sequences' blocks right-padded to the longest, ``tokens [N, S]``, run through the
same ``TargetRunner`` with a batch view of their caches:

- attention layers see ``RaggedKV``: each sequence's own ``KVCache`` takes only its real rows;
  keys and values come back right-padded to the longest sequence, and the mask lets row j of
  sequence i see exactly the keys its own pass would (its context and rows 0..j; padding rows see
  their sequence's real keys, so every softmax row is finite);
- Gated DeltaNet layers see the sequences' conv windows and recurrent states stacked along the
  batch axis (in mlx-lm's ``ArraysCache``).

Padding rows never reach a real row: they come after every real row of their sequence (the conv
and the recurrence are causal), they never enter a KV cache, and every other op works row by row.
Afterwards each sequence gets its own slice of the logits, the tapped features and the recorded
Gated DeltaNet inputs, and its cache is left exactly as its own pass of ``b`` rows leaves it: KV
entries for its b rows, the conv window and the recurrent state after its own last row. Rollback
with its own accepted count then works as after a solo pass (``TargetCache.rollback``). Results
equal a solo pass's within float rounding (a matmul over N x S rows may round differently from
one over S rows); tests pin greedy outputs token for token.
"""

from __future__ import annotations

from contextlib import closing
from dataclasses import dataclass
from typing import Any, Generator, Iterator, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.gated_delta import gated_delta_update

from dflash2_mlx.caches.target import RecurrentInputs, TargetCache
from dflash2_mlx.models.target import TargetRunner


@dataclass
class VerifyRequest:
    """One sequence's verify pass, as a decode loop hands it to whoever runs the target."""

    tokens: mx.array  # [1, b]: the anchor, then the b - 1 draft tokens
    cache: TargetCache  # covers the sequence's committed tokens before the anchor
    taps: Optional[list[int]]  # target layers whose outputs the drafter reads
    record: bool  # Gated DeltaNet layers record their recurrence inputs (hybrid targets)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]


@dataclass
class VerifyResult:
    """What the verify pass gives back; the request's cache has advanced by its b rows."""

    logits: mx.array  # [1, b, V]
    features: Optional[mx.array]  # [1, b, len(taps) * H]
    recorded: Optional[list[RecurrentInputs]]  # for TargetCache.rollback(recorded, fed=b, keep)


def verify_one(runner: TargetRunner, request: VerifyRequest) -> VerifyResult:
    """The request's verify pass on its own."""
    recorded = [] if request.record else None
    logits, features = runner(request.tokens, request.cache, request.taps, recorded)
    return VerifyResult(logits, features, recorded)


def verify_batch(runner: TargetRunner, requests: Sequence[VerifyRequest]) -> list[VerifyResult]:
    """The requests' verify passes as one target pass -> one result per request, in order, each
    equal to ``verify_one``'s within float rounding. The requests must come from sequences of
    the same target and drafter (same taps); block sizes (1 included: a plain step) and context
    lengths may differ, and so may whether they record for rollback."""
    if len(requests) == 1:
        return [verify_one(runner, requests[0])]
    if not requests:
        return []
    taps = requests[0].taps
    if any(r.taps != taps for r in requests):
        raise ValueError("a batched verify needs requests of one target and drafter (the same taps)")
    if len({id(r.cache) for r in requests}) != len(requests):
        raise ValueError("each request of a batched verify needs its own target cache")
    sizes = [r.size for r in requests]
    width = max(sizes)
    # right-padded blocks [N, S]; the padding token is arbitrary (its rows are never read)
    tokens = mx.concatenate(
        [r.tokens if r.size == width else mx.pad(r.tokens, [(0, 0), (0, width - r.size)]) for r in requests]
    ).astype(mx.int32)
    batch = _BatchCache([r.cache for r in requests], sizes)
    # Gated DeltaNet layers always record here: each sequence's own state is cut out of them
    recorded = [] if "gdn" in batch.kinds else None
    logits, features = runner(tokens, batch, taps, recorded)
    results = []
    for i, (request, size) in enumerate(zip(requests, sizes)):
        own = _own_recurrent_inputs(batch, recorded, i, size) if recorded is not None else None
        request.cache.advance(size)
        results.append(
            VerifyResult(
                logits[i : i + 1, :size],
                features[i : i + 1, :size] if features is not None else None,
                own if request.record else None,
            )
        )
    return results


# A decode loop that leaves its verify passes to its driver (engine.speculative_steps): it yields
# events and VerifyRequests, and each request is answered with send(VerifyResult).
DecodeLoop = Generator[Any, Optional[VerifyResult], None]


def answer_alone(runner: TargetRunner, loop: DecodeLoop) -> Iterator[Any]:
    """The loop's events, each of its verify requests answered by its own pass. Closing the
    events closes the loop."""
    with closing(loop):
        reply = None
        while True:
            try:
                item = loop.send(reply)
            except StopIteration:
                return
            reply = verify_one(runner, item) if isinstance(item, VerifyRequest) else None
            if reply is None:
                yield item


@dataclass
class Step:
    """What one step of a decode loop gave: its next event, or the error it raised, or neither
    (the loop had ended)."""

    event: Any = None
    error: Optional[Exception] = None

    @property
    def ended(self) -> bool:
        return self.event is None and self.error is None


def step_together(runner: TargetRunner, loops: Sequence[Iterator[Any]], batch: bool = True) -> list[Step]:
    """One step of each loop (a prefill chunk or a decode cycle) -> one ``Step`` per loop, in order.

    Each loop runs to its next verify request or event; the verify requests are answered by one
    batched pass (``batch``; else by a pass each), then each of those loops runs on to its event
    (a further request on the way, a pass a loop launches ahead of its next cycle, is answered
    alone).
    Loops that never ask for a verify (plain decoding) just give their next event. An error in
    one loop is returned as its step; the others go on.
    """
    steps: list[Optional[Step]] = [None] * len(loops)
    pending: dict[int, VerifyRequest] = {}
    for i, loop in enumerate(loops):
        steps[i] = _advance(lambda: next(loop))
        if isinstance(steps[i].event, VerifyRequest):
            pending[i], steps[i] = steps[i].event, None
    if pending:
        requests = list(pending.values())
        results = verify_batch(runner, requests) if batch else [verify_one(runner, r) for r in requests]
        for i, result in zip(pending, results):
            steps[i] = _advance(lambda: loops[i].send(result))
            while isinstance(steps[i].event, VerifyRequest):  # a pass launched ahead of its cycle
                ahead = verify_one(runner, steps[i].event)
                steps[i] = _advance(lambda: loops[i].send(ahead))
    return steps


def _advance(resume) -> Step:
    try:
        return Step(event=resume())
    except StopIteration:
        return Step()
    except Exception as e:  # noqa: BLE001  (the caller decides per loop: one request's failure)
        return Step(error=e)


def run_together(runner: TargetRunner, loops: Sequence[DecodeLoop], batch: bool = True) -> Iterator[tuple[int, Any]]:
    """Run the loops to their ends in lock step, a step of each at a time with their verify
    passes batched -> (loop index, event) as they come. An error in a loop is raised."""
    active = list(range(len(loops)))
    while active:
        steps = step_together(runner, [loops[i] for i in active], batch)
        for i, step in zip(list(active), steps):
            if step.error is not None:
                raise step.error
            if step.ended:
                active.remove(i)
            else:
                yield i, step.event


class RaggedKV:
    """One attention layer's per-sequence KV caches behind mlx-lm's cache interface, for a pass
    over right-padded blocks ``[N, S]`` of which sequence i's first ``sizes[i]`` rows are real.

    ``offset`` holds each sequence's position (int32 [N], as mlx-lm's ``BatchKVCache``), which
    RoPE takes per sequence (``starts``: the same as ints). ``update_and_fetch`` writes each
    sequence's real rows into its own cache and returns every sequence's keys and values
    right-padded to the longest; ``make_mask`` is the mask that goes with them.
    """

    def __init__(self, caches: list[KVCache], sizes: list[int]):
        self.caches, self.sizes = caches, sizes
        self.starts = [c.offset for c in caches]
        self.offset = mx.array(self.starts, dtype=mx.int32)
        self.length = max(s + n for s, n in zip(self.starts, sizes))  # keys after the pass

    def make_mask(self, rows: int, return_array: bool = False, window_size: Optional[int] = None) -> mx.array:
        """[N, 1, rows, keys] bool: row j of sequence i sees positions up to start_i + j (its own
        pass's causal mask); a padding row sees what the sequence's last real row sees."""
        if window_size is not None:
            raise ValueError("a batched verify does not support sliding-window attention layers")
        last_real = np.minimum(np.arange(rows)[None], np.array(self.sizes)[:, None] - 1)  # [N, rows]
        seen = np.array(self.starts)[:, None] + last_real
        mask = np.arange(self.length)[None, None] <= seen[:, :, None]
        return mx.array(mask[:, None])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """keys, values [N, H, S, D] -> each sequence's whole keys and values [N, H, length, D]."""
        all_keys, all_values = [], []
        for i, (cache, size) in enumerate(zip(self.caches, self.sizes)):
            k, v = cache.update_and_fetch(keys[i : i + 1, :, :size], values[i : i + 1, :, :size])
            if k.shape[2] < self.length:
                pad = [(0, 0), (0, 0), (0, self.length - k.shape[2]), (0, 0)]
                k, v = mx.pad(k, pad), mx.pad(v, pad)
            all_keys.append(k)
            all_values.append(v)
        return mx.concatenate(all_keys), mx.concatenate(all_values)


class _BatchCache:
    """The sequences' target caches as the one cache a ``TargetRunner`` pass over a batch reads:
    ``RaggedKV`` per attention layer, stacked conv windows and states per Gated DeltaNet layer
    (keeping each sequence's states from before the pass)."""

    def __init__(self, caches: list[TargetCache], sizes: list[int]):
        self.kinds = caches[0].kinds
        self.before = [[c[i][1] for c in caches] for i, kind in enumerate(self.kinds) if kind == "gdn"]
        self.layers = [
            RaggedKV([c[i] for c in caches], sizes) if kind == "attention" else _stacked([c[i] for c in caches])
            for i, kind in enumerate(self.kinds)
        ]
        self.sequences = caches

    def __getitem__(self, i):
        return self.layers[i]

    def __len__(self):
        return len(self.layers)

    def advance(self, n: int) -> None:
        """Each sequence advances by its own rows after the pass (``verify_batch``)."""


def _stacked(caches: list[ArraysCache]) -> ArraysCache:
    """One Gated DeltaNet layer's conv windows and states stacked along the batch axis (what
    mlx-lm's ArraysCache.merge builds, in one op per array instead of one per sequence)."""
    if any(c[0] is None or c[1] is None for c in caches):
        raise ValueError("a batched verify needs every sequence prefilled (its Gated DeltaNet state set)")
    stacked = ArraysCache(size=2)
    stacked[0] = mx.concatenate([c[0] for c in caches])
    stacked[1] = mx.concatenate([c[1] for c in caches])
    return stacked


def _own_recurrent_inputs(
    batch: _BatchCache, recorded: list[RecurrentInputs], i: int, size: int
) -> list[RecurrentInputs]:
    """Sequence i's slice of every Gated DeltaNet layer's recorded inputs; sets its cache's conv
    window and state to those after its own ``size`` rows, as its own pass would."""
    own = []
    gdn_layers = [j for j, kind in enumerate(batch.kinds) if kind == "gdn"]
    for rec, j, before in zip(recorded, gdn_layers, batch.before):
        window = rec.conv_input.shape[1] - rec.q.shape[1]  # K - 1
        state = before[i]
        mine = RecurrentInputs(
            rec.conv_input[i : i + 1, : window + size],
            rec.q[i : i + 1, :size],
            rec.k[i : i + 1, :size],
            rec.v[i : i + 1, :size],
            rec.a[i : i + 1, :size],
            rec.b[i : i + 1, :size],
            state,
            rec.A_log,
            rec.dt_bias,
            rec.states[i : i + 1, :size] if rec.states is not None else None,
        )
        cache = batch.sequences[i][j]
        cache[0] = rec.conv_input[i : i + 1, size : size + window]
        if rec.states is not None:
            cache[1] = rec.states[i : i + 1, size - 1]
        elif size == rec.q.shape[1]:
            cache[1] = batch.layers[j][1][i : i + 1]
        else:  # padded: the state after its own last row (lazy: rollback usually replaces it)
            _, cache[1] = gated_delta_update(mine.q, mine.k, mine.v, mine.a, mine.b, mine.A_log, mine.dt_bias, state)
        own.append(mine)
    return own
