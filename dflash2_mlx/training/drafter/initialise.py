"""Building the drafter to train: its config.json for a target, and its initialisation.

The project's initialisation (identity convolutions, zero dynamic projections, zero successor
codebook, small random predecessor codebook and hidden projection), the ablations' frozen parts
(convs at identity, selector at zero), and a start from an existing DFlash 1 or 2 drafter.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from dflash2_mlx.models.drafter import Drafter
from dflash2_mlx.models.drafter_config import DFLASH1, DFLASH2, DrafterConfig, build_target_layer_ids
from dflash2_mlx.training.drafter.config import DrafterTrainingConfig

__all__ = [
    "MASK_TOKEN",
    "default_target_layer_ids",
    "drafter_from_init",
    "freeze_ablations",
    "init_drafter",
    "make_drafter_config",
    "mask_token_for",
]


MASK_TOKEN = "<|mask|>"


def default_target_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """``count`` distinct taps spread over the target's layers, never its last one.

    The reference's rule (``build_target_layer_ids``: from layer 1 to layer n-3) when it gives
    distinct non-final layers, else evenly spread over 0..n-2. The last layer is never tapped:
    transformers reports it final-normed, so implementations would disagree about its feature.
    """
    n = int(num_target_layers)
    if n < 2:
        raise ValueError(f"the target has {n} layer(s); a drafter needs a non-final layer to tap")
    count = max(1, min(int(count), n - 1))
    ids = build_target_layer_ids(n, count)
    if len(set(ids)) == count and all(0 <= i <= n - 2 for i in ids):
        return [int(i) for i in ids]
    start = 1 if n - 2 >= count else 0
    ids = sorted({int(round(x)) for x in np.linspace(start, n - 2, count)})
    if len(ids) < count:
        ids = list(range(n - 1 - count, n - 1))
    return ids


def _text_config(target) -> dict:
    cfg = getattr(target, "config", None) or {}
    return cfg.get("text_config", cfg)


def mask_token_for(target, override: Optional[int] = None) -> int:
    if override is not None:
        return int(override)
    tokenizer = getattr(target, "tokenizer", None)
    vocab = {}
    if tokenizer is not None:
        try:
            vocab = tokenizer.get_vocab()
        except Exception:  # tokenizers without get_vocab: fall through to the error
            vocab = {}
    if MASK_TOKEN not in vocab:
        raise ValueError(
            f"the target's tokenizer has no {MASK_TOKEN} token; the drafter needs a mask token id: "
            f"add {MASK_TOKEN} to the tokenizer (an unused special token id works) or set mask_token_id"
        )
    return int(vocab[MASK_TOKEN])


def make_drafter_config(target, config: DrafterTrainingConfig) -> DrafterConfig:
    """The drafter's config.json (as a DrafterConfig) for this target and training config."""
    runner = target.runner
    text = _text_config(target)
    hidden = runner.hidden_size
    vocab = runner.vocab_size or int(text["vocab_size"])
    heads = int(config.num_attention_heads or text.get("num_attention_heads") or max(1, hidden // 64))
    # the target's key/value heads and head width only go with the target's head count
    inherit = not config.num_attention_heads
    kv_heads = int(config.num_key_value_heads or (text.get("num_key_value_heads") if inherit else None) or heads)
    head_dim = int(config.head_dim or (text.get("head_dim") if inherit else None) or hidden // heads)
    rope = text.get("rope_parameters") or {}
    rope_theta = float(text.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    taps = config.target_layer_ids
    if taps is None:
        taps = default_target_layer_ids(runner.num_layers, config.num_taps or config.layers)
    bad = [t for t in taps if not 0 <= t < runner.num_layers]
    if bad:
        raise ValueError(f"target_layer_ids {taps} are outside the target's {runner.num_layers} layers")
    mask = mask_token_for(target, config.mask_token_id)
    if not 0 <= mask < vocab:
        raise ValueError(f"mask token id {mask} is outside the target's vocabulary (size {vocab})")
    dflash: dict[str, Any] = {"block_size": config.block_size, "mask_token_id": mask, "target_layer_ids": list(taps)}
    if config.architecture == DFLASH2:
        if hidden % config.conv_group_size:
            raise ValueError(f"hidden size {hidden} is not a multiple of conv_group_size {config.conv_group_size}")
        dflash.update(
            conv_group_size=config.conv_group_size,
            conv_kernel_size=config.conv_kernel_size,
            selector_rank=config.selector_rank,
            selector_top_k=config.selector_top_k,
        )
    dflash["target_model"] = target.name
    raw: dict[str, Any] = {
        "architectures": [config.architecture],
        "model_type": "qwen3",
        "dflash_config": dflash,
        "hidden_size": hidden,
        "intermediate_size": int(config.intermediate_size or text.get("intermediate_size") or 4 * hidden),
        "num_hidden_layers": config.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": float(text.get("rms_norm_eps", 1e-6)),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(text.get("max_position_embeddings", 32768)),
        "num_target_layers": runner.num_layers,
        "is_causal": False,
        "dtype": "float32",
    }
    if config.sliding_window:
        raw["layer_types"] = ["sliding_attention"] * config.layers
        raw["sliding_window"] = int(config.sliding_window)
    else:
        raw["layer_types"] = ["full_attention"] * config.layers
    return DrafterConfig.from_dict(raw)


def init_drafter(drafter_config: DrafterConfig, config: DrafterTrainingConfig) -> Drafter:
    """A drafter initialised as the recipe says (deterministic for ``config.seed``)."""
    mx.random.seed(config.seed)
    drafter = Drafter(drafter_config)
    if drafter_config.is_dflash2:
        _reset_convs(drafter)
        sel = drafter.candidate_selector
        k1, k2 = mx.random.split(mx.random.key(config.seed + 1))
        std = config.selector_init_std
        sel.predecessor_codebook = std * mx.random.normal(sel.predecessor_codebook.shape, key=k1)
        sel.successor_codebook = mx.zeros_like(sel.successor_codebook)
        w = sel.hidden_projection.weight
        sel.hidden_projection.weight = std * mx.random.normal(w.shape, key=k2)
        if not config.selector:
            _zero_selector(drafter)
    mx.eval(drafter.parameters())
    return drafter


def _reset_convs(drafter: Drafter) -> None:
    for layer in drafter.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            base = mx.zeros(conv.base_kernel.shape)
            conv.base_kernel = base.at[:, 0, :].add(1.0)
            conv.kernel_projection.weight = mx.zeros_like(conv.kernel_projection.weight)


def _zero_selector(drafter: Drafter) -> None:
    sel = drafter.candidate_selector
    sel.predecessor_codebook = mx.zeros_like(sel.predecessor_codebook)
    sel.successor_codebook = mx.zeros_like(sel.successor_codebook)
    sel.hidden_projection.weight = mx.zeros_like(sel.hidden_projection.weight)


def freeze_ablations(drafter: Drafter, config: DrafterTrainingConfig) -> None:
    """convs / selector off in a DFlash 2 drafter: fixed at identity / zero and not trained."""
    if not drafter.config.is_dflash2:
        return
    if not config.convs:
        for layer in drafter.layers:
            layer.attention_conv.freeze()
            layer.mlp_conv.freeze()
    if not config.selector:
        drafter.candidate_selector.freeze()


def drafter_from_init(target, init: Path, config: DrafterTrainingConfig) -> Drafter:
    """Start from an existing drafter (DFlash 1 or 2); a DFlash 1 init can grow DFlash 2 parts."""
    from dflash2_mlx.models.loading import load_drafter, validate_pair

    source = load_drafter(str(init))
    sc = source.config
    validate_pair(target.runner, sc)
    if sc.num_hidden_layers != config.layers:
        warnings.warn(
            f"--init drafter has {sc.num_hidden_layers} layers; training it with that many, not {config.layers}"
        )
    if sc.is_dflash2 and config.architecture == DFLASH1:
        raise ValueError("cannot train a DFlash 1 drafter from a DFlash 2 --init (drop --no-convs or --no-selector)")
    raw = sc.to_dict()
    dflash = raw["dflash_config"]
    dflash["block_size"] = config.block_size
    dflash["target_model"] = target.name
    raw["architectures"] = [config.architecture]
    raw["dtype"] = "float32"
    if config.architecture == DFLASH2 and not sc.is_dflash2:
        dflash.update(
            conv_group_size=config.conv_group_size,
            conv_kernel_size=config.conv_kernel_size,
            selector_rank=config.selector_rank,
            selector_top_k=config.selector_top_k,
        )
    elif config.architecture == DFLASH2:
        dflash["selector_top_k"] = config.selector_top_k
    dc = DrafterConfig.from_dict(raw)
    drafter = init_drafter(dc, dataclasses.replace(config, layers=sc.num_hidden_layers))
    weights = [(k, v.astype(mx.float32)) for k, v in tree_flatten(source.parameters())]
    drafter.load_weights(weights, strict=False)
    if dc.is_dflash2 and not config.convs:
        _reset_convs(drafter)
    if dc.is_dflash2 and not config.selector:
        _zero_selector(drafter)
    mx.eval(drafter.parameters())
    return drafter
