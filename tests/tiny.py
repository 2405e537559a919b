"""Tiny targets and drafters for tests, built in float32 and saved in the real on-disk layouts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from dflash2_mlx.models.drafter import Drafter
from dflash2_mlx.models.drafter_config import DFLASH1, DFLASH2, DrafterConfig
from dflash2_mlx.models.target import TargetRunner

VOCAB = 300  # 256 byte tokens + specials; small enough for exact distribution tests
MASK_ID = 299
EOS_ID = 298


def hybrid_config(hidden=64, layers=4, vocab=VOCAB, max_context=4096) -> dict:
    """A Qwen3.5-architecture text config: Gated DeltaNet layers with a gated attention every 4th."""
    return {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_5_text",
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "full_attention_interval": 4,
            "vocab_size": vocab,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": max_context,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            "tie_word_embeddings": False,
            "eos_token_id": EOS_ID,
        },
        "eos_token_id": EOS_ID,
    }


def plain_config(hidden=64, layers=4, vocab=VOCAB, max_context=4096) -> dict:
    return {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": max_context,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": EOS_ID,
    }


def build_target(config: dict, seed: int = 0, scale: float = 1.0) -> nn.Module:
    """An mlx-lm model with random float32 weights (``scale`` sharpens the logits)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    if scale != 1.0:
        model.update(tree_map(lambda p: p * scale if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


def drafter_config(
    target_config: dict,
    version: int = 2,
    layers: int = 2,
    block_size: int = 16,
    taps: Optional[list[int]] = None,
    sliding_window: Optional[int] = None,
    mask_token_id: int = MASK_ID,
    top_k: int = 4,
    **overrides,
) -> DrafterConfig:
    text = target_config.get("text_config", target_config)
    n = text["num_hidden_layers"]
    # an embedding lookup past the vocabulary reads whatever memory follows (NaN some runs):
    # loading refuses such a pair, and so must every drafter a test builds by hand
    if not 0 <= mask_token_id < text["vocab_size"]:
        raise ValueError(f"mask token {mask_token_id} is outside the target's vocabulary ({text['vocab_size']})")
    cfg = {
        "architectures": [DFLASH2 if version == 2 else DFLASH1],
        "model_type": "qwen3",
        "hidden_size": text["hidden_size"],
        "intermediate_size": 2 * text["hidden_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": text["vocab_size"],
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "num_target_layers": n,
        "dflash_config": {
            "block_size": block_size,
            "mask_token_id": mask_token_id,
            "target_layer_ids": taps if taps is not None else [0, n - 2],
        },
        "dtype": "float32",
    }
    if version == 2:
        cfg["dflash_config"].update(conv_group_size=16, conv_kernel_size=2, selector_rank=8, selector_top_k=top_k)
    if sliding_window:
        cfg["layer_types"] = ["sliding_attention"] * layers
        cfg["sliding_window"] = sliding_window
    else:
        cfg["is_causal"] = False
    cfg.update(overrides)
    return DrafterConfig.from_dict(cfg)


def build_drafter(config: DrafterConfig, seed: int = 1) -> Drafter:
    """Random drafter weights, every tensor set explicitly (convs and codebooks nonzero)."""
    mx.random.seed(seed)
    drafter = Drafter(config)
    params = tree_flatten(drafter.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    new = [
        (name, 0.2 * mx.random.normal(p.shape, key=k)) if ("base_kernel" in name or "codebook" in name) else (name, p)
        for (name, p), k in zip(params, keys)
    ]
    drafter.load_weights(new)
    mx.eval(drafter.parameters())
    return drafter


def save_target(model: nn.Module, config: dict, path: Path, hf_layout: bool = False) -> Path:
    """Write an mlx-lm-loadable directory (``hf_layout``: names as the original HF checkpoint)."""
    path.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    if hf_layout:
        weights = _to_hf_names(weights, config)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path)
    return path


def _to_hf_names(weights: dict, config: dict) -> dict:
    """mlx-lm names -> original Qwen3.5 checkpoint names, with the MTP head and a vision tensor."""
    out = {}
    for name, w in weights.items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name[len("language_model.model.") :]
        elif name.startswith("language_model."):
            name = name[len("language_model.") :]
        if "conv1d.weight" in name:
            w = w.moveaxis(2, 1)  # HF stores [C, 1, K]
        if name.endswith(("layernorm.weight", "norm.weight")) and "linear_attn.norm" not in name:
            w = w - 1.0  # HF Qwen3.5 RMSNorm multiplies by (1 + w)
        out[name] = w
    hidden = config["text_config"]["hidden_size"]
    out["mtp.fc.weight"] = mx.zeros((hidden, 2 * hidden))
    out["mtp.norm.weight"] = mx.zeros((hidden,))
    out["model.visual.patch_embed.proj.weight"] = mx.zeros((4, 3))
    return out


def save_drafter(drafter: Drafter, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(drafter.parameters())))
    (path / "config.json").write_text(json.dumps(drafter.config.to_dict(), indent=2))
    return path


def write_tokenizer(path: Path) -> None:
    """A byte-level tokenizer over the 300-token vocabulary, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for i in range(len(vocab), VOCAB - 4):
        vocab[f"<unused{i}>"] = i
    specials = {"<|im_start|>": 296, "<|im_end|>": 297, "<|endoftext|>": EOS_ID, "<|mask|>": MASK_ID}
    vocab.update(specials)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "chat_template": template,
            }
        )
    )


def write_letters_tokenizer(path: Path, letters: str = "abcd") -> list[int]:
    """A byte-level tokenizer whose vocabulary is ``letters`` (ids 0..n-1), then <eos>, <mask>;
    returns [eos id, mask id]. Small enough for exact distribution tests with a grammar."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(letters)}
    eos, mask = len(letters), len(letters) + 1
    vocab.update({"<eos>": eos, "<mask>": mask})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>", "<mask>"])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>"})
    )
    return [eos, mask]


def load_tokenizer(path: Path):
    """mlx-lm's TokenizerWrapper for a directory written by one of the functions above."""
    from mlx_lm.tokenizer_utils import load

    return load(path)


def corrupted_for(start: int, accepts: list[int], block: int) -> set[int]:
    """The positions an ``OracleDrafter`` must corrupt so that its cycles, the first drafting after
    committed position ``start``, accept exactly ``accepts`` drafts in turn (corrupting s+1+a makes
    the cycle starting at s accept a; a full block, a = block - 1, corrupts nothing)."""
    corrupt, pos = set(), start
    for a in accepts:
        if a < block - 1:
            corrupt.add(pos + 1 + a)
        pos += a + 1
    return corrupt


class OracleDrafter(Drafter):
    """A real drafter whose proposals are replaced by a known continuation, corrupted on purpose.

    Its forward pass runs for real (so the context cache and block machinery are exercised);
    only the logits are swapped for ones whose argmax is ``continuation[position]``, except at
    positions in ``corrupt`` where the second choice wins. That makes every accepted count
    0..B-1 (and the full-block bonus) happen on demand.
    """

    def __init__(self, config: DrafterConfig, continuation: list[int], corrupt: set[int]):
        super().__init__(config)
        self.continuation, self.corrupt = continuation, corrupt
        self._block_pos = None

    def __call__(self, block_embeds, features, cache):
        hidden = super().__call__(block_embeds, features, cache)
        # [1] int32: the decode loop drafts a block before it knows the previous one's accepted
        # count, so the block's position may not be computed yet; the logits are built from it
        self._block_pos = cache.next_position()[0]
        return hidden

    def logits(self, hidden, lm_head):
        real = super().logits(hidden, lm_head)
        vocab, rows = real.shape[-1], hidden.shape[1]
        pos = self._block_pos + 1 + mx.arange(rows)  # absolute positions the rows draft
        known = len(self.continuation)
        table = mx.array(self.continuation + [0] * (rows + 1), dtype=mx.int32)  # 0 past the end
        corrupt = mx.array([p in self.corrupt for p in range(known + rows + 1)])
        want = mx.take(table, pos)
        want = mx.where(mx.take(corrupt, pos), (want + 1 + pos % 7) % vocab, want)
        # a few ops for the whole block, not three per row (a cycle costs mostly per-op overhead);
        # with a draft vocabulary the logits' columns are its ids (a token outside it cannot win)
        column_ids = mx.arange(vocab) if self.draft_vocab is None else self.draft_vocab
        rows = mx.where(want[:, None] == column_ids, 30.0, 0.0)
        return 0.01 * real + rows[None]


def runner_for(model) -> TargetRunner:
    return TargetRunner(model)
