"""What the SmolLM2 checks of issue 30 share: the pair in float32 on the CPU, the held-out prompts,
and a plain text table. Imported by the checks from their own folder (the script's directory is on sys.path).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import dflash2_mlx  # noqa: F401  (loads the BLAS before mlx.core)

# isort: split
import mlx.core as mx

from dflash2_mlx.training.smollm2.build import COMMITTED_PROMPTS


def load_cpu_pair(model: str, draft_model: str):
    """(Target, Drafter) on MLX's CPU device, where a GGUF target's weights are float32 (checked):
    the setting in which greedy speculative output must equal plain decoding token for token."""
    from dflash2_mlx import load_pair
    from dflash2_mlx.models.loading import freeze_loaded_objects

    mx.set_default_device(mx.cpu)
    target, drafter = load_pair(model, draft_model)
    dtypes = {str(v.dtype) for _, v in _leaves(target.runner.model.parameters())}
    dtypes |= {str(v.dtype) for _, v in _leaves(drafter.parameters())}
    if dtypes != {"mlx.core.float32"}:
        raise SystemExit(f"the pair is not float32 on the CPU (weights: {sorted(dtypes)})")
    freeze_loaded_objects()
    return target, drafter


def _leaves(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)


def heldout_prompts(path: Optional[Path] = None, limit: Optional[int] = None) -> list[dict]:
    """The held-out prompts as ``{"kind", "messages"}``: the committed prompt set's held-out split
    (30 prompts), or a ``bench --prompts`` file (the build's ``OUT/heldout_prompts.jsonl``: its
    lines carry no kind, so a line is given the kind of the committed prompt with its messages)."""
    from dflash2_mlx.training.smollm2.prompts import read_prompt_set

    committed = read_prompt_set(COMMITTED_PROMPTS, "heldout")
    if path is None:
        rows = [{"kind": r["kind"], "messages": r["messages"]} for r in committed]
    else:
        from dflash2_mlx.diagnostics.bench import read_prompts

        kinds = {_key(r["messages"]): r["kind"] for r in read_prompt_set(COMMITTED_PROMPTS)}
        rows = []
        for line in read_prompts(path):
            if "messages" not in line:
                raise SystemExit(f"{path}: the checks need chat prompts ({{'messages': [...]}} lines)")
            rows.append({"kind": line.get("kind") or kinds.get(_key(line["messages"]), "-"), **line})
    return rows[:limit] if limit else rows


def _key(messages: Sequence[dict]) -> tuple:
    return tuple((m["role"], m["content"]) for m in messages)


def encode(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of a chat prompt: the model's chat template with the generation prompt, as
    ``dflash2-mlx bench --prompts`` renders a ``{"messages": [...]}`` line."""
    from dflash2_mlx.cli.common import encode_messages

    return encode_messages(tokenizer, messages)


def print_table(headers: Sequence[str], rows: Sequence[Sequence]) -> None:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for j, row in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))
