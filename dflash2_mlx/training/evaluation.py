"""How good the built pair is: held-out prompts at temperature 0 and 0.7, and its chat defaults.

``evaluate`` measures acceptance (with the identical-to-plain-decoding check), the prompt-lookup
baseline and repetition on held-out prompts; ``evaluate_defaults`` measures the pair as a user
first meets it, at its generation_config.json defaults, on chat and code prompts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

from dflash2_mlx.training.build_common import Log
from dflash2_mlx.training.metrics import prompt_lookup_acceptance, repetition_rate

__all__ = [
    "CHAT_PROMPTS",
    "evaluate",
    "evaluate_defaults",
]


def evaluate(plan, target_dir: Path, drafter_dir: Optional[Path], prompts: list[dict], log: Log) -> dict:
    """The pair on held-out ``prompts``; ``plan`` is a build's plan (the demo pair's ``BuildPlan``
    or SmolLM2's ``SmolPlan``): its eval_max_tokens, drafter_block_size, sample_temperature, seed."""
    from dflash2_mlx.decoding.autoregressive import generate_autoregressive
    from dflash2_mlx.decoding.output import collect
    from dflash2_mlx.decoding.sampling import SamplingSettings
    from dflash2_mlx.decoding.speculative import generate_speculative
    from dflash2_mlx.decoding.types import GenerationSettings
    from dflash2_mlx.models.loading import load_drafter, load_target

    target = load_target(str(target_dir))
    drafter = load_drafter(str(drafter_dir)) if drafter_dir is not None else None
    tokenizer = target.tokenizer
    stops = sorted(tokenizer.eos_token_ids)

    greedy = GenerationSettings(
        max_tokens=plan.eval_max_tokens, block_size=plan.drafter_block_size, stop_token_ids=stops
    )
    sampled = dataclasses.replace(greedy, sampling=SamplingSettings(temperature=plan.sample_temperature))
    rows = []
    totals = {"rep": [0, 0], "ref_rep": [0, 0], "g": [0, 0], "s": [0, 0], "pl": [0, 0]}
    identical = True
    ar_time = spec_time = 0.0
    ar_tokens = spec_tokens = 0
    for i, p in enumerate(prompts):
        ids = tokenizer.encode(p["prompt"], add_special_tokens=False)
        ar, ar_stats = collect(generate_autoregressive(target.runner, ids, greedy, tokenizer))
        row = {"source": p["source"], "prompt_tokens": len(ids), "generated": len(ar)}
        rep = repetition_rate(ar)
        ref = repetition_rate(p.get("reference_ids", [])[: len(ar)])
        row["repetition_4gram"] = rep[0] / rep[1] if rep[1] else 0.0
        for key, val in (("rep", rep), ("ref_rep", ref)):
            totals[key][0] += val[0]
            totals[key][1] += val[1]
        emitted, cycles = prompt_lookup_acceptance(ids, ar, plan.drafter_block_size)
        totals["pl"][0] += emitted
        totals["pl"][1] += cycles
        row["prompt_lookup_acceptance"] = emitted / cycles if cycles else 1.0
        ar_time += ar_stats.decode_seconds
        ar_tokens += max(len(ar) - 1, 0)
        if drafter is not None:
            spec, st = collect(generate_speculative(target.runner, drafter, ids, greedy, tokenizer))
            same = spec == ar
            if not same:
                first = next((j for j, (a, b) in enumerate(zip(spec, ar)) if a != b), min(len(spec), len(ar)))
                row["first_divergence"] = first
            identical &= same
            row.update(identical=same, acceptance_length=st.acceptance_length, verify_steps=st.verify_steps)
            totals["g"][0] += st.cycle_tokens
            totals["g"][1] += st.verify_steps
            spec_time += st.decode_seconds
            spec_tokens += max(st.generation_tokens - 1, 0)
            s_settings = dataclasses.replace(sampled, seed=plan.seed + i)
            _, ss = collect(generate_speculative(target.runner, drafter, ids, s_settings, tokenizer))
            row["acceptance_length_t07"] = ss.acceptance_length
            totals["s"][0] += ss.cycle_tokens
            totals["s"][1] += ss.verify_steps
        rows.append(row)
        if drafter is not None:
            log(
                f"eval {i + 1}/{len(prompts)} {p['source']}: acceptance {row['acceptance_length']:.2f} (t=0) "
                f"{row['acceptance_length_t07']:.2f} (t={plan.sample_temperature}), prompt lookup "
                f"{row['prompt_lookup_acceptance']:.2f}, identical {row['identical']}"
            )

    def ratio(pair):
        return pair[0] / pair[1] if pair[1] else None

    result = {
        "prompts": len(prompts),
        "max_tokens": plan.eval_max_tokens,
        "block_size": plan.drafter_block_size,
        "repetition_rate_4gram": ratio(totals["rep"]),
        "reference_repetition_rate_4gram": ratio(totals["ref_rep"]),
        "prompt_lookup_acceptance_length": ratio(totals["pl"]),
        "ar_decode_tps": ar_tokens / ar_time if ar_time else None,
        "per_prompt": rows,
    }
    if drafter is not None:
        result.update(
            {
                "acceptance_length_t0": ratio(totals["g"]),
                "acceptance_length_t07": ratio(totals["s"]),
                "sample_temperature": plan.sample_temperature,
                "identical_to_autoregressive": identical,
                "spec_decode_tps": spec_tokens / spec_time if spec_time else None,
            }
        )
    return result


# Everyday chat requests a newcomer types first (the chat-defaults evaluation below).
CHAT_PROMPTS = (
    "Write a function that returns the maximum of a list.",
    "Write a function that reverses a string.",
    "Write a function that checks whether a number is prime.",
    "How do I read a file line by line?",
    "Write a class for a stack with push and pop methods.",
)


def evaluate_defaults(
    target_dir: Path, drafter_dir: Optional[Path], code_prompts: list[str], seed: int = 0, log: Optional[Log] = None
) -> dict:
    """The pair as a user first meets it, at its generation_config.json defaults: the chat
    prompts (chat template, generation prompt) and the raw code prompts, one seeded sample each.
    Per set: the 4-gram repetition rate (repeated / all generated 4-grams, pooled) and the share
    of answers that ended (emitted an end token) within ``max_new_tokens``."""
    from dflash2_mlx.decoding.autoregressive import generate_autoregressive
    from dflash2_mlx.decoding.output import collect
    from dflash2_mlx.decoding.sampling import SamplingSettings
    from dflash2_mlx.decoding.speculative import generate_speculative
    from dflash2_mlx.decoding.types import GenerationSettings
    from dflash2_mlx.models.loading import load_drafter, load_target

    cfg = json.loads((Path(target_dir) / "generation_config.json").read_text())
    target = load_target(str(target_dir))
    drafter = load_drafter(str(drafter_dir)) if drafter_dir is not None else None
    tok = target.tokenizer
    sampling = SamplingSettings(
        temperature=float(cfg.get("temperature", 0.0)) if cfg.get("do_sample", True) else 0.0,
        top_p=float(cfg.get("top_p", 1.0)),
    )
    max_tokens = int(cfg.get("max_new_tokens", 256))
    stops = sorted(tok.eos_token_ids)
    sets = {
        "chat": [
            tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
            for p in CHAT_PROMPTS
        ],
        "code": [tok.encode(p, add_special_tokens=False) for p in code_prompts],
    }
    result = {"temperature": sampling.temperature, "top_p": sampling.top_p, "max_tokens": max_tokens, "seed": seed}
    for name, prompts in sets.items():
        repeated = total = ended = 0
        answers = []
        for i, ids in enumerate(prompts):
            settings = GenerationSettings(max_tokens=max_tokens, sampling=sampling, seed=seed + i, stop_token_ids=stops)
            if drafter is not None:
                out, _ = collect(generate_speculative(target.runner, drafter, list(ids), settings, tok))
            else:
                out, _ = collect(generate_autoregressive(target.runner, list(ids), settings, tok))
            r, t = repetition_rate(out)
            repeated, total = repeated + r, total + t
            stopped = bool(out) and out[-1] in stops
            ended += stopped
            if name == "chat":
                answers.append(
                    {
                        "prompt": CHAT_PROMPTS[i],
                        "tokens": len(out),
                        "ended": stopped,
                        "repetition_4gram": r / t if t else 0.0,
                        "text": tok.decode(out),
                    }
                )
        result[name] = {
            "prompts": len(prompts),
            "repetition_rate_4gram": repeated / total if total else 0.0,
            "ended_share": ended / len(prompts) if prompts else 0.0,
        }
        if answers:
            result[name]["answers"] = answers
        if log:
            log(
                f"defaults ({name}): repetition {100 * result[name]['repetition_rate_4gram']:.1f}%, "
                f"ended {ended}/{len(prompts)}"
            )
    return result
