"""The real Qwen3.8-27B / DFlash 2 pair, built lazily from the reference configs.

MLX arrays are lazy: constructing the modules without ``mx.eval`` materialises no weight, so the
full-size module trees (about 27B + 1.9B parameters) can be checked on any machine. Every
parameter name and shape of our drafter is compared with the checkpoint table in
``shared/reference/dflash2-weights.md``; the target is built through mlx-lm's own classes and
wrapped in our ``TargetRunner``.
"""

from __future__ import annotations

import copy
import json
import re
import warnings
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from dflash2_mlx.models.drafter import Drafter
from dflash2_mlx.models.drafter_config import DrafterConfig
from dflash2_mlx.models.loading import LoadError, validate_pair
from dflash2_mlx.models.target import TargetRunner

REFERENCE = Path("/work/shared/reference")
TARGET_CONFIG = REFERENCE / "qwen3.8-27b" / "config.json"
DRAFTER_CONFIG = REFERENCE / "qwen3.8-27b-dflash2" / "config.json"
WEIGHTS_TABLE = REFERENCE / "dflash2-weights.md"

pytestmark = pytest.mark.skipif(
    not (TARGET_CONFIG.exists() and DRAFTER_CONFIG.exists() and WEIGHTS_TABLE.exists()),
    reason="shared/reference is not available",
)

# The symbols of dflash2-weights.md for Qwen3.8-27B's drafter.
SYMBOLS = {"H": 5120, "V": 248320, "T": 5, "R": 256, "G": 320, "K": 2, "I": 17408}
DRAFT_LAYERS = 5  # N in 0..4
MEMORY_LIMIT = 100 * 2**20  # "nothing materialised": the real weights are GBs, this is 100 MiB


def _dim(expr: str) -> int:
    """'32*128' -> 4096, '2*K*G' -> 1280, 'H' -> 5120."""
    value = 1
    for factor in expr.split("*"):
        factor = factor.strip()
        value *= SYMBOLS[factor] if factor in SYMBOLS else int(factor)
    return value


def expected_drafter_tensors() -> dict[str, tuple[int, ...]]:
    """The checkpoint table, with symbols substituted and layers.N expanded."""
    rows = re.findall(r"^\|\s*([A-Za-z_][\w.]*)\s*\|\s*\[([^\]]*)\]", WEIGHTS_TABLE.read_text(), re.M)
    assert len(rows) >= 20, f"could not parse the table in {WEIGHTS_TABLE}: {rows}"
    out = {}
    for name, shape in rows:
        dims = tuple(_dim(d) for d in shape.split(","))
        names = [name.replace(".N.", f".{n}.") for n in range(DRAFT_LAYERS)] if ".N." in name else [name]
        for n in names:
            assert n not in out, f"{n} listed twice"
            out[n] = dims
    return out


@pytest.fixture(scope="module")
def drafter_raw() -> dict:
    return json.loads(DRAFTER_CONFIG.read_text())


@pytest.fixture(scope="module")
def target_raw() -> dict:
    return json.loads(TARGET_CONFIG.read_text())


@pytest.fixture(scope="module")
def real_drafter(drafter_raw):
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    drafter = Drafter(DrafterConfig.from_dict(drafter_raw))
    # both relative to what was live before: earlier tests in the process may still hold arrays
    built = (mx.get_active_memory() - before, mx.get_peak_memory() - before)
    return drafter, built


@pytest.fixture(scope="module")
def real_runner(target_raw):
    from mlx_lm.utils import _get_classes

    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    model_class, args_class = _get_classes(target_raw)
    model = model_class(args_class.from_dict(target_raw))
    runner = TargetRunner(model)
    built = (mx.get_active_memory() - before, mx.get_peak_memory() - before)
    return runner, built


def test_weights_table_parses_to_the_documented_symbols(drafter_raw):
    # The substitutions are the reference config's own numbers.
    d = drafter_raw["dflash_config"]
    assert drafter_raw["hidden_size"] == SYMBOLS["H"]
    assert drafter_raw["vocab_size"] == SYMBOLS["V"]
    assert len(d["target_layer_ids"]) == SYMBOLS["T"]
    assert d["selector_rank"] == SYMBOLS["R"]
    assert drafter_raw["hidden_size"] // d["conv_group_size"] == SYMBOLS["G"]
    assert d["conv_kernel_size"] == SYMBOLS["K"]
    assert drafter_raw["intermediate_size"] == SYMBOLS["I"]
    assert drafter_raw["num_hidden_layers"] == DRAFT_LAYERS
    table = expected_drafter_tensors()
    assert len(table) == 3 + 15 * DRAFT_LAYERS + 3  # fc + norms, 15 per layer, the selector
    assert table["candidate_selector.predecessor_codebook"] == (248320, 256)
    assert table["layers.4.attention_conv.kernel_projection.weight"] == (2 * 2 * 320, 5120)


def test_real_drafter_is_built_lazily(real_drafter):
    _, (active, peak) = real_drafter
    assert active < MEMORY_LIMIT, f"building the drafter materialised {active / 2**20:.1f} MiB"
    assert peak < MEMORY_LIMIT, f"building the drafter peaked at {peak / 2**20:.1f} MiB"


def test_real_drafter_names_and_shapes_match_the_checkpoint_table(real_drafter):
    drafter, _ = real_drafter
    ours = {name: tuple(p.shape) for name, p in tree_flatten(drafter.parameters())}
    table = expected_drafter_tensors()
    missing = sorted(set(table) - set(ours))
    extra = sorted(set(ours) - set(table))
    assert not missing, f"our drafter lacks checkpoint tensors: {missing}"
    assert not extra, f"our drafter has tensors the checkpoint does not: {extra}"
    wrong = {n: (ours[n], table[n]) for n in table if ours[n] != table[n]}
    assert not wrong, f"shape mismatches (ours, checkpoint): {wrong}"


def test_real_drafter_parameter_count(real_drafter):
    drafter, _ = real_drafter
    count = sum(p.size for _, p in tree_flatten(drafter.parameters()))
    table_count = 0
    for shape in expected_drafter_tensors().values():
        n = 1
        for d in shape:
            n *= d
        table_count += n
    assert count == table_count
    assert round(count / 1e9, 2) == 1.92, count


def test_real_drafter_config_values(real_drafter):
    cfg = real_drafter[0].config
    assert cfg.is_dflash2
    assert cfg.block_size == 8
    assert cfg.mask_token_id == 248070
    assert cfg.target_layer_ids == [5, 19, 33, 47, 61]
    assert cfg.num_target_layers == 64
    assert cfg.selector_top_k == 16
    assert cfg.sliding_window == 2048 and cfg.context_window == 2047
    # is_causal false: block rows see each other both ways.
    assert not any(cfg.layer_is_causal(i) for i in range(cfg.num_hidden_layers))


def test_real_target_is_built_lazily(real_runner):
    _, (active, peak) = real_runner
    assert active < MEMORY_LIMIT, f"building the target materialised {active / 2**20:.1f} MiB"
    assert peak < MEMORY_LIMIT, f"building the target peaked at {peak / 2**20:.1f} MiB"


def test_real_target_structure(real_runner, target_raw):
    runner, _ = real_runner
    assert runner.num_layers == 64
    assert runner.kinds.count("gdn") == 48
    assert runner.kinds.count("attention") == 16
    assert runner.kinds == ["attention" if i % 4 == 3 else "gdn" for i in range(64)]
    layer_types = target_raw["text_config"]["layer_types"]
    assert runner.kinds == ["attention" if t == "full_attention" else "gdn" for t in layer_types]
    assert runner.hidden_size == 5120
    assert runner.vocab_size == 248320
    assert runner.max_context == 262144
    # Untied LM head of the full vocabulary; embeddings of the same width.
    assert not runner._tied
    assert tuple(runner.outer.lm_head.weight.shape) == (248320, 5120)
    assert tuple(runner.inner.embed_tokens.weight.shape) == (248320, 5120)


def test_real_pair_is_accepted(real_runner, drafter_raw):
    runner, _ = real_runner
    config = DrafterConfig.from_dict(drafter_raw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_pair(runner, config)
        validate_pair(runner, config, target_name="Qwen/Qwen3.8-27B")
    # The drafter taps only layers the target has, and not the last one (see DESIGN.md).
    assert max(config.target_layer_ids) < runner.num_layers - 1


def _refused(runner, raw: dict, *values) -> str:
    config = DrafterConfig.from_dict(raw)
    with pytest.raises(LoadError) as excinfo:
        validate_pair(runner, config)
    message = str(excinfo.value)
    assert "\n" not in message, message
    for v in values:
        assert str(v) in message, f"{v!r} not named in: {message}"
    assert "another target" in message, message
    return message


def test_drafter_for_another_width_is_refused(real_runner, drafter_raw):
    runner, _ = real_runner
    raw = copy.deepcopy(drafter_raw)
    raw["hidden_size"] = 4096
    _refused(runner, raw, 4096, 5120)


def test_drafter_tapping_beyond_the_target_is_refused(real_runner, drafter_raw):
    runner, _ = real_runner
    raw = copy.deepcopy(drafter_raw)
    raw["dflash_config"]["target_layer_ids"] = [5, 19, 33, 47, 70]
    _refused(runner, raw, 70, 64)


def test_drafter_for_another_vocabulary_is_refused(real_runner, drafter_raw):
    runner, _ = real_runner
    raw = copy.deepcopy(drafter_raw)
    raw["vocab_size"] = 151936
    raw["dflash_config"]["mask_token_id"] = 151669
    _refused(runner, raw, 151936, 248320)


def test_drafter_for_another_depth_is_refused(real_runner, drafter_raw):
    runner, _ = real_runner
    raw = copy.deepcopy(drafter_raw)
    raw["num_target_layers"] = 48
    raw["dflash_config"]["target_layer_ids"] = [1, 12, 23, 34, 45]
    _refused(runner, raw, 48, 64)


def test_the_presets_recorded_shapes_are_the_reference_configs():
    """The memory pre-flight sizes a preset's caches from facts recorded in presets.py (nothing is
    downloaded): they must be what the reference config.json files say."""
    from dflash2_mlx.models import memory, presets

    target = memory.TargetShape.from_config(json.loads(TARGET_CONFIG.read_text()))
    drafter = memory.DrafterShape.from_config(json.loads(DRAFTER_CONFIG.read_text()))
    for preset in presets.PRESETS.values():
        assert preset.target_shape == target
        assert preset.drafter_shape == drafter
