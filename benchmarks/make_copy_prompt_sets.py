"""Build the prompt sets that measure copy drafting (issue 39), offline, from this Python's
standard library, its language reference (``pydoc_data.topics``) and fixed templates.

    python benchmarks/make_copy_prompt_sets.py [--out benchmarks/prompts]

Writes four JSON-lines files of ``{"messages": [...]}`` (``dflash2-mlx bench --prompts``):

- ``edit.jsonl``: a standard-library function pasted, asked back changed (type hints, a renamed
  variable, a docstring, logging added): the answer repeats most of the prompt;
- ``long.jsonl``: a section of the language reference (about 1000-3000 tokens) with a question
  or a summary request;
- ``agent.jsonl``: one agent session, request after request: tool definitions in the system
  message, earlier turns' tool calls and results in the history, and later turns that ask for the
  same calls again (a shared index of earlier answers at work: ``bench`` runs a file's prompts as
  one client);
- ``chat.jsonl``: the 30 prompts held out from the SmolLM2 drafter's training.

The texts depend on the Python version's sources: the committed files were made with the version
named in ``benchmarks/prompts/README.md``; rerun to regenerate, not to reproduce byte for byte.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import textwrap
from pathlib import Path

EDIT_FUNCTIONS = [
    ("textwrap", "dedent"),
    ("shlex", "quote"),
    ("fnmatch", "translate"),
    ("textwrap", "indent"),
    ("glob", "has_magic"),
    ("colorsys", "rgb_to_hsv"),
    ("colorsys", "hls_to_rgb"),
    ("statistics", "mode"),
    ("heapq", "nsmallest"),
    ("statistics", "median_grouped"),
    ("string", "capwords"),
    ("calendar", "monthrange"),
]
EDITS = [
    "Add type hints to every parameter and the return value. Return the whole function, nothing else.",
    "Rename the function to `{name}_v2` and keep everything else as it is. Return the whole function.",
    "Add a short comment above each `return` statement. Return the whole function with the comments.",
    "Replace the docstring with a one-line summary and return the whole function.",
]
LONG_TOPICS = [
    "async",
    "objects",
    "identifiers",
    "naming",
    "function",
    "calls",
    "try",
    "import",
    "execmodel",
    "comparisons",
    "assignment",
]
LONG_ASKS = [
    "Summarize the text above in five bullet points.",
    "Using only the text above, explain the main rule it describes, with one short example.",
    "Quote the two most important sentences of the text above and say why they matter.",
]
TOOLS = [
    {"name": "read_file", "description": "Read a file of the project", "parameters": {"path": "string"}},
    {"name": "run_tests", "description": "Run one test file", "parameters": {"path": "string", "verbose": "bool"}},
    {"name": "search", "description": "Search the project for a string", "parameters": {"query": "string"}},
]
AGENT_SYSTEM = (
    "You are a coding agent. You can call these tools:\n"
    + "\n".join(json.dumps(tool) for tool in TOOLS)
    + '\nTo call a tool, answer with one JSON object on one line: {"name": ..., "arguments": {...}}.'
)


def function_source(module: str, name: str) -> str:
    mod = __import__(module)
    return textwrap.dedent(inspect.getsource(getattr(mod, name)))


def edit_prompts() -> list[dict]:
    out = []
    for i, (module, name) in enumerate(EDIT_FUNCTIONS):
        ask = EDITS[i % len(EDITS)].format(name=name)
        code = function_source(module, name)
        out.append({"messages": [{"role": "user", "content": f"```python\n{code}```\n\n{ask}"}]})
    return out


def long_prompts() -> list[dict]:
    from pydoc_data.topics import topics

    out = []
    for i, topic in enumerate(LONG_TOPICS):
        text = topics[topic].strip()
        text = text[:12000]  # about 3000 tokens at most
        out.append({"messages": [{"role": "user", "content": f"{text}\n\n{LONG_ASKS[i % len(LONG_ASKS)]}"}]})
    return out


def _call(name: str, **arguments) -> str:
    return json.dumps({"name": name, "arguments": arguments})


def agent_prompts() -> list[dict]:
    """One session: each request holds the history before it (fixed assistant turns standing for
    the agent's earlier calls), then a user turn that asks for the next step."""
    files = [("textwrap.py", "textwrap", "dedent"), ("shlex.py", "shlex", "quote"), ("glob.py", "glob", "has_magic")]
    history = [{"role": "system", "content": AGENT_SYSTEM}]
    out = []
    for path, module, name in files:
        steps = [
            (f"Open {path} and show me `{name}`.", _call("read_file", path=path), function_source(module, name)),
            (
                f"Run the tests for {path}.",
                _call("run_tests", path=f"tests/test_{path}", verbose=False),
                "4 passed in 0.12s",
            ),
            (f"Find where `{name}` is used.", _call("search", query=name), f"{path}:1: def {name}("),
            (
                f"Run the tests for {path} again, verbosely.",
                _call("run_tests", path=f"tests/test_{path}", verbose=True),
                f"tests/test_{path}::test_{name} PASSED\n4 passed in 0.13s",
            ),
        ]
        for ask, call, result in steps:
            out.append({"messages": history + [{"role": "user", "content": ask}]})
            history = history + [
                {"role": "user", "content": ask},
                {"role": "assistant", "content": call},
                {"role": "user", "content": f"Tool result:\n{result}"},
            ]
    return out


def chat_prompts() -> list[dict]:
    src = Path(__file__).parents[1] / "dflash2_mlx/assets/smollm2-drafter/heldout_prompts.jsonl"
    return [json.loads(line) for line in src.read_text().splitlines() if line]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "prompts")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sets = {"edit": edit_prompts(), "long": long_prompts(), "agent": agent_prompts(), "chat": chat_prompts()}
    for name, lines in sets.items():
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        print(f"{name}: {len(lines)} prompts", file=sys.stderr)
    (args.out / "README.md").write_text(
        "# Prompt sets for copy drafting\n\n"
        f"Made by `python benchmarks/make_copy_prompt_sets.py` with Python {sys.version.split()[0]} "
        "(its standard library sources and `pydoc_data.topics`): see that script's docstring.\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
