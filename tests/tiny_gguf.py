"""Tiny GGUF checkpoints written the way llama.cpp's converter writes them (the ``gguf`` library's
writer; Q and K rows of llama permuted for its RoPE), for the GGUF tests (test_gguf.py) and the
named-model fetch tests (test_model_fetch.py, which wrap one in a wheel)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize, quantize
from tokenizers.pre_tokenizers import ByteLevel

Q = gguf.GGMLQuantizationType
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 3, 4, 2  # K-quant blocks need rows of 256
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("1", "2"), ("Ġ", "Ġ"), ("-", "t")]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def vocabulary() -> list[str]:
    merged = ["".join(m) for m in MERGES]
    return SPECIALS + sorted(ByteLevel.alphabet()) + merged


VOCAB = len(vocabulary())


def llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """``permute`` of llama.cpp's convert_hf_to_gguf.py (LlamaModel), on the rows of a tensor."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def random_blocks_q4_k(rows: int, cols: int, rng) -> np.ndarray:
    """Raw Q4_K data (the gguf library can read but not write it): per 256 values an fp16 scale
    and min (kept small and finite), 12 bytes of 6-bit sub-scales and 128 bytes of 4-bit values."""
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    blocks[:, :, 0:2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    blocks[:, :, 2:4] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def encode(weight: np.ndarray, qtype, rng) -> tuple[np.ndarray, np.ndarray]:
    """(data as stored in the GGUF, the float32 weight llama.cpp would compute from it)."""
    if qtype == Q.F32:
        return weight, weight
    if qtype == Q.F64:
        return weight.astype(np.float64), weight
    if qtype == Q.Q4_K:
        data = random_blocks_q4_k(*weight.shape, rng)
    else:
        data = quantize(weight, qtype)
    return data, dequantize(data, qtype).astype(np.float32)


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    qtype=Q.F32,
    pre: str = "smollm",
    tied: bool = True,
    seed: int = 0,
    architecture_name: str | None = None,
) -> dict:
    """A tiny ``arch`` model as llama.cpp's converter writes it; returns the HF-layout float32
    weights it stands for (what a GGUF reader must reproduce)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), architecture_name or arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    tokens = vocabulary()
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges([" ".join(m) for m in MERGES])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)

    hf = {}

    def matrix(gguf_name, hf_name, shape, permute_heads=None):
        weight = (rng.standard_normal(shape) * 0.08).astype(np.float32)
        data, hf[hf_name] = encode(weight, qtype, rng)
        if permute_heads:
            data = llama_cpp_permute(data, permute_heads)
        writer.add_tensor(gguf_name, data, raw_dtype=None if data.dtype != np.uint8 else qtype)

    def vector(gguf_name, hf_name, size, around=1.0, permute_heads=None):
        value = (around + 0.1 * rng.standard_normal(size)).astype(np.float32)
        hf[hf_name] = value
        writer.add_tensor(gguf_name, llama_cpp_permute(value, permute_heads) if permute_heads else value)

    permuted = arch == "llama"
    matrix("token_embd.weight", "model.embed_tokens.weight", (VOCAB, HIDDEN))
    for i in range(LAYERS):
        blk, layer = f"blk.{i}", f"model.layers.{i}"
        vector(f"{blk}.attn_norm.weight", f"{layer}.input_layernorm.weight", HIDDEN)
        matrix(
            f"{blk}.attn_q.weight",
            f"{layer}.self_attn.q_proj.weight",
            (HEADS * HEAD_DIM, HIDDEN),
            HEADS if permuted else None,
        )
        matrix(
            f"{blk}.attn_k.weight",
            f"{layer}.self_attn.k_proj.weight",
            (KV_HEADS * HEAD_DIM, HIDDEN),
            KV_HEADS if permuted else None,
        )
        matrix(f"{blk}.attn_v.weight", f"{layer}.self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN))
        matrix(f"{blk}.attn_output.weight", f"{layer}.self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM))
        if arch == "qwen2":
            vector(f"{blk}.attn_q.bias", f"{layer}.self_attn.q_proj.bias", HEADS * HEAD_DIM, around=0.0)
            vector(f"{blk}.attn_k.bias", f"{layer}.self_attn.k_proj.bias", KV_HEADS * HEAD_DIM, around=0.0)
            vector(f"{blk}.attn_v.bias", f"{layer}.self_attn.v_proj.bias", KV_HEADS * HEAD_DIM, around=0.0)
        if arch == "qwen3":
            vector(f"{blk}.attn_q_norm.weight", f"{layer}.self_attn.q_norm.weight", HEAD_DIM)
            vector(f"{blk}.attn_k_norm.weight", f"{layer}.self_attn.k_norm.weight", HEAD_DIM)
        vector(f"{blk}.ffn_norm.weight", f"{layer}.post_attention_layernorm.weight", HIDDEN)
        matrix(f"{blk}.ffn_gate.weight", f"{layer}.mlp.gate_proj.weight", (FFN, HIDDEN))
        matrix(f"{blk}.ffn_up.weight", f"{layer}.mlp.up_proj.weight", (FFN, HIDDEN))
        matrix(f"{blk}.ffn_down.weight", f"{layer}.mlp.down_proj.weight", (HIDDEN, FFN))
    vector("output_norm.weight", "model.norm.weight", HIDDEN)
    if not tied:
        matrix("output.weight", "lm_head.weight", (VOCAB, HIDDEN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf
