"""JSON mode: a logits processor that only lets the model write a valid JSON object.

A byte-level pushdown automaton tracks the JSON grammar over the bytes generated so far; a token
is allowed when all of its bytes keep the text a prefix of a valid JSON object (and, once the
object is closed, only an end-of-sequence token is). The processor is a pure function of the
token history, so the engine can apply it to every verify row (history = committed tokens + the
drafts before that row) and speculative decoding stays lossless.

Masks are cached per automaton state *signature* (the lexical state plus the top of the stack):
the first visit of a signature walks the vocabulary once, later visits are a dictionary hit.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

WS = b" \t\n\r"
DIGITS = b"0123456789"
HEX = b"0123456789abcdefABCDEF"
MAX_WS = 24  # consecutive whitespace bytes allowed (keeps a model from padding forever)
STACK_KEY = 6  # stack entries a mask depends on (a token closing deeper is refused: conservative)

# Lexical modes
VALUE, VALUE_OR_END, KEY, KEY_OR_END, COLON, AFTER, STRING, ESCAPE, UNICODE, LITERAL, NUMBER, DONE = range(12)


class State:
    __slots__ = ("mode", "stack", "is_key", "aux", "ws")

    def __init__(self, mode=VALUE, stack=(), is_key=False, aux=None, ws=0):
        self.mode, self.stack, self.is_key, self.aux, self.ws = mode, stack, is_key, aux, ws

    def copy(self) -> "State":
        return State(self.mode, self.stack, self.is_key, self.aux, self.ws)

    def signature(self):
        return (self.mode, self.stack[-STACK_KEY:], min(len(self.stack), STACK_KEY + 1), self.is_key, self.aux,
                min(self.ws, MAX_WS))


def _after_value(s: State) -> None:
    s.mode = DONE if not s.stack else AFTER
    s.is_key = False
    s.aux = None


def step(s: State, b: int, floor: int = 0) -> bool:
    """Advance ``s`` by byte ``b`` in place; False if the byte makes the text invalid.
    ``floor``: the stack may not be popped below this depth (signature-limited simulation)."""
    m = s.mode
    if b in WS and m not in (STRING, ESCAPE, UNICODE, LITERAL):
        if m == NUMBER:
            if not _number_can_end(s.aux):
                return False
            _after_value(s)
            m = s.mode
        if m == DONE:
            return False
        s.ws += 1
        return s.ws <= MAX_WS
    if b not in WS:
        s.ws = 0
    if m == STRING:
        if b == 0x22:  # "
            if s.is_key:
                s.mode, s.is_key = COLON, False
            else:
                _after_value(s)
        elif b == 0x5C:  # backslash
            s.mode = ESCAPE
        elif b < 0x20:
            return False
        return True
    if m == ESCAPE:
        if b in b'"\\/bfnrt':
            s.mode = STRING
            return True
        if b == 0x75:  # u
            s.mode, s.aux = UNICODE, 4
            return True
        return False
    if m == UNICODE:
        if b not in HEX:
            return False
        s.aux -= 1
        if s.aux == 0:
            s.mode, s.aux = STRING, None
        return True
    if m == LITERAL:
        word, i = s.aux
        if b != word[i]:
            return False
        if i + 1 == len(word):
            _after_value(s)
        else:
            s.aux = (word, i + 1)
        return True
    if m == NUMBER:
        nxt = _number_step(s.aux, b)
        if nxt is not None:
            s.aux = nxt
            return True
        if not _number_can_end(s.aux):
            return False
        _after_value(s)
        return step(s, b, floor)
    if m in (VALUE, VALUE_OR_END):
        if m == VALUE_OR_END and b == 0x5D:  # ]
            return _close(s, "a", floor)
        if not s.stack and s.aux == "top" and b != 0x7B:  # the top level must be an object
            return False
        if b == 0x7B:  # {
            s.stack += ("o",)
            s.mode, s.aux = KEY_OR_END, None
        elif b == 0x5B:  # [
            s.stack += ("a",)
            s.mode, s.aux = VALUE_OR_END, None
        elif b == 0x22:
            s.mode, s.is_key, s.aux = STRING, False, None
        elif b in b"tfn":
            word = {0x74: b"true", 0x66: b"false", 0x6E: b"null"}[b]
            s.mode, s.aux = LITERAL, (word, 1)
        elif b == 0x2D or b in DIGITS:
            s.mode, s.aux = NUMBER, ("sign" if b == 0x2D else "zero" if b == 0x30 else "int")
        else:
            return False
        return True
    if m in (KEY, KEY_OR_END):
        if m == KEY_OR_END and b == 0x7D:  # }
            return _close(s, "o", floor)
        if b == 0x22:
            s.mode, s.is_key = STRING, True
            return True
        return False
    if m == COLON:
        if b == 0x3A:
            s.mode = VALUE
            return True
        return False
    if m == AFTER:
        top = s.stack[-1]
        if b == 0x2C:  # ,
            s.mode = KEY if top == "o" else VALUE
            return True
        if b == 0x7D and top == "o" or b == 0x5D and top == "a":
            return _close(s, top, floor)
        return False
    return False  # DONE: nothing but an end-of-sequence token


def _close(s: State, kind: str, floor: int) -> bool:
    if not s.stack or s.stack[-1] != kind or len(s.stack) <= floor:
        return False
    s.stack = s.stack[:-1]
    _after_value(s)
    return True


def _number_step(state: str, b: int) -> Optional[str]:
    d = b in DIGITS
    return {
        "sign": "zero" if b == 0x30 else "int" if d else None,
        "zero": "dot" if b == 0x2E else "e" if b in b"eE" else None,
        "int": "int" if d else "dot" if b == 0x2E else "e" if b in b"eE" else None,
        "dot": "frac" if d else None,
        "frac": "frac" if d else "e" if b in b"eE" else None,
        "e": "esign" if b in b"+-" else "exp" if d else None,
        "esign": "exp" if d else None,
        "exp": "exp" if d else None,
    }[state]


def _number_can_end(state: str) -> bool:
    return state in ("zero", "int", "frac", "exp")


def initial() -> State:
    return State(VALUE, (), False, "top", 0)


def token_bytes(tokenizer) -> list[Optional[bytes]]:
    """Each token's bytes (None for special tokens, which JSON text never contains)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    n = len(tokenizer)
    pieces = hf.convert_ids_to_tokens(list(range(n)))
    special = set(getattr(hf, "all_special_ids", []) or [])
    added = getattr(hf, "added_tokens_decoder", {}) or {}
    special |= {i for i, t in added.items() if getattr(t, "special", False)}
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, _byte_decoder

    byte_level = isinstance(getattr(tokenizer, "_detokenizer", None), BPEStreamingDetokenizer)
    decoder = _byte_decoder() if byte_level else None
    out: list[Optional[bytes]] = []
    for i, piece in enumerate(pieces):
        if i in special or piece is None:
            out.append(None)
            continue
        if decoder is not None and all(c in decoder for c in piece):
            out.append(bytes(decoder[c] for c in piece))
        elif piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            out.append(bytes([int(piece[3:5], 16)]))
        elif decoder is None and "\u2581" in piece:
            out.append(piece.replace("\u2581", " ").encode("utf-8"))
        else:
            try:
                out.append(hf.decode([i]).encode("utf-8"))
            except Exception:
                out.append(None)
    return out


class _Vocab:
    """Per-tokenizer tables: token bytes, tokens grouped by first byte, tokens always valid inside a string."""

    def __init__(self, pieces: list[Optional[bytes]]):
        import numpy as np

        self.pieces = pieces
        self.by_first: dict[int, list[int]] = {}
        safe = np.zeros(len(pieces), dtype=bool)
        for i, data in enumerate(pieces):
            if not data:
                continue
            self.by_first.setdefault(data[0], []).append(i)
            safe[i] = all(b >= 0x20 and b not in (0x22, 0x5C) for b in data)
        self.string_safe = safe
        self.string_unsafe = [i for i, data in enumerate(pieces) if data and not safe[i]]
        self.masks: "OrderedDict[tuple, object]" = OrderedDict()  # state signature -> mask (shared by requests)


class JsonConstraint:
    """``(history [1, n], logits [1, V]) -> logits`` with invalid tokens at -inf."""

    _vocab_cache: dict = {}

    def __init__(self, vocab: _Vocab, eos_ids, prompt_len: int):
        self.vocab, self.eos = vocab, sorted(eos_ids)
        self.prompt_len = prompt_len
        self._tokens: list[int] = []
        self._states: list[Optional[State]] = [initial()]

    @classmethod
    def for_tokenizer(cls, tokenizer, prompt_len: int) -> "JsonConstraint":
        key = id(tokenizer)
        cached = cls._vocab_cache.get(key)
        if cached is None or cached[0] is not tokenizer:
            cached = cls._vocab_cache[key] = (tokenizer, _Vocab(token_bytes(tokenizer)))
        vocab = cached[1]
        return cls(vocab, tokenizer.eos_token_ids, prompt_len)

    def state_after(self, generated: list[int]) -> Optional[State]:
        """The automaton state after ``generated`` (incremental: reuses the longest known prefix)."""
        n = 0
        limit = min(len(generated), len(self._tokens))
        while n < limit and generated[n] == self._tokens[n]:
            n += 1
        del self._tokens[n:]
        del self._states[n + 1:]
        pieces = self.vocab.pieces
        for t in generated[n:]:
            s = self._states[-1]
            nxt = None
            if s is not None:
                data = pieces[t] if 0 <= t < len(pieces) else None
                if data:
                    nxt = s.copy()
                    if not all(step(nxt, b) for b in data):
                        nxt = None
            self._tokens.append(t)
            self._states.append(nxt)
        return self._states[-1]

    def _allowed(self, state: State, size: int):
        import numpy as np

        allowed = np.zeros(size, dtype=bool)
        floor = max(0, len(state.stack) - STACK_KEY)
        pieces = self.vocab.pieces
        if state.mode == STRING:
            n = min(size, len(pieces))
            allowed[:n] = self.vocab.string_safe[:n]
            candidates = self.vocab.string_unsafe
        else:
            candidates = []
            for first, ids in self.vocab.by_first.items():
                if step(state.copy(), first, floor):
                    candidates += ids
        for i in candidates:
            if i >= size:
                continue
            s = state.copy()
            ok = True
            for b in pieces[i]:
                if not step(s, b, floor):
                    ok = False
                    break
            allowed[i] = ok
        eos = [e for e in self.eos if e < size]
        if state.mode == DONE or not allowed.any():  # never leave nothing to pick
            allowed[eos] = True
        return allowed

    def _mask(self, state: State, size: int):
        import mlx.core as mx
        import numpy as np

        masks = self.vocab.masks
        key = (state.signature(), size, tuple(self.eos))
        mask = masks.get(key)
        if mask is not None:
            masks.move_to_end(key)
            return mask
        mask = mx.array(np.where(self._allowed(state, size), 0.0, -np.inf).astype(np.float32))
        masks[key] = mask
        if len(masks) > 512:
            masks.popitem(last=False)
        return mask

    def __call__(self, history, logits):
        tokens = history[0].tolist() if history.ndim == 2 else history.tolist()
        state = self.state_after(tokens[self.prompt_len:])
        if state is None:  # the text already left the grammar (cannot happen under this processor)
            return logits
        return logits + self._mask(state, logits.shape[-1]).astype(logits.dtype)
