"""Train the embedded tiny target: a small Qwen3.5-architecture hybrid (mlx-lm ``qwen3_5``).

The model is mlx-lm's own ``qwen3_5`` module (Gated DeltaNet layers with a gated attention layer
every ``full_attention_interval``), so the saved directory loads through ``mlx_lm.utils.load_model``
and ``dflash2_mlx.models.loading.load_target`` like any Qwen3.5 checkpoint. Only the training forward
differs from mlx-lm's call: the Gated DeltaNet recurrence is computed in its chunked (WY) form,
which is mathematically the same as mlx-lm's step-by-step loop (a test pins the two together)
but runs as a handful of batched matmuls instead of one tiny op chain per token (a training
step is about 2x faster on the CPU). Everything else (projections, conv, norms, attention, MLP)
is the model's own sub-modules.

Determinism: fixed seeds for initialisation and batch order, fixed step counts, a fixed op
sequence (MLX on the CPU is deterministic for that), no wall-clock decisions.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from dflash2_mlx.backend import blas as _blas  # noqa: F401  (OpenBLAS before mlx.core)

DEMO_TARGET_NAME = "tiny-code-demo-target"


def model_config(
    vocab_size: int,
    eos_token_id: int,
    hidden_size: int = 256,
    num_layers: int = 6,
    intermediate_size: int = 448,
    full_attention_interval: int = 3,
    attention_heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    linear_key_heads: int = 2,
    linear_value_heads: int = 4,
    linear_head_dim: int = 32,
    max_context: int = 4096,
    name: str = DEMO_TARGET_NAME,
) -> dict:
    """A Hugging Face style ``qwen3_5`` config (outer + ``text_config``) for mlx-lm."""
    text = {
        "model_type": "qwen3_5_text",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": attention_heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "linear_num_key_heads": linear_key_heads,
        "linear_num_value_heads": linear_value_heads,
        "linear_key_head_dim": linear_head_dim,
        "linear_value_head_dim": linear_head_dim,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": full_attention_interval,
        "layer_types": [
            "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
            for i in range(num_layers)
        ],
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": max_context,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "eos_token_id": eos_token_id,
    }
    return {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "name": name,
        "_name_or_path": name,
        "tie_word_embeddings": False,
        "text_config": text,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }


RESIDUAL_OUTPUTS = ("self_attn.o_proj", "linear_attn.out_proj", "mlp.down_proj")


def build_model(config: dict, seed: int, init_std: float = 0.02) -> nn.Module:
    """mlx-lm's ``qwen3_5`` model with float32 weights initialised from ``seed``.

    Every matrix (embedding, projections, LM head) is drawn from N(0, init_std^2), except the
    projections that write into the residual stream (attention / Gated DeltaNet output, MLP
    down), which start at zero, so each layer starts as the identity. Norms, the short conv and
    the Gated DeltaNet decay parameters keep mlx-lm's initialisation. On this corpus the zero
    residual outputs lowered the loss after 200 small steps from 5.25 to 4.80.
    """
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    new = []
    for (name, p), key in zip(params, keys):
        if p.ndim == 2 and name.endswith(".weight"):
            if any(f"{r}.weight" in name for r in RESIDUAL_OUTPUTS):
                p = mx.zeros_like(p)
            else:
                p = init_std * mx.random.normal(p.shape, dtype=p.dtype, key=key)
        new.append((name, p))
    model.load_weights(new)
    mx.eval(model.parameters())
    return model


def parameter_count(model: nn.Module) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def float32_bytes(config: dict) -> int:
    """Size of the float32 safetensors weights of ``config`` (computed, nothing trained)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    return 4 * parameter_count(model)


# ---------------------------------------------------------------------------------------------
# Training forward (chunked Gated DeltaNet)


@mx.custom_function
def unit_lower_inverse(nil: mx.array) -> mx.array:
    """(I - N)^-1 for strictly lower-triangular N [..., C, C] (LAPACK trtri on the CPU stream)."""
    c = nil.shape[-1]
    return mx.linalg.tri_inv(mx.eye(c, dtype=nil.dtype) - nil, upper=False, stream=mx.cpu)


@unit_lower_inverse.vjp
def _unit_lower_inverse_vjp(primals, cotangent, output):
    # d(inv) = inv dN inv, so grad_N = inv^T G inv^T, of which only the strictly lower part is used.
    inv_t = output.swapaxes(-1, -2)
    return (mx.tril(inv_t @ cotangent @ inv_t, k=-1),)


def chunked_gated_delta(q, k, v, log_g, beta, chunk: int = 32):
    """The gated delta rule over a whole sequence from a zero state, in chunked (WY) form.

    Same recurrence as ``mlx_lm.models.gated_delta.gated_delta_ops`` (state S [Dv, Dk] per head:
    S <- g S; S <- S + beta (v - S k) k^T; y = S q), for q, k [B, T, Hk, Dk] (already normalised),
    v [B, T, Hv, Dv], log_g and beta [B, T, Hv]. Returns y [B, T, Hv, Dv].

    Within a chunk with cumulative decay gamma_i, the state is gamma_i S0 + sum_j (gamma_i /
    gamma_j) u_j k_j^T where the pseudo-values u solve the unit lower-triangular system
    (I + A) u = beta v - beta gamma S0 k, A_ij = beta_i (gamma_i / gamma_j) k_i.k_j (j < i), solved
    with one batched triangular inverse, so a chunk is a few matmuls; only the short loop over
    chunks carries the state.
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if Hv // Hk > 1:
        q = mx.repeat(q, Hv // Hk, axis=-2)
        k = mx.repeat(k, Hv // Hk, axis=-2)
    pad = (-T) % chunk
    if pad:  # padded steps: k = v = beta = 0 and g = 1 leave the state unchanged
        widths = [(0, 0), (0, pad), (0, 0), (0, 0)]
        q, k, v = (mx.pad(t, widths) for t in (q, k, v))
        log_g = mx.pad(log_g, widths[:3])
        beta = mx.pad(beta, widths[:3])
    n = (T + pad) // chunk

    def heads_first(t):  # [B, T, H, ...] -> [B, H, n, C, ...]
        t = t.reshape(B, n, chunk, Hv, *t.shape[3:])
        return t.transpose(0, 3, 1, 2, *range(4, t.ndim))

    q, k, v, log_g, beta = (heads_first(t) for t in (q, k, v, log_g, beta))
    gc = mx.cumsum(log_g, axis=-1)  # [B, H, n, C] log gamma
    lower = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_))
    diff = gc[..., :, None] - gc[..., None, :]
    decay = mx.where(lower, mx.exp(mx.where(lower, diff, 0.0)), 0.0)  # gamma_i / gamma_j, j <= i
    kb = k * beta[..., None]
    strict = mx.tril(mx.ones((chunk, chunk)), k=-1)
    nil = -(kb @ k.swapaxes(-1, -2)) * decay * strict  # N = -A
    inv = unit_lower_inverse(nil)
    values = inv @ (v * beta[..., None])  # [B, H, n, C, Dv]
    kdecay = inv @ (kb * mx.exp(gc)[..., None])  # [B, H, n, C, Dk]
    qk = (q @ k.swapaxes(-1, -2)) * decay  # [B, H, n, C, C]
    qg = q * mx.exp(gc)[..., None]
    kend = k * mx.exp(gc[..., -1:] - gc)[..., None]
    gend = mx.exp(gc[..., -1])  # [B, H, n]
    state = mx.zeros((B, Hv, Dk, Dv), dtype=q.dtype)  # S^T
    outs = []
    for c in range(n):
        u = values[:, :, c] - kdecay[:, :, c] @ state
        outs.append(qg[:, :, c] @ state + qk[:, :, c] @ u)
        state = state * gend[:, :, c, None, None] + kend[:, :, c].swapaxes(-1, -2) @ u
    y = mx.stack(outs, axis=2)  # [B, H, n, C, Dv]
    y = y.transpose(0, 2, 3, 1, 4).reshape(B, n * chunk, Hv, Dv)
    return y[:, :T]


def _gated_delta_net_train(gdn: nn.Module, x: mx.array, chunk: int) -> mx.array:
    """``qwen3_5.GatedDeltaNet.__call__`` without a cache, with the chunked recurrence."""
    from dflash2_mlx.models.target import gated_delta_qkv

    B, S, _ = x.shape
    qkv = gdn.in_proj_qkv(x)
    z = gdn.in_proj_z(x).reshape(B, S, gdn.num_v_heads, gdn.head_v_dim)
    b = gdn.in_proj_b(x)
    a = gdn.in_proj_a(x)
    conv_input = mx.concatenate([mx.zeros((B, gdn.conv_kernel_size - 1, gdn.conv_dim), dtype=x.dtype), qkv], axis=1)
    conv_out = nn.silu(gdn.conv1d(conv_input))
    q, k, v = gated_delta_qkv(gdn, conv_out)
    beta = mx.sigmoid(b)
    log_g = -mx.exp(gdn.A_log.astype(mx.float32)) * nn.softplus(a + gdn.dt_bias)
    out = chunked_gated_delta(q, k, v, log_g, beta, chunk)
    out = gdn.norm(out, z)
    return gdn.out_proj(out.reshape(B, S, -1))


def train_logits(model: nn.Module, tokens: mx.array, chunk: int = 32) -> mx.array:
    """Logits [B, T, V] of mlx-lm's qwen3_5 model for a batch of full sequences (no cache)."""
    outer = model.language_model
    inner = outer.model
    h = inner.embed_tokens(tokens)
    for layer in inner.layers:
        if layer.is_linear:
            h = h + _gated_delta_net_train(layer.linear_attn, layer.input_layernorm(h), chunk)
        else:
            h = h + layer.self_attn(layer.input_layernorm(h), mask="causal", cache=None)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = inner.norm(h)
    if outer.args.tie_word_embeddings:
        return inner.embed_tokens.as_linear(h)
    return outer.lm_head(h)


# ---------------------------------------------------------------------------------------------
# Data


def pack_documents(documents: Sequence[Sequence[int]], seq_len: int, eos_id: int) -> np.ndarray:
    """Concatenate documents (each followed by eos) and cut windows of seq_len + 1 tokens
    (consecutive windows share one token: inputs [:-1], labels [1:]). Returns int32 [N, seq_len+1]."""
    stream = np.fromiter(
        (t for doc in documents for t in (*doc, eos_id)),
        dtype=np.int32,
    )
    n = (len(stream) - 1) // seq_len
    if n == 0:
        raise ValueError(f"corpus of {len(stream)} tokens is shorter than one sequence of {seq_len + 1}")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None]
    return stream[idx]


# ---------------------------------------------------------------------------------------------
# Training


@dataclass
class TargetTrainingConfig:
    steps: int = 450
    batch_size: int = 16
    seq_len: int = 256
    learning_rate: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    chunk: int = 64  # Gated DeltaNet chunk length of the training forward
    betas: tuple = (0.9, 0.95)
    compile: bool = True  # mx.compile the step (fuses element-wise ops; the first step compiles for ~40 s)

    def to_dict(self) -> dict:
        return asdict(self)


def lr_schedule(cfg: TargetTrainingConfig) -> Callable:
    warm = max(1, min(cfg.warmup_steps, cfg.steps))
    cosine = optim.cosine_decay(cfg.learning_rate, max(1, cfg.steps - warm), cfg.learning_rate * cfg.min_lr_ratio)
    return optim.join_schedules(
        [optim.linear_schedule(cfg.learning_rate / warm, cfg.learning_rate, warm), cosine], [warm]
    )


def batch_order(num_sequences: int, steps: int, batch_size: int, seed: int) -> np.ndarray:
    """Sequence indices per step [steps, batch]: epochs of fixed-seed permutations."""
    rng = np.random.default_rng(seed)
    need = steps * batch_size
    order = []
    while sum(len(o) for o in order) < need:
        order.append(rng.permutation(num_sequences))
    return np.concatenate(order)[:need].reshape(steps, batch_size)


def train_target(
    model: nn.Module,
    sequences: np.ndarray,
    cfg: TargetTrainingConfig,
    log: Optional[Callable[[str], None]] = print,
    log_every: int = 10,
) -> list[dict]:
    """Next-token training with AdamW and a warmup + cosine schedule, for exactly ``cfg.steps``.

    ``sequences`` int32 [N, seq_len + 1]. Returns the loss history (one entry per logged step).
    """
    if sequences.shape[1] != cfg.seq_len + 1:
        raise ValueError(f"sequences have length {sequences.shape[1]}, expected seq_len + 1 = {cfg.seq_len + 1}")
    model.train()
    opt = optim.AdamW(learning_rate=lr_schedule(cfg), betas=list(cfg.betas), weight_decay=cfg.weight_decay)

    def loss_fn(m, x, y):
        return nn.losses.cross_entropy(train_logits(m, x, cfg.chunk), y).mean()

    value_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state]

    def step(x, y):
        loss, grads = value_and_grad(model, x, y)
        if cfg.grad_clip:
            grads, _ = optim.clip_grad_norm(grads, cfg.grad_clip)
        opt.update(model, grads)
        return loss

    if cfg.compile:
        step = mx.compile(step, inputs=state, outputs=state)
    order = batch_order(len(sequences), cfg.steps, cfg.batch_size, cfg.seed)
    history, running, t0 = [], [], time.perf_counter()
    for i in range(cfg.steps):
        batch = mx.array(sequences[order[i]])
        loss = step(batch[:, :-1], batch[:, 1:])
        mx.eval(loss, state)
        running.append(loss.item())
        if (i + 1) % log_every == 0 or i + 1 == cfg.steps:
            elapsed = time.perf_counter() - t0
            entry = {"step": i + 1, "loss": float(np.mean(running)), "seconds": round(elapsed, 1)}
            history.append(entry)
            running = []
            if log:
                tps = (i + 1) * cfg.batch_size * cfg.seq_len / elapsed
                log(
                    f"target step {i + 1}/{cfg.steps} loss {entry['loss']:.3f} lr {opt.learning_rate.item():.2e} "
                    f"{tps:.0f} tok/s {elapsed:.0f}s"
                )
    model.eval()
    return history


def evaluate_loss(model: nn.Module, sequences: np.ndarray, batch_size: int = 16, chunk: int = 32) -> float:
    """Mean next-token cross-entropy (nats) over all label positions of ``sequences``."""
    total, count = 0.0, 0
    for s in range(0, len(sequences), batch_size):
        batch = mx.array(sequences[s : s + batch_size])
        losses = nn.losses.cross_entropy(train_logits(model, batch[:, :-1], chunk), batch[:, 1:], reduction="sum")
        total += losses.item()
        count += batch.shape[0] * (batch.shape[1] - 1)
    return total / max(count, 1)


# ---------------------------------------------------------------------------------------------
# Saving


def save_target(model: nn.Module, config: dict, tokenizer_dir: Path, out_dir: Path) -> Path:
    """Write the Hugging Face layout mlx-lm loads: config.json, model.safetensors, tokenizer files."""
    import shutil

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = dict(sorted(tree_flatten(model.parameters())))
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=False) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        src = Path(tokenizer_dir) / name
        if src.exists() and src.resolve() != (out_dir / name).resolve():
            shutil.copyfile(src, out_dir / name)
    return out_dir
