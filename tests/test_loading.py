"""Loading targets and drafters from disk, on tiny checkpoints in the real on-disk layouts.

- targets in the original Hugging Face layout (``model.language_model.*``, ``mtp.*``, a vision
  tensor, conv1d as [C, 1, K], norms stored as w - 1) and in the MLX layout load to exactly the
  model that was saved;
- 4-bit and 8-bit quantized targets (hybrid and plain) load, and greedy speculative decoding on
  them is token-for-token plain decoding;
- DFlash 2 / DFlash 1 drafters round-trip, and a v1 config without ``target_layer_ids`` gets the
  reference's default taps;
- every bad input a user can give is a ``LoadError`` with one line naming the problem and what to
  do; a prompt longer than the target's context is ``PromptTooLong``.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import socket
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
import tiny
from mlx.utils import tree_flatten

from dflash2_mlx.engine import GenerationSettings, PromptTooLong, generate_autoregressive, generate_speculative
from dflash2_mlx.models.drafter_config import DFLASH1, DFLASH2
from dflash2_mlx.models.loading import LoadError, load_drafter, load_target, validate_pair
from dflash2_mlx.models.target import TargetRunner

PROMPTS = {
    "short": [5, 17, 99, 200, 3],
    "one-token": [42],
    "text": list(b"The quick brown fox jumps over the lazy dog"),
}


# --------------------------------------------------------------------------------------------
# helpers


def _tokens(events) -> list[int]:
    return [t for e in events for t in e.tokens]


def _plain(runner, prompt, max_tokens) -> list[int]:
    return _tokens(generate_autoregressive(runner, prompt, GenerationSettings(max_tokens=max_tokens)))


def _forward(runner: TargetRunner, tokens: list[int], taps=None):
    logits, features = runner(mx.array([tokens], dtype=mx.int32), runner.make_cache(), taps)
    mx.eval(logits, features)
    return logits, features


def _assert_identical(runner, prompt, spec: list[int], plain: list[int], what: str) -> None:
    """Identity, or a failure that names the first divergence and the target's top-2 logit gap."""
    if spec == plain:
        return
    i = next((j for j, (s, p) in enumerate(zip(spec, plain)) if s != p), min(len(spec), len(plain)))
    gap = "n/a"
    if i < min(len(spec), len(plain)):
        logits, _ = _forward(runner, list(prompt) + plain[:i])
        top2 = mx.sort(logits[0, -1])[-2:].tolist()
        gap = f"{top2[1] - top2[0]:.3g}"
    pytest.fail(
        f"{what}: speculative output diverges from plain decoding at token {i} "
        f"(spec {spec[i : i + 3]}, plain {plain[i : i + 3]}, lengths {len(spec)}/{len(plain)}, "
        f"target top-2 logit gap {gap})"
    )


def _set_norms(model: nn.Module, seed: int) -> None:
    """Non-trivial RMSNorm weights, exactly representable as w and as w - 1 (so the HF
    layout's ``w - 1`` and mlx-lm's ``+ 1`` are exact)."""
    key = mx.random.key(seed)
    new = []
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            key, sub = mx.random.split(key)
            new.append((name, 1.0 + mx.random.randint(-16, 17, p.shape, key=sub).astype(p.dtype) / 64))
    model.load_weights(new, strict=False)
    mx.eval(model.parameters())


ACTION = re.compile(r"\b(give|pass|use|re-download|connect|unset|shorten|check|log in|accept)\b", re.I)


def _load_error(fn, *needles: str) -> str:
    """``fn()`` raises LoadError with one line that names the problem and says what to do."""
    with pytest.raises(LoadError) as excinfo:
        fn()
    message = str(excinfo.value)
    assert message.strip(), "empty LoadError message"
    assert "\n" not in message and "\r" not in message, f"multi-line message: {message!r}"
    assert "Traceback" not in message, message
    assert len(message) < 400, f"message too long ({len(message)} chars): {message}"
    for needle in needles:
        assert needle in message, f"{needle!r} not in: {message}"
    assert ACTION.search(message), f"message does not say what to do: {message}"
    return message


def _corrupt(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    data = f.read_bytes()
    if how == "truncated":  # an interrupted download
        f.write_bytes(data[: len(data) // 2])
    elif how == "garbage":  # random bytes of the same size
        f.write_bytes(random.Random(len(data)).randbytes(len(data)))
    elif how == "non-json-header":  # a plausible header length, then bytes that are not JSON
        header = b"{not json at all, but the length fits}"
        f.write_bytes(struct.pack("<Q", len(header)) + header + data[8:])
    elif how == "non-utf8-header":  # MLX raises UnicodeDecodeError (a ValueError) for this one
        header = b'{"\xff\xfe":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
        f.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    else:
        raise ValueError(how)
    return dst


CORRUPTIONS = ["truncated", "garbage", "non-json-header", "non-utf8-header"]


# --------------------------------------------------------------------------------------------
# fixtures: tiny checkpoints on disk


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("loading")


@pytest.fixture(scope="module")
def hybrid(root):
    cfg = tiny.hybrid_config()
    model = tiny.build_target(cfg, seed=11, scale=3.0)
    _set_norms(model, seed=12)
    return cfg, model


@pytest.fixture(scope="module")
def hybrid_dirs(root, hybrid):
    cfg, model = hybrid
    return {
        "hf": tiny.save_target(model, cfg, root / "hybrid-hf", hf_layout=True),
        "mlx": tiny.save_target(model, cfg, root / "hybrid-mlx"),
    }


@pytest.fixture(scope="module")
def drafter_dirs(root, hybrid):
    cfg, _ = hybrid
    v2 = tiny.build_drafter(tiny.drafter_config(cfg, version=2, block_size=8), seed=21)
    v1 = tiny.build_drafter(tiny.drafter_config(cfg, version=1, block_size=8), seed=22)
    return {
        "v2": (v2, tiny.save_drafter(v2, root / "drafter-v2")),
        "v1": (v1, tiny.save_drafter(v1, root / "drafter-v1")),
    }


# --------------------------------------------------------------------------------------------
# targets: original HF layout and MLX layout


def test_hf_layout_file_is_really_the_original_layout(hybrid_dirs, hybrid):
    cfg, model = hybrid
    saved = mx.load(str(hybrid_dirs["hf"] / "model.safetensors"))
    assert any(k.startswith("model.language_model.layers.") for k in saved)
    assert not any(k.startswith("language_model.") for k in saved)
    assert any(k.startswith("mtp.") for k in saved)
    assert any(k.startswith("model.visual.") for k in saved)
    conv = saved["model.language_model.layers.0.linear_attn.conv1d.weight"]
    assert conv.shape[1] == 1 and conv.shape[2] == cfg["text_config"]["linear_conv_kernel_dim"]  # [C, 1, K]
    ours = dict(tree_flatten(model.parameters()))
    norm = "model.language_model.layers.0.input_layernorm.weight"
    assert mx.array_equal(saved[norm] + 1.0, ours["language_model.model.layers.0.input_layernorm.weight"])
    assert not mx.array_equal(saved[norm], mx.zeros_like(saved[norm]))  # non-trivial norms


@pytest.mark.parametrize("layout", ["hf", "mlx"])
def test_hybrid_target_loads_to_the_saved_model(layout, hybrid, hybrid_dirs):
    cfg, model = hybrid
    target = load_target(str(hybrid_dirs[layout]))
    runner, reference = target.runner, TargetRunner(model)
    assert runner.kinds == ["gdn", "gdn", "gdn", "attention"]
    assert (runner.hidden_size, runner.vocab_size, runner.num_layers) == (64, tiny.VOCAB, 4)
    assert target.name == hybrid_dirs[layout].name
    # Every parameter the text model has, bit for bit (nothing of mtp.* / the vision tower kept).
    loaded = dict(tree_flatten(target.runner.model.parameters()))
    saved = dict(tree_flatten(model.parameters()))
    assert set(loaded) == set(saved)
    different = [k for k in saved if not mx.array_equal(loaded[k], saved[k])]
    assert not different, f"parameters differ after loading the {layout} layout: {different[:5]}"
    tokens = PROMPTS["text"]
    logits, features = _forward(runner, tokens, taps=[0, 1, 2, 3])
    ref_logits, ref_features = _forward(reference, tokens, taps=[0, 1, 2, 3])
    assert mx.abs(logits - ref_logits).max().item() <= 1e-6
    assert mx.abs(features - ref_features).max().item() <= 1e-6
    assert _plain(runner, PROMPTS["short"], 16) == _plain(reference, PROMPTS["short"], 16)


def test_plain_target_loads_to_the_saved_model(root):
    cfg = tiny.plain_config()
    model = tiny.build_target(cfg, seed=13, scale=3.0)
    _set_norms(model, seed=14)
    target = load_target(str(tiny.save_target(model, cfg, root / "plain-mlx")))
    assert target.runner.kinds == ["attention"] * 4
    logits, features = _forward(target.runner, PROMPTS["text"], taps=[1, 2])
    ref_logits, ref_features = _forward(TargetRunner(model), PROMPTS["text"], taps=[1, 2])
    assert mx.abs(logits - ref_logits).max().item() <= 1e-6
    assert mx.abs(features - ref_features).max().item() <= 1e-6


# --------------------------------------------------------------------------------------------
# quantized targets: lossless speculative decoding on the loaded model

QUANTIZED = [("hybrid", 4, 32), ("hybrid", 8, 64), ("plain", 4, 32), ("plain", 8, 64)]


@pytest.fixture(scope="module", params=QUANTIZED, ids=[f"{f}-{b}bit-g{g}" for f, b, g in QUANTIZED])
def quantized(request, root):
    from mlx_lm.utils import quantize_model, save_config, save_model

    family, bits, group_size = request.param
    cfg = tiny.hybrid_config() if family == "hybrid" else tiny.plain_config()
    model = tiny.build_target(cfg, seed=31 + bits, scale=3.0)
    model, qcfg = quantize_model(model, cfg, group_size=group_size, bits=bits)
    assert qcfg["quantization"]["bits"] == bits and qcfg["quantization"]["group_size"] == group_size
    path = root / f"{family}-{bits}bit"
    save_model(path, model)
    save_config(qcfg, path / "config.json")
    tiny.write_tokenizer(path)
    target = load_target(str(path))
    return {
        "family": family,
        "bits": bits,
        "group_size": group_size,
        "cfg": cfg,
        "model": model,
        "target": target,
        "plain": {},
    }


def _continuation(q, prompt_name: str, max_tokens: int) -> list[int]:
    """Plain greedy tokens of the loaded quantized target (cached per prompt)."""
    have = q["plain"].get(prompt_name, [])
    if len(have) < max_tokens:
        have = _plain(q["target"].runner, PROMPTS[prompt_name], max_tokens)
        q["plain"][prompt_name] = have
    return have[:max_tokens]


def test_quantized_target_loads_quantized(quantized):
    runner = quantized["target"].runner
    bits, group_size = quantized["bits"], quantized["group_size"]
    head = runner.outer.lm_head
    assert isinstance(head, nn.QuantizedLinear) and (head.bits, head.group_size) == (bits, group_size)
    assert isinstance(runner.inner.embed_tokens, nn.QuantizedEmbedding)
    layer = runner.layers[0]
    proj = layer.linear_attn.in_proj_qkv if quantized["family"] == "hybrid" else layer.self_attn.q_proj
    assert isinstance(proj, nn.QuantizedLinear) and proj.bits == bits
    logits, features = _forward(runner, PROMPTS["text"], taps=[0, 2])
    ref_logits, ref_features = _forward(TargetRunner(quantized["model"]), PROMPTS["text"], taps=[0, 2])
    assert mx.array_equal(logits, ref_logits)
    assert mx.array_equal(features, ref_features)


@pytest.mark.parametrize("prompt_name", ["short", "one-token", "text"])
def test_quantized_speculative_with_dflash2_drafter_is_lossless(quantized, prompt_name):
    runner = quantized["target"].runner
    drafter = tiny.build_drafter(tiny.drafter_config(quantized["cfg"], version=2), seed=41)
    plain = _continuation(quantized, prompt_name, 24)
    for block_size in (2, 5, 16):
        settings = GenerationSettings(max_tokens=24, block_size=block_size)
        spec = _tokens(generate_speculative(runner, drafter, PROMPTS[prompt_name], settings))
        _assert_identical(
            runner,
            PROMPTS[prompt_name],
            spec,
            plain,
            f"{quantized['family']} {quantized['bits']}-bit, DFlash 2, block {block_size}",
        )


def _oracle_plan(block_size: int) -> list[int]:
    """Accepted counts to force, cycle by cycle: every count 0..B-1, then the extremes again."""
    return list(range(block_size)) + [block_size - 1, 0, block_size - 1]


@pytest.mark.parametrize("prompt_name", ["short", "text"])
def test_quantized_speculative_with_oracle_drafter_is_lossless(quantized, prompt_name):
    runner, prompt = quantized["target"].runner, PROMPTS[prompt_name]
    cases = [(2, 2), (3, 2), (4, 1), (8, 2), (16, 2)]  # (block size, DFlash version)
    longest = max(1 + sum(a + 1 for a in _oracle_plan(b)) for b, _ in cases)
    plain_all = _continuation(quantized, prompt_name, longest)
    for block_size, version in cases:
        plan = _oracle_plan(block_size)
        max_tokens = 1 + sum(a + 1 for a in plan)  # the prefill's token, then each cycle's
        # Corrupt the drafted row right after the accepted prefix planned for each cycle.
        corrupt, n = set(), len(prompt)  # n: position of the cycle's anchor
        for a in plan:
            if a < block_size - 1:
                corrupt.add(n + 1 + a)
            n += a + 1
        config = tiny.drafter_config(quantized["cfg"], version=version)
        drafter = tiny.OracleDrafter(config, list(prompt) + plain_all, corrupt)
        mx.eval(drafter.parameters())
        settings = GenerationSettings(max_tokens=max_tokens, block_size=block_size)
        events = list(generate_speculative(runner, drafter, prompt, settings))
        what = f"{quantized['family']} {quantized['bits']}-bit, oracle v{version}, block {block_size}"
        _assert_identical(runner, prompt, _tokens(events), plain_all[:max_tokens], what)
        accepted = [e.accepted for e in events if e.accepted is not None]
        assert accepted == plan, f"{what}: accepted counts {accepted}, planned {plan}"
        stats = events[-1].stats
        assert stats.verify_steps == len(plan)
        assert stats.acceptance_length == pytest.approx((max_tokens - 1) / len(plan))


# --------------------------------------------------------------------------------------------
# drafters


def _assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    pa, pb = dict(tree_flatten(a.parameters())), dict(tree_flatten(b.parameters()))
    assert set(pa) == set(pb)
    for name in pa:
        assert pa[name].shape == pb[name].shape and pa[name].dtype == pb[name].dtype, name
        assert mx.array_equal(pa[name], pb[name]), f"{name} differs after the round trip"


def _drafter_hidden(drafter, hidden_size: int) -> mx.array:
    cfg = drafter.config
    mx.random.seed(5)
    features = mx.random.normal((1, 6, len(cfg.target_layer_ids) * hidden_size))
    block = mx.random.normal((1, cfg.block_size, hidden_size))
    out = drafter(block, features, drafter.make_cache())
    mx.eval(out)
    return out


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_drafter_round_trip(version, drafter_dirs):
    original, path = drafter_dirs[version]
    saved = mx.load(str(path / "model.safetensors"))
    if version == "v2":
        # The real layout: codebooks without a `.weight` suffix, no embedding, no LM head.
        assert "candidate_selector.predecessor_codebook" in saved
        assert "candidate_selector.successor_codebook" in saved
        assert "layers.0.attention_conv.base_kernel" in saved
    else:
        assert not any("conv" in k or "candidate_selector" in k for k in saved)
    assert not any("embed" in k or "lm_head" in k for k in saved)
    loaded = load_drafter(str(path))
    assert loaded.config.architecture == (DFLASH2 if version == "v2" else DFLASH1)
    assert loaded.config == original.config
    _assert_same_parameters(loaded, original)
    assert mx.array_equal(_drafter_hidden(loaded, 64), _drafter_hidden(original, 64))


@pytest.mark.parametrize(
    "num_target_layers, draft_layers, taps",
    [(36, 5, [1, 9, 17, 25, 33]), (32, 4, [1, 10, 20, 29]), (28, 1, [14])],
)
def test_v1_config_without_taps_gets_the_reference_default(root, num_target_layers, draft_layers, taps):
    # The reference (z-lab dflash, build_target_layer_ids): one layer taps num_target_layers // 2;
    # otherwise taps spread evenly over 1 .. num_target_layers - 3, rounded.
    target_cfg = tiny.hybrid_config(layers=num_target_layers)
    config = tiny.drafter_config(target_cfg, version=1, layers=draft_layers, taps=taps)
    drafter = tiny.build_drafter(config, seed=23)
    path = tiny.save_drafter(drafter, root / f"drafter-v1-top-{num_target_layers}-{draft_layers}")
    raw = json.loads((path / "config.json").read_text())
    dflash = raw.pop("dflash_config")
    raw["block_size"] = dflash["block_size"]  # some v1 checkpoints keep these at the top level
    raw["num_target_layers"] = num_target_layers
    raw["dflash_config"] = {"mask_token_id": dflash["mask_token_id"]}  # and no target_layer_ids
    (path / "config.json").write_text(json.dumps(raw))
    loaded = load_drafter(str(path))
    assert loaded.config.target_layer_ids == taps
    assert loaded.config.block_size == dflash["block_size"]
    assert loaded.config.num_target_layers == num_target_layers
    assert loaded.config.mask_token_id == tiny.MASK_ID
    _assert_same_parameters(loaded, drafter)


# --------------------------------------------------------------------------------------------
# bad input: one-line LoadErrors that say what to do


@pytest.mark.parametrize("loader, what", [(load_target, "model"), (load_drafter, "draft model")])
def test_missing_path(loader, what, root):
    missing = root / "no-such-dir"
    _load_error(lambda: loader(str(missing)), str(missing), "does not exist", what)
    _load_error(lambda: loader("no-such-relative-dir"), "no-such-relative-dir", "does not exist")


@pytest.mark.parametrize("loader", [load_target, load_drafter])
def test_file_instead_of_directory(loader, hybrid_dirs):
    file = hybrid_dirs["mlx"] / "config.json"
    _load_error(lambda: loader(str(file)), str(file), "is a file")


@pytest.mark.parametrize("loader", [load_target, load_drafter])
def test_directory_without_config(loader, root):
    empty = root / "empty-dir"
    empty.mkdir(exist_ok=True)
    (empty / "model.safetensors").write_bytes(b"")
    _load_error(lambda: loader(str(empty)), str(empty), "config.json")


def test_directory_without_weights(root, hybrid_dirs, drafter_dirs):
    target = root / "target-no-weights"
    target.mkdir(exist_ok=True)
    shutil.copy(hybrid_dirs["mlx"] / "config.json", target)
    _load_error(lambda: load_target(str(target)), str(target), "safetensors")
    draft = root / "drafter-no-weights"
    draft.mkdir(exist_ok=True)
    shutil.copy(drafter_dirs["v2"][1] / "config.json", draft)
    _load_error(lambda: load_drafter(str(draft)), str(draft), "safetensors")


def test_drafter_passed_as_target(root, drafter_dirs):
    for version in ("v2", "v1"):
        path = drafter_dirs[version][1]
        _load_error(lambda: load_target(str(path)), str(path), "is a DFlash drafter, not a target")
    # A v1 drafter whose config has no dflash_config at all: recognised by its architectures
    # (a drafter says "model_type": "qwen3" and must never reach mlx-lm's qwen3 loader).
    bare = root / "drafter-v1-bare"
    shutil.copytree(drafter_dirs["v1"][1], bare)
    raw = json.loads((bare / "config.json").read_text())
    raw.update(raw.pop("dflash_config"))
    (bare / "config.json").write_text(json.dumps(raw))
    _load_error(lambda: load_target(str(bare)), str(bare), "is a DFlash drafter, not a target")


def test_target_passed_as_drafter(hybrid_dirs, root):
    for layout in ("hf", "mlx"):
        path = hybrid_dirs[layout]
        _load_error(
            lambda: load_drafter(str(path)), str(path), "not a DFlash drafter", "Qwen3_5ForConditionalGeneration"
        )
    plain = tiny.save_target(
        tiny.build_target(tiny.plain_config(), seed=3), tiny.plain_config(), root / "plain-as-drafter"
    )
    _load_error(lambda: load_drafter(str(plain)), str(plain), "not a DFlash drafter", "Qwen3ForCausalLM")


@pytest.mark.parametrize(
    "change, values",
    [
        ({"hidden": 128}, ("128", "64")),
        ({"vocab": 512}, ("512", str(tiny.VOCAB))),
        ({"taps": [0, 7]}, ("[0, 7]", "4 layers")),
        ({"num_target_layers": 8}, ("8 layers", "4")),
    ],
    ids=["hidden", "vocab", "taps", "depth"],
)
def test_drafter_for_another_target_is_refused(change, values, tmp_path, hybrid_dirs):
    change = dict(change)
    other = tiny.hybrid_config(hidden=change.pop("hidden", 64), vocab=change.pop("vocab", tiny.VOCAB))
    taps = change.pop("taps", None)
    config = tiny.drafter_config(other, version=2, taps=taps, **change)
    path = tiny.save_drafter(tiny.build_drafter(config, seed=24), tmp_path / "drafter-for-another-target")
    drafter = load_drafter(str(path))  # a valid drafter on its own ...
    target = load_target(str(hybrid_dirs["mlx"]))
    # ... refused for this target, before any work is done
    _load_error(lambda: validate_pair(target.runner, drafter.config), *values, "another target")


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupt_target_weights(how, root, hybrid_dirs):
    for layout in ("hf", "mlx"):
        path = _corrupt(hybrid_dirs[layout], root / f"target-{layout}-{how}", how)
        _load_error(lambda: load_target(str(path)), str(path), "corrupt", "re-download")


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupt_drafter_weights(how, root, drafter_dirs):
    for version in ("v2", "v1"):
        path = _corrupt(drafter_dirs[version][1], root / f"drafter-{version}-{how}", how)
        _load_error(lambda: load_drafter(str(path)), str(path), "corrupt", "re-download")


def test_target_weights_not_matching_config(root, hybrid, hybrid_dirs):
    path = root / "target-missing-tensor"
    shutil.copytree(hybrid_dirs["mlx"], path)
    weights = mx.load(str(path / "model.safetensors"))
    gone = "language_model.model.layers.1.mlp.up_proj.weight"
    del weights[gone]
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    _load_error(lambda: load_target(str(path)), str(path), gone)


def test_drafter_weights_not_matching_config(root, drafter_dirs):
    original, src = drafter_dirs["v2"]
    weights = dict(tree_flatten(original.parameters()))
    # a missing tensor
    missing = root / "drafter-missing-tensor"
    shutil.copytree(src, missing)
    gone = dict(weights)
    del gone["layers.1.mlp.up_proj.weight"]
    mx.save_safetensors(str(missing / "model.safetensors"), gone)
    _load_error(lambda: load_drafter(str(missing)), str(missing), "layers.1.mlp.up_proj.weight", "missing")
    # a wrong shape (fc for three taps, the config says two)
    wrong = root / "drafter-wrong-shape"
    shutil.copytree(src, wrong)
    bad = dict(weights)
    bad["fc.weight"] = mx.zeros((64, 3 * 64))
    mx.save_safetensors(str(wrong / "model.safetensors"), bad)
    _load_error(lambda: load_drafter(str(wrong)), str(wrong), "fc.weight", "(64, 192)", "(64, 128)")
    # an unexpected tensor
    extra = root / "drafter-extra-tensor"
    shutil.copytree(src, extra)
    more = dict(weights)
    more["lm_head.weight"] = mx.zeros((tiny.VOCAB, 64))
    mx.save_safetensors(str(extra / "model.safetensors"), more)
    _load_error(lambda: load_drafter(str(extra)), str(extra), "lm_head.weight")


@pytest.mark.parametrize("loader, what", [(load_target, "model"), (load_drafter, "draft model")])
def test_unknown_repo_while_offline(loader, what, monkeypatch, tmp_path):
    import huggingface_hub.constants as hf_constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads HF_HUB_OFFLINE (and the cache location) when it is imported, which
    # mlx-lm has already done: set the module constants too, or the env var has no effect.
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    attempts = []
    real_connect = socket.socket.connect

    def connect(self, address, *args):
        attempts.append(address)
        return real_connect(self, address, *args)

    monkeypatch.setattr(socket.socket, "connect", connect)
    repo = "dflash2-mlx-tests/no-such-model-anywhere"
    message = _load_error(lambda: loader(repo), repo, what, "HF_HUB_OFFLINE")
    assert "local directory" in message
    assert not attempts, f"the offline look-up touched the network: {attempts}"


# --------------------------------------------------------------------------------------------
# the target's context


@pytest.fixture(scope="module")
def short_context(root):
    cfg = tiny.hybrid_config(max_context=32)
    model = tiny.build_target(cfg, seed=51, scale=3.0)
    target = load_target(str(tiny.save_target(model, cfg, root / "hybrid-ctx32", hf_layout=True)))
    drafter = tiny.build_drafter(tiny.drafter_config(cfg, version=2), seed=52)
    return target.runner, drafter


@pytest.mark.parametrize("length", [32, 40])
def test_prompt_longer_than_the_context(short_context, length):
    runner, drafter = short_context
    assert runner.max_context == 32
    prompt = [7 + i % 200 for i in range(length)]
    settings = GenerationSettings(max_tokens=8)
    for start in (
        lambda: generate_autoregressive(runner, prompt, settings),
        lambda: generate_speculative(runner, drafter, prompt, settings),
    ):
        with pytest.raises(PromptTooLong) as excinfo:
            next(start())
        message = str(excinfo.value)
        assert "\n" not in message
        assert str(length) in message and "32" in message and "shorten" in message


@pytest.mark.parametrize("length, expected", [(31, 1), (24, 8)])
def test_generation_stops_at_the_context(short_context, length, expected):
    runner, drafter = short_context
    prompt = [7 + i % 200 for i in range(length)]
    settings = GenerationSettings(max_tokens=100, block_size=4)
    plain = list(generate_autoregressive(runner, prompt, settings))
    spec = list(generate_speculative(runner, drafter, prompt, settings))
    assert len(_tokens(plain)) == expected
    assert _tokens(spec) == _tokens(plain)
    assert plain[-1].stats.finish_reason == spec[-1].stats.finish_reason == "length"
