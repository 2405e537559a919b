"""The target's cache, made to roll back: attention KV is trimmed, Gated DeltaNet state is replayed.

A verify pass feeds B rows to the target; only the first ``keep = accepted + 1`` of them are
committed. Attention layers simply forget the last B - keep entries. A Gated DeltaNet layer's
recurrent state cannot be un-applied, so during verify the runner records each such layer's
inputs to the recurrence (q, k, v, a, b, the state before the pass and the conv window); rollback
restores the state from before the pass and replays the recurrence over the first ``keep`` steps
from those recorded inputs: no weight matmuls, and no change to mlx-lm's classes. Where the
recurrence runs as separate ops per step (the CPU), the pass keeps each step's state instead and
rollback just picks one: no replay at all.

``DFLASH2_MLX_ROLLBACK`` chooses between the two: ``keep`` (every verify pass keeps its per-step
states), ``replay`` (never: the Metal path, which the CPU then runs too, so tests cover it) or
``auto`` (the default: keep where the recurrence runs as ops and the states are small, see
``target.py``). Both give the state plain decoding would have reached (tests pin it for both).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.gated_delta import gated_delta_update

ROLLBACK_ENV = "DFLASH2_MLX_ROLLBACK"
ROLLBACK_SETTINGS = ("auto", "keep", "replay")


def rollback_setting() -> str:
    """``DFLASH2_MLX_ROLLBACK`` (auto, keep or replay; unset: auto). A bad value raises
    ValueError with a one-line message that says what to set."""
    value = os.environ.get(ROLLBACK_ENV, "").strip().lower() or "auto"
    if value not in ROLLBACK_SETTINGS:
        raise ValueError(
            f"{ROLLBACK_ENV}={value!r} is not one of {', '.join(ROLLBACK_SETTINGS)}; unset it or set one of those"
        )
    return value


@dataclass
class RecurrentInputs:
    """What one Gated DeltaNet layer consumed during a verify pass."""

    conv_input: mx.array  # [1, K-1+S, conv_dim]: the conv window before the pass, then S rows
    q: mx.array  # [1, S, Hk, Dk]
    k: mx.array
    v: mx.array  # [1, S, Hv, Dv]
    a: mx.array  # [1, S, Hv]
    b: mx.array
    state: Optional[mx.array]  # [1, Hv, Dv, Dk] before the pass (None: zeros)
    A_log: mx.array
    dt_bias: mx.array
    states: Optional[mx.array] = None  # [1, S, Hv, Dv, Dk]: the state after each step, when the pass kept them


class TargetCache:
    """One mlx-lm cache object per target layer, plus whole-cache snapshots."""

    def __init__(self, kinds: list[str]):
        self.kinds = kinds
        self.layers: list[Any] = [ArraysCache(size=2) if k == "gdn" else KVCache() for k in kinds]

    def __getitem__(self, i):
        return self.layers[i]

    def __len__(self):
        return len(self.layers)

    offset = 0  # number of positions the cache covers

    def advance(self, n: int) -> None:
        self.offset += n

    def rollback(self, recorded: list[RecurrentInputs], fed: int, keep: int) -> None:
        """Forget the last ``fed - keep`` rows of the pass that recorded ``recorded``."""
        drop = fed - keep
        if drop <= 0:
            return
        self.offset -= drop
        gdn_inputs = iter(recorded)
        for kind, c in zip(self.kinds, self.layers):
            if kind == "attention":
                c.trim(drop)
                continue
            rec = next(gdn_inputs)
            if rec.states is not None:  # the pass kept every step's state: nothing to recompute
                state = mx.take(rec.states, keep - 1, axis=1)  # one op where [:, i] is two
            else:
                _, state = gated_delta_update(
                    rec.q[:, :keep],
                    rec.k[:, :keep],
                    rec.v[:, :keep],
                    rec.a[:, :keep],
                    rec.b[:, :keep],
                    rec.A_log,
                    rec.dt_bias,
                    rec.state,
                )
            window = rec.conv_input.shape[1] - fed  # K - 1
            c[0] = rec.conv_input[:, keep : keep + window]  # a view: a verify pass's input is a few rows
            c[1] = state

    def snapshot(self) -> "CacheSnapshot":
        """A copy of the whole cache that later passes cannot change."""
        states = []
        for kind, c in zip(self.kinds, self.layers):
            if kind == "attention":
                if c.keys is None:
                    states.append((None, None, 0))
                else:
                    states.append((c.keys[..., : c.offset, :], c.values[..., : c.offset, :], c.offset))
            else:
                states.append((c[0], c[1]))
        mx.eval([a for s in states for a in s if isinstance(a, mx.array)])
        return CacheSnapshot(states, self.offset)

    def restore(self, snap: "CacheSnapshot") -> None:
        for kind, c, state in zip(self.kinds, self.layers, snap.states):
            if kind == "attention":
                keys, values, offset = state
                c.keys, c.values, c.offset = keys, values, offset
            else:
                c[0], c[1] = state
        self.offset = snap.offset

    @property
    def nbytes(self) -> int:
        total = 0
        for kind, c in zip(self.kinds, self.layers):
            arrays = [c.keys, c.values] if kind == "attention" else list(c.cache)
            total += sum(a.nbytes for a in arrays if a is not None)
        return total


@dataclass
class CacheSnapshot:
    states: list
    offset: int

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for s in self.states for a in s if isinstance(a, mx.array))
