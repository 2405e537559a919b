"""GGUF checkpoints (llama.cpp's format) as targets: read once, converted to an mlx-lm directory.

A ``.gguf`` file (or a directory holding exactly one) is converted into a Hugging Face-style
directory (``config.json``, ``model.safetensors``, tokenizer files) in the user cache, keyed by the
file's sha256, and that directory then loads through the ordinary path (``loading.load_target``).
A second load of the same file only hashes it (or not even that: the hash is remembered per path,
size and modification time).

- Weights in the types MLX reads natively (F32, F16, Q4_0, Q4_1, Q8_0) come from ``mx.load`` and
  stay as they are (the quantized ones as MLX affine triples, group 32); a file with any other
  type (K-quants, BF16, ...) is read with the ``gguf`` library and dequantized to float32.
- llama.cpp's converter permutes the rows of Q and K of llama models for its own RoPE; they are
  un-permuted here so the model is an ordinary mlx-lm ``llama``. qwen2 and qwen3 are stored in
  the Hugging Face order (their converter does not permute).
- Where the weights run (``place_weights``): on a Metal GPU they stay quantized; on the CPU they
  are dequantized to float32, because MLX's CPU quantized matmul has no fast path.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from dflash2_mlx.models import gguf_tokenizer
from dflash2_mlx.models.gguf_metadata import field

ARCHITECTURES = ("llama", "qwen2", "qwen3")

# Tensor types mx.load reads without loss (BF16 it would round to float16, so that goes through
# the gguf library as float32 instead).
NATIVE_TYPES = {"F32", "F16", "Q4_0", "Q4_1", "Q8_0"}

# Per-token cost of SmolLM2-135M on a 2-core Linux CPU (mlx-lm's llama, issue 30): why the CPU
# runs GGUF weights as float32.
CPU_COSTS = "4-bit 227 ms/token vs float32 80 ms with oneMKL (194 ms reference BLAS), SmolLM2-135M"

# llama.cpp tensor names -> mlx-lm (Hugging Face) module paths. Order matters: attn_output before
# the bare "output" (the untied LM head).
_NAME_PARTS = (
    ("token_embd", "model.embed_tokens"),
    ("output_norm", "model.norm"),
    ("attn_output", "self_attn.o_proj"),
    ("attn_q_norm", "self_attn.q_norm"),
    ("attn_k_norm", "self_attn.k_norm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
    ("output", "lm_head"),
)

_FORMAT_VERSION = 1  # bump when the converted layout changes: old cache entries are then ignored


class GGUFError(ValueError):
    """A GGUF file this project cannot use; the message is one line saying what to do."""


def find_gguf(spec: str, fetch_missing: bool = True) -> Optional[Path]:
    """The GGUF file a ``--model`` value names: a named local model (``smollm2``; fetched on first
    use unless ``fetch_missing`` is False), a ``.gguf`` file, or a directory holding exactly one
    ``.gguf`` and no ``config.json``; else None."""
    from dflash2_mlx.models import named

    named_file = named.model_file(spec, fetch_missing)
    if named_file is not None:
        return named_file
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            names = ", ".join(f.name for f in found[:4])
            raise GGUFError(f"model directory {path} holds several .gguf files ({names}); pass one file as --model")
        if found:
            return found[0]
    return None


def cache_root() -> Path:
    """Where converted copies live: $DFLASH2_MLX_GGUF_CACHE, else $XDG_CACHE_HOME (or ~/.cache)
    /dflash2-mlx/gguf (next to the prompt cache)."""
    explicit = os.environ.get("DFLASH2_MLX_GGUF_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dflash2-mlx" / "gguf"


def file_sha256(path: Path) -> str:
    """The file's sha256, remembered per (path, size, mtime) so an unchanged file is hashed once."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    memo_file = cache_root() / "hashes.json"
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    if key in memo:
        return memo[key]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    memo[key] = digest.hexdigest()
    try:
        memo_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo))
        os.replace(tmp, memo_file)
    except OSError:
        pass  # a read-only cache only costs a re-hash next time
    return memo[key]


def converted(path: Path, sha256: Optional[str] = None) -> Path:
    """The mlx-lm directory converted from the GGUF file at ``path`` (made on first use, then
    reused): written to a temporary directory and renamed, so a crash leaves no half entry."""
    sha256 = sha256 or file_sha256(path)
    target = cache_root() / f"{sha256}-v{_FORMAT_VERSION}"
    if (target / "config.json").exists():
        return target
    reader = open_reader(path)
    tmp = cache_root() / f".tmp-{sha256[:16]}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        config = hf_config(reader, path)
        config["gguf"] = {"file": path.name, "sha256": sha256}
        weights, quantization = read_weights(reader, path, config)
        if quantization:
            config["quantization"] = quantization
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        for name, text in gguf_tokenizer.tokenizer_files(reader, config).items():
            (tmp / name).write_text(text)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():  # not another process's finished copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def open_reader(path: Path):
    """A ``gguf.GGUFReader`` on the file, with a damaged or truncated file named as such."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors...
        raise GGUFError(f"GGUF file {path} is truncated or corrupt ({_first_line(e)}); re-download it") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise GGUFError(
                f"GGUF file {path} is truncated (tensor {t.name} ends past the end of the file); re-download it"
            )
    return reader


def hf_config(reader, path: Path) -> dict:
    """A Hugging Face config.json for mlx-lm's model of the file's architecture."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"GGUF file {path} has architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise GGUFError(f"GGUF file {path} has llama 3.1-style RoPE frequency factors, which are not supported yet")

    def meta(key: str, default=None):
        return field(reader, f"{arch}.{key}", default)

    heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    tokens = field(reader, "tokenizer.ggml.tokens") or []
    config = {
        "model_type": arch,
        "architectures": [f"{arch.capitalize()}ForCausalLM"],  # LlamaForCausalLM, Qwen2ForCausalLM, ...
        "hidden_size": hidden,
        "num_hidden_layers": meta("block_count"),
        "intermediate_size": meta("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "head_dim": meta("attention.key_length", hidden // heads),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "max_position_embeddings": meta("context_length", 4096),
        "vocab_size": meta("vocab_size", len(tokens)),
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "float32",
    }
    scaling = meta("rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": meta("rope.scaling.factor", 1.0)}
    elif scaling not in (None, "none"):
        raise GGUFError(f"GGUF file {path} uses RoPE scaling {scaling!r}, which is not supported yet")
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in names
        config["mlp_bias"] = "blk.0.ffn_up.bias" in names
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = field(reader, f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            config[key] = int(value)
    return config


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    stem, _, suffix = gguf_name.rpartition(".")  # weight, bias, scales, biases
    if stem.startswith("blk."):
        _, index, part = stem.split(".", 2)
        prefix = f"model.layers.{index}."
    else:
        part, prefix = stem, ""
    for old, new in _NAME_PARTS:
        if part == old:
            return f"{prefix}{new}.{suffix}"
    raise GGUFError(f"unexpected tensor {gguf_name} in the GGUF file; it is not a plain llama/qwen2/qwen3 checkpoint")


def unpermute_rows(w, heads: int):
    """Undo llama.cpp's Q/K row permutation (``permute`` in convert_hf_to_gguf.py): within each
    head it stores the rotary pairs interleaved (i, i + d/2 -> 2i, 2i+1); the Hugging Face layout
    keeps the two halves apart. Rows only, so it applies alike to weights, scales and biases."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_weights(reader, path: Path, config: dict) -> tuple[dict, dict]:
    """(weights with Hugging Face names, mlx-lm ``quantization`` config or {})."""
    types = {t.tensor_type.name for t in reader.tensors}
    if types <= NATIVE_TYPES:
        try:
            raw = mx.load(str(path))
        except Exception as e:
            raise GGUFError(f"GGUF file {path} could not be read ({_first_line(e)}); re-download it") from None
    else:
        raw = _dequantized(reader, path)
    permuted = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    weights, quantization = {}, {}
    for name, value in raw.items():
        part = name.split(".")[-2]
        if config["model_type"] == "llama" and part in permuted:
            value = unpermute_rows(value, permuted[part])
        hf = hf_name(name)
        weights[hf] = value
        if hf.endswith(".scales"):
            module = hf[: -len(".scales")]
            packed = raw[name[: -len("scales")] + "weight"]
            group = 32  # every native GGUF quantized type has blocks of 32
            bits = packed.shape[-1] * 32 // (value.shape[-1] * group)
            quantization[module] = {"group_size": group, "bits": bits}
    if quantization:
        # mlx-lm wants a model-wide default too; every quantized module also has its own entry
        # (a GGUF file mixes types: SmolLM2's embedding is Q8_0, its layers Q4_1)
        first = next(iter(quantization.values()))
        quantization = {"group_size": first["group_size"], "bits": first["bits"], **quantization}
    return weights, quantization


def _dequantized(reader, path: Path) -> dict:
    """Every tensor as float32 through the gguf library (for files with types MLX cannot read)."""
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        try:
            value = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise GGUFError(
                f"GGUF file {path}: tensor {t.name} has type {t.tensor_type.name}, which neither MLX nor the gguf "
                "library can read; use a file quantized to another type (e.g. Q4_K_M, Q8_0 or F16)"
            ) from None
        out[t.name] = mx.array(np.ascontiguousarray(value, dtype=np.float32))
    return out


def runs_quantized() -> bool:
    """Whether GGUF weights stay quantized here: on a Metal GPU yes; on the CPU no."""
    return mx.metal.is_available()


def placement_line() -> str:
    """One line for ``doctor``: where a GGUF target's weights run, and why."""
    if runs_quantized():
        return "GGUF weights stay quantized on the Metal GPU (its quantized matmuls read 4-8x fewer bytes)"
    return (
        f"GGUF weights are dequantized to float32 on the CPU (MLX's CPU quantized matmul has no fast path: {CPU_COSTS})"
    )


def place_weights(model: nn.Module) -> nn.Module:
    """On the CPU, the quantized layers become float32 ones (and every float weight float32);
    on Metal the model is left as loaded. Dequantized from float32 scales and biases, as
    llama.cpp computes them, so no float16 rounding enters."""
    if runs_quantized():
        return model
    from mlx_lm.utils import dequantize_model

    for _, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            module.scales = module.scales.astype(mx.float32)
            module.biases = module.biases.astype(mx.float32)
    dequantize_model(model)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def memory_sizes(path: Path) -> tuple[dict, int]:
    """(config, resident weight bytes) of a GGUF file, from its metadata only: float32 on the
    CPU, the file's own size on Metal."""
    reader = open_reader(path)
    config = hf_config(reader, path)
    if runs_quantized():
        return config, path.stat().st_size
    return config, 4 * sum(int(t.n_elements) for t in reader.tensors)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
