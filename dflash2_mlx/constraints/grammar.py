"""Constrained decoding: a grammar (JSON Schema, any JSON object, or Lark rules) masks the logits.

Built on llguidance (chosen over xgrammar by measurement, see docs/server.md "Structured output"):
it needs no other package, names the JSON Schema keywords it cannot enforce, rolls back any number
of tokens, and takes Lark grammars with embedded JSON schemas (forced tool calls).

A ``Grammar`` is compiled once per request (immutable, reusable across generations); the decode
loops call ``Grammar.start()`` for a fresh ``GrammarState`` and then use three calls:

- ``mask_next(logits [1, V])``: mask the next token after everything committed (the prefill's
  token, each autoregressive step);
- ``mask_verify(logits [R + 1, V], drafts)``: mask verify row i as plain decoding would have seen
  it, after the committed tokens and drafts d1..di (the matcher is advanced along the drafts and
  rolled back; rows after a draft the grammar refuses are left unmasked: they can never be used,
  because that draft is rejected);
- ``commit(tokens)``: advance by the tokens really emitted (accepted drafts + bonus).

A grammar can start after a reasoning block (``reasoning_end``: the tokens that close it, e.g.
``</think>``): the reasoning is not constrained, then a little whitespace and the answer are.

Masks are built on the host as bitmasks (a verify block's rows in one native llguidance call),
then turned into a boolean array and applied with one ``where``; the decode loop asks for them
while the device computes the verify pass.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any, Optional, Sequence

import mlx.core as mx
import numpy as np

# Whitespace is fixed (", " and ": ", no newlines): a model cannot pad forever, and the output is
# the compact style json.dumps writes.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Between a closed reasoning block and the answer (Qwen writes "</think>\n\n").
LEAD = "LEAD: /[ \\t\\r\\n]{1,8}/\n"
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")
# Walking the drafter's candidates under the grammar puts a host step between the draft and its
# verify pass; it pays only when a refused draft often is what ends the accepted run. The share of
# cycles where the selector's own path held a refused token no later than the accepted length is
# followed every cycle, walked or not (exponentially weighted), and the walk is used while it is
# above WALK_ABOVE (measured in docs/benchmarks.md "Constrained decoding").
REFUSAL_PRIOR, REFUSAL_WEIGHT, WALK_ABOVE = 0.5, 0.2, 0.2


class GrammarError(ValueError):
    """A schema or grammar the engine cannot enforce; ``keyword`` names the culprit when known."""

    def __init__(self, message: str, keyword: Optional[str] = None):
        super().__init__(message)
        self.keyword = keyword


def json_schema_rules(schema: dict, strict: bool = False) -> str:
    """Lark rules defining ``answer`` as a JSON value following ``schema`` (``strict``: objects take
    no unlisted properties unless the schema says otherwise, as OpenAI's strict mode demands).
    Raises ``GrammarError`` naming a keyword the engine cannot enforce."""
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    if strict:
        schema = _closed_objects(schema)
    rules = f"answer: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}\n"
    check_rules(rules)
    return rules


def json_object_rules() -> str:
    """Any JSON object (OpenAI's ``json_object`` mode)."""
    return json_schema_rules({"type": "object"})


def check_rules(rules: str) -> None:
    """Raise ``GrammarError`` (naming an unsupported JSON Schema keyword) if llguidance refuses the
    rules. Needs no tokenizer, so requests can be checked before they are queued."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(_full_text(rules, False))
    if not error:
        return
    m = _UNIMPLEMENTED.search(error)
    if m:
        keys = [k.strip().strip('"') for k in m.group(1).split(",") if k.strip()]
        raise GrammarError(
            f"the schema uses {', '.join(repr(k) for k in keys)}, which constrained decoding cannot enforce; remove it",
            keys[0] if keys else None,
        )
    detail = next((line for line in error.splitlines() if "failed" in line or "rror" in line), error.splitlines()[0])
    raise GrammarError(f"the schema cannot be enforced: {detail.strip()[:300]}")


def reasoning_end_for(tokenizer, prompt: Sequence[int]) -> tuple[int, ...]:
    """The tokens that close the reasoning block ``prompt`` leaves open (a thinking chat template's
    generation prompt), or () when the answer starts outside one."""
    if not getattr(tokenizer, "has_thinking", False) or not prompt:
        return ()
    prompt = list(prompt)
    if tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt):
        return tuple(tokenizer.think_end_tokens or ())
    return ()


def _full_text(rules: str, after_reasoning: bool) -> str:
    import llguidance

    start = "start: LEAD? answer\n" + LEAD if after_reasoning else "start: answer\n"
    return llguidance.LLMatcher.grammar_from_lark(start + rules)


def _closed_objects(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema with ``properties`` and no
    ``additionalProperties`` gets ``additionalProperties: false``."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("const", "enum", "default", "examples") else _closed_objects(v)) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_EXECUTOR: Any = None


def _executor():
    """llguidance's executor for its batch mask calls, made once (it owns a thread pool)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


# ---- tokenizers ---------------------------------------------------------------------------------

_TOKENIZERS: dict[int, Any] = {}
_TOKENIZERS_LOCK = threading.Lock()


def grammar_tokenizer(tokenizer, stop_token_ids: Sequence[int] = ()):
    """llguidance's view of a Hugging Face (or mlx-lm wrapped) fast tokenizer, built once per
    tokenizer (it takes seconds at a 248K vocabulary: the server warms it up after loading)."""
    import llguidance.hf

    hf = hf_tokenizer(tokenizer)
    stops = sorted(set(stop_token_ids) or set(getattr(tokenizer, "eos_token_ids", ()) or ()) or {hf.eos_token_id})
    key = id(hf)
    with _TOKENIZERS_LOCK:
        cached = _TOKENIZERS.get(key)
        if cached is None or cached[0] is not hf or cached[1] != stops:
            cached = (hf, stops, llguidance.hf.from_tokenizer(hf, eos_token=list(stops)))
            _TOKENIZERS[key] = cached
        return cached[2]


def hf_tokenizer(tokenizer):
    """The Hugging Face tokenizer itself, out of mlx-lm's ``TokenizerWrapper`` if wrapped."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer


class Grammar:
    """One request's grammar, compiled for one tokenizer.

    ``rules``: Lark rules defining ``answer`` (``json_schema_rules``, ``json_object_rules``, or
    your own; they may embed ``%json {schema}``). ``stop_token_ids`` end the text once the answer
    is complete (the engine's stop tokens): a complete answer allows nothing but them.
    ``reasoning_end``: the text starts inside a reasoning block closed by these tokens.
    """

    def __init__(self, rules: str, tokenizer, stop_token_ids: Sequence[int] = (), reasoning_end: Sequence[int] = ()):
        import llguidance

        self.rules = rules
        self.reasoning_end = [int(t) for t in reasoning_end]
        self.grammar = _full_text(rules, bool(self.reasoning_end))
        self.llg_tokenizer = grammar_tokenizer(tokenizer, stop_token_ids)
        self.stop_token_ids = list(self.llg_tokenizer.eos_tokens)
        self.words = (self.llg_tokenizer.vocab_size + 31) // 32
        probe = llguidance.LLMatcher(self.llg_tokenizer, self.grammar, log_level=0)
        if probe.is_error():
            raise GrammarError(f"the grammar cannot be enforced: {probe.get_error()[:300]}")

    @classmethod
    def json_schema(
        cls,
        schema: dict,
        tokenizer,
        stop_token_ids: Sequence[int] = (),
        strict: bool = False,
        reasoning_end: Sequence[int] = (),
    ) -> "Grammar":
        return cls(json_schema_rules(schema, strict), tokenizer, stop_token_ids, reasoning_end)

    @classmethod
    def json_object(cls, tokenizer, stop_token_ids: Sequence[int] = (), reasoning_end: Sequence[int] = ()) -> "Grammar":
        return cls(json_object_rules(), tokenizer, stop_token_ids, reasoning_end)

    def start(self) -> "GrammarState":
        """A matcher at the start of the generated text."""
        return GrammarState(self)


class GrammarState:
    """The matcher of one generation: masks for the next token and for verify rows, and commits."""

    def __init__(self, grammar: Grammar):
        import llguidance

        self.grammar = grammar
        self.matcher = llguidance.LLMatcher(grammar.llg_tokenizer, grammar.grammar, log_level=0)
        self._bits = np.zeros((16, grammar.words), dtype=np.int32)  # [rows, words]: one bit per token
        self._stops = set(grammar.stop_token_ids)
        self._stop_array = np.array(sorted(self._stops), dtype=np.int64)
        self._end = grammar.reasoning_end
        self._reasoning = bool(self._end)  # inside the reasoning block: nothing is masked yet
        self._tail: list[int] = []  # the last tokens while reasoning (to see the block close)
        self.refusal_rate = REFUSAL_PRIOR  # share of recent cycles a refused draft held back
        # where the selector's own path was refused: found by the walk (else by mask_verify), then
        # kept until the commit says whether the accepted run reached it
        self._walk_refused_at: Optional[int] = None
        self._pending: Optional[int] = None

    @property
    def walk_pays(self) -> bool:
        """Whether the next block's drafts should be walked under the grammar (greedy_path): the
        drafter has recently proposed refused tokens often enough."""
        return self.refusal_rate > WALK_ABOVE

    def _observe_refusal(self, refused: float) -> None:
        self.refusal_rate += REFUSAL_WEIGHT * (refused - self.refusal_rate)

    def _fill(self, row: int) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self._bits, row)
        self._allow_stops_where_empty(row, row + 1)

    def _allow_stops_where_empty(self, start: int, stop: int) -> None:
        """A finished (or failed) matcher allows nothing: let a stop token end the text there."""
        empty = start + np.flatnonzero(~self._bits[start:stop].any(axis=1))
        for t in self.grammar.stop_token_ids:
            self._bits[empty, t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))

    def _allowed_prefix(self, tokens: Sequence[int], valid: Optional[int] = None) -> int:
        """How many of ``tokens`` the matcher takes in a row, stopping before a stop token (it ends
        the text); the matcher is not moved. Far cheaper than a mask per token. ``valid``: the
        matcher's ``validate_tokens(tokens)``, when known."""
        n = self.matcher.validate_tokens(list(tokens)) if valid is None else valid
        return next((i for i, t in enumerate(tokens[:n]) if t in self._stops), n)

    def _ensure_rows(self, rows: int) -> None:
        if rows > self._bits.shape[0]:
            self._bits = np.zeros((rows, self.grammar.words), dtype=np.int32)

    def _apply(self, logits: mx.array, rows: int) -> mx.array:
        """logits [rows, V] with every token outside rows' bitmasks set to -inf."""
        vocab = logits.shape[-1]
        allowed = np.unpackbits(self._bits[:rows].view(np.uint8), axis=1, bitorder="little")
        if allowed.shape[1] < vocab:  # logits wider than the tokenizer: padding ids are never allowed
            allowed = np.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])))
        allowed = mx.array(allowed[:, :vocab].astype(np.bool_))
        return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))

    def _closes_reasoning(self, tail: list[int]) -> bool:
        n = len(self._end)
        return len(tail) >= n and tail[-n:] == self._end

    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the grammar takes in a row after the committed ones (a copy
        draft is cut there: a refused token would be rejected whatever follows). Inside the
        reasoning block nothing is masked yet: all of them."""
        if self._reasoning:
            return len(tokens)
        return self._allowed_prefix(tokens)

    def mask_next(self, logits: mx.array) -> mx.array:
        """logits [1, V] -> the same with the tokens the grammar forbids next set to -inf."""
        if self._reasoning:
            return logits
        self._fill(0)
        return self._apply(logits, 1)

    def mask_verify(self, logits: mx.array, drafts: Sequence[int]) -> mx.array:
        """Verify logits [R + 1, V] for drafts d1..dR -> row i masked after d1..di; the matcher is
        back where it was afterwards."""
        from llguidance.numpy import fill_next_token_bitmask_par_with_draft_tokens

        rows = logits.shape[0]
        self._ensure_rows(rows)
        drafts = [int(d) for d in drafts[: rows - 1]]
        first = 0  # the first row the grammar masks: rows before it are still reasoning
        if self._reasoning:
            tail = self._tail[:]
            for first, d in enumerate(drafts, start=1):
                tail.append(d)
                if self._closes_reasoning(tail):
                    break
            else:
                return logits
            self._bits[:first] = -1
        # Rows first..first+n follow the drafts the grammar takes; a refused draft (or a stop
        # token, which ends the text) is rejected whatever follows, so later rows never count.
        body = drafts[first:]
        valid = self.matcher.validate_tokens(body) if body else 0
        taken = body[: self._allowed_prefix(body, valid)]
        if body:  # where the selector's own path was refused (len(body): nowhere), for the commit
            found = self._walk_refused_at if self._walk_refused_at is not None else valid
            self._pending = first + found if found < len(body) else rows  # rows: never reached
        self._walk_refused_at = None
        if taken:  # one native call fills every row (advancing along the drafts and back), without the GIL
            fill_next_token_bitmask_par_with_draft_tokens(_executor(), [(self.matcher, first, taken)], self._bits)
        else:
            self._fill(first)
        last = first + len(taken)
        self._allow_stops_where_empty(first, last + 1)
        self._bits[last + 1 : rows] = -1
        return self._apply(logits, rows)

    def greedy_path(self, candidates, pairs, unmasked: Optional[Sequence[int]] = None) -> list[int]:
        """The selector's greedy walk restricted to candidates the grammar allows: candidates
        [R, k] and pair scores [R, k (predecessor), k] as the selector computes them (row 0's
        predecessor slot 0 is the anchor) -> R draft tokens. A row with no allowed candidate takes
        its best one and the rest of the walk is unmasked (that draft is rejected anyway). Drafts
        only change acceptance: the verify masks keep the output exact.

        Most drafts are allowed, so the unmasked walk is checked in one call and a row's mask is
        built only where its best candidate is refused. ``unmasked``: that walk, when the selector
        has computed it already; if the grammar allows all of it, neither array is read."""
        if unmasked is not None:  # (inside a reasoning block the walk is the unmasked one)
            unmasked = [int(t) for t in unmasked]
            if self._reasoning:
                return unmasked
            if self._allowed_prefix(unmasked) == len(unmasked):
                self._walk_refused_at = len(unmasked)
                return unmasked
        candidates = np.asarray(candidates)
        pairs = np.asarray(pairs.astype(mx.float32) if isinstance(pairs, mx.array) else pairs)
        rows = candidates.shape[0]
        self._ensure_rows(rows)
        best = pairs.argmax(axis=-1)  # [R, k]: row i's best slot after each predecessor slot
        path: list[int] = []
        prev, consumed, masking = 0, 0, not self._reasoning
        while len(path) < rows:
            slots = []  # the unmasked walk from this row on
            for i in range(len(path), rows):
                slots.append(int(best[i, slots[-1] if slots else prev]))
            tokens = [int(candidates[len(path) + j, b]) for j, b in enumerate(slots)]
            if not masking:
                path += tokens
                break
            valid = self.matcher.validate_tokens(tokens)
            n = self._allowed_prefix(tokens, valid)
            if not path:  # the selector's own path: refused or not
                self._walk_refused_at = valid
            self.matcher.consume_tokens(tokens[:n])
            path, consumed = path + tokens[:n], consumed + n
            if n == len(tokens):
                break
            i, prev = len(path), (slots[n - 1] if n else prev)
            # row i's best candidate is refused: take the best one its mask allows
            self._fill(i)
            order = np.argsort(-pairs[i, prev], kind="stable")
            allowed = self._allowed_candidates(i, candidates[i])
            pick = next((b for b in order if allowed[b]), None)
            if pick is None or not self.matcher.consume_token(int(candidates[i, pick])):
                pick, masking = order[0], False
            else:
                consumed += 1
            path.append(int(candidates[i, pick]))
            prev = int(pick)
        self.matcher.rollback(consumed)
        return path

    def _allows(self, row: int, token: int) -> bool:
        return token >> 5 < self._bits.shape[1] and bool((int(self._bits[row, token >> 5]) >> (token & 31)) & 1)

    def _allowed_candidates(self, row: int, tokens: np.ndarray) -> np.ndarray:
        """Which of a walk row's candidate ``tokens`` its mask allows, stop tokens excluded (a
        draft never ends the text) -> bool array of the same shape."""
        tokens = np.asarray(tokens, dtype=np.int64)
        words = tokens >> 5
        inside = words < self._bits.shape[1]
        bits = self._bits[row].view(np.uint32)[np.where(inside, words, 0)]
        allowed = inside & ((bits >> (tokens & 31).astype(np.uint32)) & 1).astype(np.bool_)
        return allowed & ~np.isin(tokens, self._stop_array)

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance by emitted tokens (each was allowed by the mask it was picked under). After a
        verify block, ``tokens`` are its accepted drafts + bonus."""
        if self._pending is not None:  # a refused draft held the run back if it was reached
            self._observe_refusal(float(self._pending <= len(tokens) - 1))
            self._pending = None
        for t in tokens:
            t = int(t)
            if self._reasoning:
                self._tail = (self._tail + [t])[-len(self._end) :]
                self._reasoning = not self._closes_reasoning(self._tail)
                continue
            if t in self._stops:
                break  # the text ends here; nothing after a stop token is emitted
            if not self.matcher.consume_token(t):
                raise RuntimeError(f"token {t} was emitted although the grammar refused it: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """True once the answer is complete and nothing but a stop token may follow."""
        return not self._reasoning and self.matcher.is_stopped()
