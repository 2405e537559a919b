"""What a target and a drafter need in memory, from their config.json alone (no weights read)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

GB = 1e9
VERIFY_ROWS = 16  # the largest verify pass (block size): the kept per-step states


@dataclass(frozen=True)
class TargetShape:
    """What sizes the target's caches (from its config.json, or a preset's recorded facts)."""

    attention_layers: int
    kv_heads: int
    head_dim: int
    gdn_layers: int = 0
    gdn_value_heads: int = 0
    gdn_value_dim: int = 0
    gdn_key_heads: int = 0
    gdn_key_dim: int = 0
    conv_kernel: int = 4
    kv_bytes: int = 2  # bf16 / fp16 activations (float32 models: 4)
    max_context: Optional[int] = None

    @classmethod
    def from_config(cls, config: dict) -> "TargetShape":
        """From a target's config.json (Qwen3.5-style hybrids, or plain attention models)."""
        text = config.get("text_config", config)
        layers = int(text.get("num_hidden_layers", 0))
        types = text.get("layer_types")
        if types:
            gdn = sum(t == "linear_attention" for t in types)
        elif "full_attention_interval" in text:
            gdn = layers - layers // int(text["full_attention_interval"])
        else:
            gdn = 0
        heads = int(text.get("num_attention_heads", 1))
        head_dim = int(text.get("head_dim") or int(text.get("hidden_size", 0)) // max(heads, 1))
        dtype = str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16")
        return cls(
            attention_layers=layers - gdn,
            kv_heads=int(text.get("num_key_value_heads", heads)),
            head_dim=head_dim,
            gdn_layers=gdn,
            gdn_value_heads=int(text.get("linear_num_value_heads", 0)),
            gdn_value_dim=int(text.get("linear_value_head_dim", 0)),
            gdn_key_heads=int(text.get("linear_num_key_heads", 0)),
            gdn_key_dim=int(text.get("linear_key_head_dim", 0)),
            conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
            kv_bytes=4 if "float32" in dtype else 2,
            max_context=int(text.get("max_position_embeddings", 0)) or None,
        )

    def kv_bytes_at(self, context: int) -> int:
        return 2 * self.attention_layers * self.kv_heads * self.head_dim * self.kv_bytes * context

    def gdn_state_bytes(self) -> int:
        recurrent = self.gdn_value_heads * self.gdn_value_dim * self.gdn_key_dim * 4
        conv_dim = 2 * self.gdn_key_heads * self.gdn_key_dim + self.gdn_value_heads * self.gdn_value_dim
        return self.gdn_layers * (recurrent + (self.conv_kernel - 1) * conv_dim * self.kv_bytes)

    def kept_verify_bytes(self, rows: int = VERIFY_ROWS) -> int:
        """Per-step states one verify pass keeps (rollback by keeping; replay keeps none)."""
        return self.gdn_layers * rows * self.gdn_value_heads * self.gdn_value_dim * self.gdn_key_dim * 4


@dataclass(frozen=True)
class DrafterShape:
    layers: int
    kv_heads: int
    head_dim: int
    window: Optional[int] = None
    kv_bytes: int = 2

    @classmethod
    def from_config(cls, config: dict) -> "DrafterShape":
        heads = int(config.get("num_attention_heads", 1))
        window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
        return cls(
            layers=int(config.get("num_hidden_layers", 0)),
            kv_heads=int(config.get("num_key_value_heads", heads)),
            head_dim=int(config.get("head_dim") or int(config.get("hidden_size", 0)) // max(heads, 1)),
            window=int(window) if window else None,
            kv_bytes=4 if "float32" in dtype else 2,
        )

    def context_bytes_at(self, context: int) -> int:
        rows = min(context, self.window - 1) if self.window else context
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes * rows
