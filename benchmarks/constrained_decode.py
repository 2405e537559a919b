"""Constrained vs unconstrained decoding on the embedded pair: decode tok/s and acceptance, same run.

    python benchmarks/constrained_decode.py [--prompts 6] [--max-tokens 96] [--repeats 2] [--code] [--json out.json]

Prompts: structured-output requests as a user sends them, "Describe the function F of M as JSON."
for the held-out stdlib files' public functions, in the chat template, with ``DESCRIBE`` (the
shape the demo pair learned to answer in) as the schema; ``--code``: the embedded prompt set (raw
code prefixes) with ``SCHEMA``, JSON the pair does not write by itself there.

For each prompt, interleaved in one run (one warm-up first):

- ``free``: speculative, no grammar (the baseline);
- ``mask-only``: speculative with a grammar that allows every token (``answer: /(?s:.*)/``): the
  same tokens and acceptance as ``free``, so the difference is the cost of building and applying
  the masks (host bitmask per verify row, read of the drafts, the ``where`` on the logits);
- ``schema``: speculative with the JSON schema (with ``--code`` the answer is forced into JSON the
  code model never writes after a code prefix, so its drafter's acceptance drops: that is the
  drafter, not the mask);
- ``schema-ar``: plain decoding with the same schema (what the schema costs without speculation).

It also counts, in ``schema`` runs, the cycles whose first rejected draft was one the grammar
refused: the most that masking the drafter's candidates in the selector walk could recover.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from harness import load_pair, write_report

import dflash2_mlx  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "args": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "returns": {"enum": ["int", "str", "list", "dict", "None"]},
        "body": {"type": "string", "maxLength": 400},
    },
    "required": ["name", "args", "returns", "body"],
    "additionalProperties": False,
}

DESCRIBE = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "module": {"type": "string"},
        "parameters": {"type": "array", "items": {"type": "string"}},
        "returns": {"type": "boolean"},
        "summary": {"type": "string"},
    },
    "required": ["name", "module", "parameters", "returns", "summary"],
    "additionalProperties": False,
}


def json_requests(tok, count: int) -> list[list[int]]:
    """The first ``count`` JSON-description requests for held-out functions, chat-templated."""
    from dflash2_mlx.training import corpus

    _, held = corpus.split(corpus.load_corpus())
    users = [user for f in held for user, _ in corpus.json_examples(f, 100)]
    step = max(1, len(users) // count)  # spread over the held-out files
    return [
        tok.apply_chat_template([{"role": "user", "content": u}], add_generation_prompt=True, tokenize=True)
        for u in users[::step][:count]
    ]


class RefusalCounter:
    """Wraps a grammar's states to count, per verify call, whether a draft was refused."""

    def __init__(self, grammar):
        self.grammar, self.refused_at = grammar, []

    def start(self):
        state = self.grammar.start()
        real = state.mask_verify

        def mask_verify(logits, drafts):
            out = real(logits, drafts)
            refused = next((i for i, d in enumerate(drafts) if not state._allows(i, int(d))), None)
            self.refused_at.append(refused)
            return out

        state.mask_verify = mask_verify
        return state


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--code", action="store_true", help="raw code prefixes and SCHEMA instead of JSON requests")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from dflash2_mlx import assets
    from dflash2_mlx.constraints.grammar import Grammar
    from dflash2_mlx.engine import GenerationSettings, collect, generate_autoregressive, generate_speculative

    target, drafter = load_pair()
    tok, runner = target.tokenizer, target.runner
    stops = sorted(tok.eos_token_ids)
    if args.code:
        prompts = [tok.encode(p, add_special_tokens=False) for p in assets.demo_prompts()[: args.prompts]]
    else:
        prompts = json_requests(tok, args.prompts)
    anything = Grammar("answer: /(?s:.*)/\n", tok, stops)
    schema = Grammar.json_schema(SCHEMA if args.code else DESCRIBE, tok, stops)
    counter = RefusalCounter(schema)
    modes = {
        "free": (None, True),
        "mask-only": (anything, True),
        "schema": (counter, True),
        "schema-ar": (schema, False),
    }
    results = {m: {"tps": [], "acceptance": [], "tokens": 0, "cycles": 0, "cycle_tokens": 0} for m in modes}
    ends_at_refusal = 0
    for i, ids in enumerate(prompts):
        for rep in range(args.repeats + (1 if i == 0 else 0)):
            for mode, (grammar, spec) in modes.items():
                settings = GenerationSettings(max_tokens=args.max_tokens, stop_token_ids=stops, grammar=grammar)
                counter.refused_at.clear()
                events = list(
                    generate_speculative(runner, drafter, ids, settings)
                    if spec
                    else generate_autoregressive(runner, ids, settings)
                )
                tokens, stats = collect(iter(events))
                if i == 0 and rep == 0:
                    continue  # warm-up
                r = results[mode]
                r["tps"].append(stats.decode_tps)
                r["tokens"] += len(tokens)
                if spec:
                    r["acceptance"].append(stats.acceptance_length)
                    r["cycles"] += stats.verify_steps
                    r["cycle_tokens"] += stats.cycle_tokens
                if mode == "schema":
                    accepted = [e.accepted for e in events if e.accepted is not None]
                    ends_at_refusal += sum(
                        1 for a, ref in zip(accepted, counter.refused_at) if ref is not None and ref == a
                    )
    report = {
        "prompts": len(prompts),
        "prompt_kind": "code" if args.code else "json requests",
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "modes": {},
    }
    for mode, r in results.items():
        report["modes"][mode] = {
            "decode_tps_mean": statistics.mean(r["tps"]),
            "acceptance_length": r["cycle_tokens"] / r["cycles"] if r["cycles"] else None,
            "tokens": r["tokens"],
        }
    free = report["modes"]["free"]["decode_tps_mean"]
    for mode in modes:
        report["modes"][mode]["vs_free"] = report["modes"][mode]["decode_tps_mean"] / free
    report["schema_vs_schema_ar"] = (
        report["modes"]["schema"]["decode_tps_mean"] / report["modes"]["schema-ar"]["decode_tps_mean"]
    )
    report["schema_cycles_ending_at_a_refused_draft"] = ends_at_refusal
    report["schema_cycles"] = results["schema"]["cycles"]
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
