"""The words written about a built pair, all made from its MANIFEST.json.

The two READMEs shipped with the assets, the markdown model card of docs/embedded-pair.md
(``--card``) and the one-line summary the build logs at the end.
"""

from __future__ import annotations

from dflash2_mlx.training.demo_pair.plan import CHAT_DEFAULTS, DRAFTER_DIR, TARGET_DIR

__all__ = [
    "drafter_readme",
    "model_card",
    "summary",
    "target_readme",
]


def target_readme(m: dict) -> str:
    t = m["target"]
    cfg = t["model"]
    return f"""# tiny-code-demo-target

A **tiny code-completion demo model** shipped inside `dflash2-mlx` so that every command works in
seconds with no download. It is NOT a useful language model: it continues Python code in the
style of the standard library, often wrongly, and it cannot follow instructions.

- Architecture: mlx-lm `qwen3_5` (Qwen3.5 hybrid): {cfg["num_layers"]} layers, hidden {cfg["hidden_size"]},
  Gated DeltaNet layers and one gated attention layer in every {cfg["full_attention_interval"]}, vocabulary
  {t["config"]["text_config"]["vocab_size"]} (byte-level BPE), untied LM head, float32,
  {t["parameters"] / 1e6:.2f} M parameters ({t["float32_bytes"] / 1e6:.1f} MB).
- Training data: the Python {m["python_version"]} standard library's own source (tests excluded),
  {m["corpus"]["num_files"] - m["corpus"]["num_held_out"]} files, plus ChatML examples made from its functions;
  {t["training_tokens"] / 1e6:.2f} M training tokens ({t["epochs"]} epochs).
- Held-out perplexity: {t["heldout_perplexity"]:.2f} per token on {m["corpus"]["num_held_out"]} held-out stdlib files.
- Repetition rate of its greedy outputs (repeated 4-grams): {_pct(m["evaluation"].get("repetition_rate_4gram"))}.
- Chat: ChatML (`<|im_start|>role ... <|im_end|>`); it answers with a Python function and is
  trained to end its turn with `<|im_end|>` (not every answer does, below). Special tokens: `<|endoftext|>` (eos), `<|im_start|>`, `<|im_end|>`,
  `<|mask|>` (the drafter's mask token).
- Defaults (`generation_config.json`, used by `chat` and the server): {_defaults_line(m)}.

Built by `{m["command"]}` (seed {m["seed"]}); the record of the
build (corpus sha256s, seeds, step counts, measured results) is `../MANIFEST.json`, and
`docs/embedded-pair.md` explains how to rebuild and verify it.
"""


def drafter_readme(m: dict) -> str:
    d = m.get("drafter") or {}
    e = m["evaluation"]
    tr = d.get("training", {})
    return f"""# tiny-code-demo-drafter

The **DFlash 2 drafter for the tiny code-completion demo target** (`../tiny-code-demo-target`),
shipped inside `dflash2-mlx` so that speculative decoding works in seconds with no download. It
only makes sense with that target; it is a demonstration of the method, not a useful model.

- DFlash 2 block drafter: {tr.get("layers")} layers, block size {tr.get("block_size")}, two-tap dynamic
  convolutions and the candidate selector, taps target layers {tr.get("target_layer_ids")}, mask token
  `<|mask|>`, float32. It shares the target's embedding and LM head (not stored here).
- Trained with the project's own trainer on the target's own continuations of stdlib prefixes
  ({_data_line(d.get("data", {}))}, {tr.get("steps")} steps{_soft_line(tr)}).
- What each DFlash 2 part buys at this scale: `docs/embedded-pair.md`, "Ablation".
- Acceptance length on {e["prompts"]} held-out prompts, block size {e["block_size"]}:
  {_num(e.get("acceptance_length_t0"))} at temperature 0 (output identical to plain decoding:
  {e.get("identical_to_autoregressive")}), {_num(e.get("acceptance_length_t07"))} at temperature
  {e.get("sample_temperature")}; a prompt-lookup n-gram drafter gets {_num(e.get("prompt_lookup_acceptance_length"))}.

Built by `{m["command"]}` (seed {m["seed"]}); see `../MANIFEST.json`.
"""


def _data_line(data: dict) -> str:
    sampled = data.get("sampled_sequences") or 0
    total = data.get("sequences")
    if not sampled:
        return f"{total} greedy sequences"
    return f"{total} sequences: {total - sampled} greedy, {sampled} sampled at t={data.get('sample_temperature')}"


def _soft_line(training: dict) -> str:
    weight = training.get("soft_target_weight")
    return f", soft targets: the target's full distributions at weight {weight}" if weight else ""


def _defaults_line(m: dict) -> str:
    d = m["evaluation"].get("defaults")
    if not d:
        return ", ".join(f"{k} {v}" for k, v in CHAT_DEFAULTS.items())
    return (
        f"temperature {d['temperature']}, top-p {d['top_p']}, {d['max_tokens']} tokens per answer, "
        f"since greedily it loops; at these defaults {_pct(d['chat']['repetition_rate_4gram'])} of the "
        f"4-grams of its chat answers repeat and {_pct(d['chat']['ended_share'])} of them end their turn"
    )


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _num(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def summary(m: dict) -> str:
    e, t = m["evaluation"], m["target"]
    parts = [
        f"target {t['parameters'] / 1e6:.2f}M params, held-out ppl {t['heldout_perplexity']:.2f}",
        (
            f"repetition {_pct(e.get('repetition_rate_4gram'))} "
            f"(reference text {_pct(e.get('reference_repetition_rate_4gram'))})"
        ),
        f"prompt-lookup acceptance {_num(e.get('prompt_lookup_acceptance_length'))}",
    ]
    if "acceptance_length_t0" in e:
        parts.append(
            f"DFlash 2 acceptance {_num(e['acceptance_length_t0'])} (t=0, identical "
            f"{e['identical_to_autoregressive']}), {_num(e['acceptance_length_t07'])} "
            f"(t={e['sample_temperature']})"
        )
    parts.append(f"assets {m['total_bytes'] / 1e6:.1f} MB")
    return "; ".join(parts)


def model_card(m: dict) -> str:
    """A markdown model card from a MANIFEST.json (for docs/embedded-pair.md)."""
    t, e, d = m["target"], m["evaluation"], m.get("drafter") or {}
    files = m.get("files_bytes", {})
    tb = files.get(f"{TARGET_DIR}/model.safetensors", 0)
    db = files.get(f"{DRAFTER_DIR}/model.safetensors", 0)
    rows = [
        (
            "build",
            f"`{m['command']}` (seed {m['seed']}), Python {m['python_version']}, mlx {m['environment']['mlx']}, "
            f"mlx-lm {m['environment']['mlx_lm']}, tokenizers {m['environment']['tokenizers']}",
        ),
        (
            "corpus",
            f"{m['corpus']['num_files']} stdlib files ({m['corpus']['num_held_out']} held out), "
            f"{m['corpus']['bytes'] / 1e6:.2f} MB; corpus list sha256 `{m['corpus']['list_sha256'][:16]}...`",
        ),
        ("tokenizer", f"byte-level BPE, vocabulary {m['tokenizer']['vocab_size']}"),
        (
            "target",
            f"qwen3_5 hybrid, {t['model']['num_layers']} layers (attention every "
            f"{t['model']['full_attention_interval']}), hidden {t['model']['hidden_size']}, "
            f"{t['parameters'] / 1e6:.2f} M parameters, {tb / 1e6:.1f} MB float32",
        ),
        (
            "target training",
            f"{t['training']['steps']} steps x {t['training']['batch_size']} x "
            f"{t['training']['seq_len']} tokens = {t['training_tokens'] / 1e6:.2f} M tokens "
            f"({t['epochs']} epochs), {t['train_seconds'] / 60:.1f} min; final train loss "
            f"{_num(t.get('final_train_loss'))}",
        ),
        (
            "held-out perplexity",
            f"{t['heldout_perplexity']:.2f} (loss {t['heldout_loss']:.3f} nats/token over "
            f"{t['heldout_tokens_evaluated']} tokens)",
        ),
        (
            "repetition rate (greedy, 4-grams)",
            f"{_pct(e.get('repetition_rate_4gram'))} (the real held-out "
            f"continuations: {_pct(e.get('reference_repetition_rate_4gram'))})",
        ),
    ]
    if d:
        tr = d["training"]
        rows += [
            (
                "drafter",
                f"DFlash 2, {tr['layers']} layers, block {tr['block_size']}, taps {tr['target_layer_ids']}, "
                f"{db / 1e6:.1f} MB float32",
            ),
            (
                "drafter training",
                f"{tr['steps']} steps on {d['data']['sequences']} sequences "
                f"({d['data']['prefix_len']} corpus + {d['data']['continuation_len']} "
                f"target-generated tokens); generation {d['generation_seconds'] / 60:.1f} min, "
                f"training {d['train_seconds'] / 60:.1f} min",
            ),
            (
                "acceptance length, t = 0",
                f"{_num(e.get('acceptance_length_t0'))} (identical to plain decoding: "
                f"{e.get('identical_to_autoregressive')})",
            ),
            (f"acceptance length, t = {e.get('sample_temperature')}", _num(e.get("acceptance_length_t07"))),
        ]
    dflt = e.get("defaults")
    if dflt:
        setting = f"t = {dflt['temperature']}, top-p {dflt['top_p']}, max_tokens {dflt['max_tokens']}"
        rows += [
            (
                f"at the chat defaults ({setting}): {dflt['chat']['prompts']} chat prompts",
                f"repetition {_pct(dflt['chat']['repetition_rate_4gram'])}, answers that end their turn "
                f"{_pct(dflt['chat']['ended_share'])}",
            ),
            (
                f"at the chat defaults: {dflt['code']['prompts']} code prompts",
                f"repetition {_pct(dflt['code']['repetition_rate_4gram'])}, ended with an end token "
                f"{_pct(dflt['code']['ended_share'])}",
            ),
        ]
    rows += [
        ("prompt-lookup n-gram drafter, t = 0", _num(e.get("prompt_lookup_acceptance_length"))),
        (
            "evaluation",
            (f"{e['prompts']} held-out prompts, {e['max_tokens']} new tokens each, block size {e['block_size']}"),
        ),
        (
            "build time",
            f"{m['timings']['total_seconds'] / 60:.1f} min on {m['environment']['cpu_count']} cores "
            f"({m['environment']['machine']})",
        ),
        ("assets", f"{m['total_bytes'] / 1e6:.1f} MB"),
    ]
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"
