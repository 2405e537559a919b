"""The target's own answers to chat prompts of different lengths, each as the engine writes it alone.

A batch of prompts is answered in one target pass per step, but no prompt ever sees another's
tokens or any padding: the prompts of one length are prefilled together (no padding needed), then
every prompt decodes in one batch whose keys and values are left-padded into one buffer per layer,
with an attention mask that hides each row's pad columns from its queries and RoPE at each row's
own position (``_PaddedKV``: mlx-lm's ``BatchKVCache`` with the per-row lengths the
``TargetRunner`` reads, as for the engine's batched verify). So each answer equals the prompt
answered alone within float rounding (``tests/test_smollm2_build.py`` pins it token for token
against the engine's plain decoding, and the features of prompt + answer). An answer stops at its
first end token (kept, as the engine emits it) or after ``max_tokens``; a stopped row leaves the
batch. (Until issue 40 the prompts were left-padded with ``<|endoftext|>`` and decoded with no
mask: the pads changed what SmolLM2 wrote, 32 answers of 32.)

Sampled answers draw every token with a key of its own prompt (``prompt_seed``: the stage's seed
and the prompt's tokens) and step, so a prompt's answer does not depend on which batch it is in.

``method="equal"`` batches only prompts of one length instead (no mask, exact by construction).
Measured on SmolLM2 (32 prompts x 32 tokens, same run, a contended 2-core machine): one length,
23.5 s masked / 21.5 s equal; three lengths 23.1 / 52.1 s; 23 lengths 41.8 / 103.9 s, and with
the end token 27.5 / 109.7 s; the same tokens every time. The training set's 987 prompts have
111 lengths (125 batches of one length against 31), so the masked batches are the default. (The
engine's own ``verify_batch``, one KV cache per sequence, took 19.9 s where equal took 8.8 s:
it copies every sequence's keys into a padded batch at every step.)
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache

from dflash2_mlx.decoding.sampling import SamplingSettings, probabilities

__all__ = ["GENERATION_RECIPE", "answer_prompts", "prompt_seed"]

# Part of every continuation chunk's key: chunks made by another recipe (the left-padded batches
# before issue 40) are never reused.
GENERATION_RECIPE = "alone-v2: no padding seen (masked batches), answers stopped at the end token"


def prompt_seed(seed: int, prompt: Sequence[int]) -> int:
    """The seed of one prompt's sampled answer: a function of the stage's seed and its tokens."""
    digest = hashlib.sha256(f"{int(seed)}:{','.join(str(int(t)) for t in prompt)}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


class _Draws:
    """Each row's next token: argmax, or a draw with that row's own key for this step."""

    def __init__(self, prompts, max_tokens: int, sampling: Optional[SamplingSettings], seed: int):
        self.sampling = None if sampling is None or sampling.greedy else sampling
        self.keys = None
        if self.sampling is not None:
            self.keys = [mx.random.split(mx.random.key(prompt_seed(seed, p)), max_tokens) for p in prompts]

    def __call__(self, rows: list[int], logits: list[mx.array], step: int) -> mx.array:
        """int32 [len(rows)]: the next token of each row from its last logits [V]."""
        if self.sampling is None:
            return mx.argmax(mx.stack(logits), axis=-1).astype(mx.int32)
        drawn = [
            mx.random.categorical(mx.log(probabilities(last[None], self.sampling))[0], key=self.keys[r][step])
            for r, last in zip(rows, logits)
        ]
        return mx.stack(drawn).astype(mx.int32)


def answer_prompts(
    runner,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    sampling: Optional[SamplingSettings] = None,
    seed: int = 0,
    stop_ids: Iterable[int] = (),
    method: str = "padded",
) -> list[np.ndarray]:
    """Each prompt's answer (int32, up to ``max_tokens`` tokens, ending with its first token in
    ``stop_ids`` if it wrote one), in order; the prompts answered together, each as alone.

    Greedy (argmax, as plain decoding does it) when ``sampling`` is None or greedy; otherwise
    sampled from ``probabilities(logits, sampling)`` with the prompt's own key per step.
    ``method``: "padded" (masked batches of every length) or "equal" (batches of one length).
    """
    if method not in ("padded", "equal"):
        raise ValueError(f"method is 'padded' or 'equal', got {method!r}")
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts:
        return []
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    stops = set(int(t) for t in stop_ids)
    draws = _Draws(prompts, max_tokens, sampling, seed)
    if method == "padded" and "gdn" not in runner.kinds:
        return _answer_padded(runner, prompts, max_tokens, draws, stops)
    answers: list[Optional[np.ndarray]] = [None] * len(prompts)
    for length in sorted({len(p) for p in prompts}):
        rows = [i for i, p in enumerate(prompts) if len(p) == length]
        for row, answer in zip(rows, _answer_equal(runner, prompts, rows, max_tokens, draws, stops)):
            answers[row] = answer
    return answers


def _answer_equal(runner, prompts, rows: list[int], max_tokens: int, draws: _Draws, stops: set) -> list[np.ndarray]:
    """The ``rows`` of ``prompts``, all of one length, as one batch [n, L] (no padding, no mask);
    a stopped row is still fed (its later tokens are dropped) until every row has stopped."""
    cache = runner.make_cache()
    batch = mx.array([prompts[i] for i in rows], dtype=mx.int32)
    logits, _ = runner(batch, cache, logits_from=batch.shape[1] - 1)
    answers: list[list[int]] = [[] for _ in rows]
    done = [False] * len(rows)
    for step in range(max_tokens):
        nxt = draws(rows, [logits[i, -1] for i in range(len(rows))], step)
        mx.eval(nxt)
        for i, token in enumerate(nxt.tolist()):
            if not done[i]:
                answers[i].append(token)
                done[i] = token in stops
        if all(done) or step + 1 == max_tokens:
            break
        logits, _ = runner(nxt[:, None], cache)
    return [np.array(a, dtype=np.int32) for a in answers]


class _PaddedKV(BatchKVCache):
    """One attention layer's keys and values of a batch of prompts, left-padded: mlx-lm's batch
    cache (each row's pads masked from every query, rows dropped by ``filter``), plus ``starts``,
    each row's length as ints, which the runner's RoPE table reads without a host sync."""

    @classmethod
    def of_rows(cls, keys: list[mx.array], values: list[mx.array], lengths: list[int]) -> "_PaddedKV":
        rows = []
        for k, v, n in zip(keys, values, lengths):
            row = KVCache()
            row.keys, row.values, row.offset = k, v, n
            rows.append(row)
        cache = cls.merge(rows)
        cache.starts = list(lengths)
        return cache

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.starts = [s + keys.shape[2] for s in self.starts]
        return super().update_and_fetch(keys, values)

    def filter(self, batch_indices: list[int]) -> None:
        super().filter(mx.array(batch_indices))
        self.starts = [self.starts[i] for i in batch_indices]


class _PaddedCache:
    """The ``_PaddedKV`` of every layer, as the one cache a ``TargetRunner`` pass reads."""

    def __init__(self, layers: list[_PaddedKV]):
        self.layers = layers

    def __getitem__(self, i):
        return self.layers[i]

    def __len__(self):
        return len(self.layers)

    def advance(self, n: int) -> None:
        """Each layer advanced its own positions."""


def _answer_padded(runner, prompts, max_tokens: int, draws: _Draws, stops: set) -> list[np.ndarray]:
    """Prompts of one length prefilled together, then every prompt decoded in one left-padded,
    masked batch (attention layers only: a Gated DeltaNet state has no pad to mask)."""
    lengths = [len(p) for p in prompts]
    keys = [[None] * len(prompts) for _ in runner.kinds]
    values = [[None] * len(prompts) for _ in runner.kinds]
    last: list[Optional[mx.array]] = [None] * len(prompts)
    for length in sorted(set(lengths)):
        rows = [i for i, n in enumerate(lengths) if n == length]
        cache = runner.make_cache()
        logits, _ = runner(mx.array([prompts[i] for i in rows], dtype=mx.int32), cache, logits_from=length - 1)
        for j, row in enumerate(rows):
            last[row] = logits[j, -1]
            for layer in range(len(runner.kinds)):
                keys[layer][row] = cache[layer].keys[j : j + 1, :, :length]
                values[layer][row] = cache[layer].values[j : j + 1, :, :length]
    batch = _PaddedCache([_PaddedKV.of_rows(k, v, lengths) for k, v in zip(keys, values)])
    active = list(range(len(prompts)))
    answers: list[list[int]] = [[] for _ in prompts]
    for step in range(max_tokens):
        nxt = draws(active, last, step)
        mx.eval(nxt)
        tokens = nxt.tolist()
        for row, token in zip(active, tokens):
            answers[row].append(token)
        going = [j for j, token in enumerate(tokens) if token not in stops]
        if not going or step + 1 == max_tokens:
            break
        if len(going) < len(active):
            for layer in batch.layers:
                layer.filter(going)
            active, nxt = [active[j] for j in going], nxt[mx.array(going)]
        logits, _ = runner(nxt[:, None], batch)
        last = [logits[j, -1] for j in range(len(active))]
    return [np.array(a, dtype=np.int32) for a in answers]
