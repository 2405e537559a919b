"""Issue 30's client check on SmolLM2: the official openai and anthropic SDKs against a real
``dflash2-mlx serve --model smollm2 --draft-model DIR`` process.

    python benchmarks/smollm2_clients.py --draft-model DIR
    python benchmarks/smollm2_clients.py --draft-model DIR --block-size auto --keep-log serve.log

With each SDK: a chat answer, the same answer streamed (greedy, so the streamed text must equal
it), an answer constrained by a JSON schema (it must parse and validate: ``response_format``
json_schema for OpenAI, ``output_config`` format for Anthropic) and a forced call of a named tool
(its arguments must parse and validate). Every answer must report speculative cycles (the block
size is pinned, by default to the drafter's, since the break-even controller may decode a
low-acceptance pair plainly). Prints a pass/fail table; exit status 1 if a check fails.
The server starts as the tests start theirs (tests/server_helpers.py: a free loopback port,
ready when /health answers, its output in a log file).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from server_helpers import running_server  # noqa: E402
from smollm2_common import print_table  # noqa: E402

KEY = "sk-smollm2-clients"
MODEL = "smollm2"
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
WEATHER_QUESTION = [{"role": "user", "content": "What's the weather like in Paris today?"}]
JSON_QUESTION = [
    {"role": "user", "content": "Describe the weather in Paris as JSON: the city and whether it is sunny."}
]
# Finite languages (bounded strings, enums, booleans): a constrained answer ends by itself.
REPORT = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = {"get_time": ("The current time in a zone", CLOCK), "get_weather": ("The weather in a city", WEATHER)}


class Failed(AssertionError):
    pass


def check(condition: bool, message: str) -> None:
    if not condition:
        raise Failed(message)


def speculated(extra) -> str:
    spec = (extra or {}).get("speculative") or {}
    check(spec.get("verify_steps", 0) > 0, f"no speculative cycles reported ({spec or 'no speculative field'})")
    return f"{spec['verify_steps']} cycles, acceptance {spec.get('acceptance_length', 0):.2f}"


# ---- OpenAI: chat completions -----------------------------------------------------------------


def openai_checks(client, max_tokens: int) -> dict:
    import jsonschema

    greedy = dict(model=MODEL, messages=CHAT, max_tokens=max_tokens, temperature=0)
    whole = {}

    def chat():
        r = client.chat.completions.create(**greedy)
        choice = r.choices[0]
        check(bool(choice.message.content), "empty answer")
        check(choice.finish_reason in ("stop", "length"), f"finish_reason {choice.finish_reason}")
        check(r.usage.completion_tokens > 0, "no completion tokens in usage")
        whole["text"] = choice.message.content
        return f"{r.usage.completion_tokens} tokens, {speculated(r.model_extra)}: {choice.message.content[:40]!r}"

    def stream():
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **greedy))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        check(finish and finish[-1] in ("stop", "length"), f"finish reasons {finish}")
        check(len(chunks) > 2, f"{len(chunks)} chunks")
        if "text" in whole:
            check(text == whole["text"], f"streamed {text!r} != whole {whole['text']!r}")
        return f"{len(chunks)} chunks, text equals the non-streamed answer"

    def json_schema():
        r = client.chat.completions.create(
            model=MODEL,
            messages=JSON_QUESTION,
            max_tokens=100,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "report", "schema": REPORT, "strict": True},
            },
        )
        content = r.choices[0].message.content
        check(r.choices[0].finish_reason == "stop", f"finish_reason {r.choices[0].finish_reason}: {content!r}")
        jsonschema.validate(json.loads(content), REPORT)
        return f"{speculated(r.model_extra)}: {content}"

    def tool_call():
        tools = [
            {"type": "function", "function": {"name": n, "description": d, "parameters": p}}
            for n, (d, p) in TOOLS.items()
        ]
        r = client.chat.completions.create(
            model=MODEL,
            messages=WEATHER_QUESTION,
            max_tokens=100,
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False,
        )
        choice = r.choices[0]
        check(choice.finish_reason == "tool_calls", f"finish_reason {choice.finish_reason}")
        calls = choice.message.tool_calls or []
        check(len(calls) == 1 and calls[0].function.name == "get_weather", f"calls {calls}")
        jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
        return f"{speculated(r.model_extra)}: get_weather({calls[0].function.arguments})"

    return {"chat": chat, "streaming": stream, "json schema": json_schema, "forced tool call": tool_call}


# ---- Anthropic: messages ----------------------------------------------------------------------


def anthropic_checks(client, max_tokens: int) -> dict:
    import jsonschema

    # this SDK version has no temperature argument: sent in the body (the server reads it)
    greedy = dict(model=MODEL, messages=CHAT, max_tokens=max_tokens, extra_body={"temperature": 0})
    whole = {}

    def text_of(message) -> str:
        return "".join(b.text for b in message.content if b.type == "text")

    def chat():
        m = client.messages.create(**greedy)
        text = text_of(m)
        check(bool(text), "empty answer")
        check(m.stop_reason in ("end_turn", "max_tokens"), f"stop_reason {m.stop_reason}")
        check(m.usage.output_tokens > 0, "no output tokens in usage")
        whole["text"] = text
        return f"{m.usage.output_tokens} tokens, {speculated(m.model_extra)}: {text[:40]!r}"

    def stream():
        with client.messages.stream(**greedy) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        check(final.stop_reason in ("end_turn", "max_tokens"), f"stop_reason {final.stop_reason}")
        check(text == text_of(final), "the streamed deltas differ from the final message")
        if "text" in whole:
            check(text == whole["text"], f"streamed {text!r} != whole {whole['text']!r}")
        return "text equals the non-streamed answer"

    def json_schema():
        m = client.messages.create(
            model=MODEL,
            messages=JSON_QUESTION,
            max_tokens=100,
            output_config={"format": {"type": "json_schema", "schema": REPORT}},
        )
        text = text_of(m)
        check(m.stop_reason == "end_turn", f"stop_reason {m.stop_reason}: {text!r}")
        jsonschema.validate(json.loads(text), REPORT)
        return f"{speculated(m.model_extra)}: {text}"

    def tool_call():
        tools = [{"name": n, "description": d, "input_schema": p} for n, (d, p) in TOOLS.items()]
        m = client.messages.create(
            model=MODEL,
            messages=WEATHER_QUESTION,
            max_tokens=100,
            tools=tools,
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        )
        uses = [b for b in m.content if b.type == "tool_use"]
        check(m.stop_reason == "tool_use", f"stop_reason {m.stop_reason}")
        check(len(uses) == 1 and uses[0].name == "get_weather", f"tool uses {uses}")
        jsonschema.validate(uses[0].input, WEATHER)
        return f"{speculated(m.model_extra)}: get_weather({json.dumps(uses[0].input)})"

    return {"chat": chat, "streaming": stream, "json schema": json_schema, "forced tool call": tool_call}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-model", required=True, help="the SmolLM2 drafter directory (config.json + weights)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--block-size", default=None, help="serve --block-size (default: the drafter's; or auto)")
    parser.add_argument("--max-tokens", type=int, default=32, help="for the chat and streaming answers")
    parser.add_argument("--keep-log", type=Path, help="copy the server's log here")
    args = parser.parse_args()

    import anthropic
    import openai

    block = args.block_size or str(
        json.loads((Path(args.draft_model) / "config.json").read_text())["dflash_config"]["block_size"]
    )
    serve_args = ["--model", args.model, "--draft-model", args.draft_model, "--api-key", KEY,
                  "--served-model-name", MODEL, "--block-size", block, "--request-timeout", "600"]  # fmt: skip
    t_start = time.perf_counter()
    rows, failures = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        print(f"serve {' '.join(serve_args)}", flush=True)
        try:
            with running_server(serve_args, log, wait=900) as server:
                ready = time.perf_counter() - t_start
                print(f"ready in {ready:.0f} s at {server.base}", flush=True)
                clients = {
                    "openai": openai_checks(
                        openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=600),
                        args.max_tokens,
                    ),
                    "anthropic": anthropic_checks(
                        anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0, timeout=600),
                        args.max_tokens,
                    ),
                }
                for sdk, checks in clients.items():
                    for name, run in checks.items():
                        t0 = time.perf_counter()
                        try:
                            detail, result = run(), "pass"
                        except Exception as e:  # a failed check, or the SDK's error: either is a fail
                            detail, result = f"{type(e).__name__}: {e}"[:300], "FAIL"
                            failures += 1
                            if not isinstance(e, (Failed, AssertionError)):
                                traceback.print_exc()
                        seconds = time.perf_counter() - t0
                        rows.append([sdk, name, result, f"{seconds:.1f}", " ".join(str(detail).split())[:110]])
                        print(f"{sdk} {name}: {result} ({seconds:.1f} s)", file=sys.stderr, flush=True)
            text = log.read_text(errors="replace")
        except RuntimeError as e:  # the server did not start
            print(f"FAIL: {e}")
            return 1
        finally:
            if args.keep_log and log.exists():
                args.keep_log.write_text(log.read_text(errors="replace"))
    if "Traceback" in text:
        rows.append(["server", "log", "FAIL", "-", "a traceback in the server's log"])
        failures += 1
    print()
    print_table(["sdk", "check", "result", "s", "detail"], rows)
    print(f"\n{len(rows) - failures} of {len(rows)} checks passed ({time.perf_counter() - t_start:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
