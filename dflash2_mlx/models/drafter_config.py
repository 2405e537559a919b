"""Drafter configuration, parsed from a Hugging Face ``config.json`` (DFlash 1 and DFlash 2).

A DFlash drafter directory says ``"model_type": "qwen3"`` but is not a Qwen3 model: it is
dispatched on ``architectures`` and never goes through mlx-lm's model loader.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

DFLASH1 = "DFlashDraftModel"
DFLASH2 = "DFlash2DraftModel"
ARCHITECTURES = (DFLASH1, DFLASH2)


class ConfigError(ValueError):
    """A drafter config.json that cannot describe a drafter this project runs."""


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's default taps when a v1 config does not list them."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DrafterConfig:
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 32768
    layer_types: list[str] = field(default_factory=list)
    sliding_window: Optional[int] = None
    is_causal: Optional[bool] = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    # DFlash 2 only: the drafter scores only these many token ids (the checkpoint's
    # ``draft_vocab``), so its head reads a slice of the target's (0: the whole vocabulary)
    draft_vocab_size: int = 0
    target_name: Optional[str] = None
    dtype: str = "bfloat16"

    @property
    def is_dflash2(self) -> bool:
        return self.architecture == DFLASH2

    def layer_is_sliding(self, i: int) -> bool:
        return self.layer_types[i] == "sliding_attention" and self.sliding_window is not None

    def layer_is_causal(self, i: int) -> bool:
        # The reference: with no `is_causal` key, sliding layers are causal and full ones are not.
        if self.is_causal is None:
            return self.layer_types[i] == "sliding_attention"
        return bool(self.is_causal)

    @property
    def context_window(self) -> Optional[int]:
        """Context rows the drafter can ever see (None: unbounded, some layer is full attention).

        A block row at position n+i sees context position p only if (n+i) - p < W, so W-1 rows
        of context are enough for every row of every later block.
        """
        if self.layer_types and all(self.layer_is_sliding(i) for i in range(self.num_hidden_layers)):
            return self.sliding_window - 1
        return None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "DrafterConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"config.json architectures {archs} is not a DFlash drafter (expected one of {list(ARCHITECTURES)})"
            )
        dflash = cfg.get("dflash_config") or {}

        def get(name, default=None):
            return dflash.get(name, cfg.get(name, default))

        try:
            hidden = int(cfg["hidden_size"])
            layers = int(cfg["num_hidden_layers"])
            heads = int(cfg["num_attention_heads"])
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            num_target_layers = get("num_target_layers")
            taps = get("target_layer_ids")
            if taps is None:
                if num_target_layers is None:
                    raise ConfigError("config.json has neither target_layer_ids nor num_target_layers")
                taps = build_target_layer_ids(int(num_target_layers), layers)
            mask = get("mask_token_id")
            if mask is None:
                raise ConfigError("config.json has no dflash_config.mask_token_id")
            layer_types = list(cfg.get("layer_types") or ["full_attention"] * layers)
            if len(layer_types) != layers:
                raise ConfigError("layer_types length does not match num_hidden_layers")
            unknown = set(layer_types) - {"full_attention", "sliding_attention"}
            if unknown:
                raise ConfigError(f"unsupported drafter layer_types {sorted(unknown)}")
            sliding = cfg.get("sliding_window")
            if "sliding_attention" in layer_types and cfg.get("use_sliding_window", True) is False:
                sliding = None
            rope_scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
            config = cls(
                architecture=arch,
                hidden_size=hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                block_size=int(get("block_size", 16)),
                mask_token_id=int(mask),
                target_layer_ids=[int(t) for t in taps],
                num_target_layers=None if num_target_layers is None else int(num_target_layers),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
                rope_scaling=rope_scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
                layer_types=layer_types,
                sliding_window=None if sliding is None else int(sliding),
                is_causal=cfg.get("is_causal"),
                input_embedding_scale=float(get("input_embedding_scale", 1.0)),
                output_multiplier=float(get("output_multiplier", 1.0)),
                final_logit_softcapping=get("final_logit_softcapping"),
                conv_kernel_size=int(get("conv_kernel_size", 0) or 0),
                conv_group_size=int(get("conv_group_size", 0) or 0),
                selector_rank=int(get("selector_rank", 0) or 0),
                selector_top_k=int(get("selector_top_k", 0) or 0),
                draft_vocab_size=int(get("draft_vocab_size", 0) or 0),
                target_name=get("target_model") or get("target_name_or_path"),
                dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"),
            )
        except KeyError as e:
            raise ConfigError(f"config.json is missing the key {e.args[0]!r}") from None
        if config.is_dflash2:
            for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
                if getattr(config, name) <= 0:
                    raise ConfigError(f"DFlash2DraftModel config needs dflash_config.{name} > 0")
            if config.hidden_size % config.conv_group_size:
                raise ConfigError("hidden_size is not a multiple of dflash_config.conv_group_size")
            vocab = config.draft_vocab_size
            if vocab and not config.selector_top_k <= vocab <= config.vocab_size:
                raise ConfigError(
                    f"dflash_config.draft_vocab_size {config.draft_vocab_size} must lie between selector_top_k "
                    f"({config.selector_top_k}) and vocab_size ({config.vocab_size})"
                )
        elif config.draft_vocab_size:
            raise ConfigError("dflash_config.draft_vocab_size is a DFlash 2 option (its selector maps the ids)")
        if config.block_size < 2:
            raise ConfigError(f"block_size must be at least 2, got {config.block_size}")
        return config

    def to_dict(self) -> dict[str, Any]:
        """The Hugging Face config.json this config came from (reference layout)."""
        dflash: dict[str, Any] = {
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
        }
        if self.is_dflash2:
            dflash.update(
                conv_group_size=self.conv_group_size,
                conv_kernel_size=self.conv_kernel_size,
                selector_rank=self.selector_rank,
                selector_top_k=self.selector_top_k,
            )
            if self.draft_vocab_size:
                dflash["draft_vocab_size"] = self.draft_vocab_size
        if self.input_embedding_scale != 1.0:
            dflash["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            dflash["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        if self.target_name:
            dflash["target_model"] = self.target_name
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": "qwen3",
            "attention_bias": False,
            "dflash_config": dflash,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "layer_types": list(self.layer_types),
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": False,
            "vocab_size": self.vocab_size,
            "dtype": self.dtype,
        }
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
            out["use_sliding_window"] = True
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        if self.rope_scaling:
            out["rope_scaling"] = self.rope_scaling
        return out
