"""The memory pre-flight (``dflash2_mlx.models.memory``): a pair that cannot fit is refused in one line,
before anything is downloaded or loaded; what fits is estimated from sizes known without a download."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dflash2_mlx.models import memory, presets


def _cli(*args, env=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "dflash2_mlx", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


PRESET = presets.get_preset("qwen3.8-27b")


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "--prompt", "hi", "--preset", "qwen3.8-27b"],
        ["serve", "--port", "0", "--model", PRESET.target, "--draft-model", PRESET.drafter],
    ],
    ids=["generate", "serve"],
)
def test_the_27b_preset_is_refused_in_one_line_with_8_gb_before_any_download(command, tmp_path):
    """Offline, with an empty Hugging Face cache: had a download been attempted, the error would
    be the offline-mode one; the memory line comes first."""
    env = {"DFLASH2_MLX_MEMORY_GB": "8", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = _cli(*command, env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert (
        line.startswith("error: ")
        and " needs about " in line
        and "this machine has 8.0 GB (DFLASH2_MLX_MEMORY_GB)" in line
    )
    assert "smaller quantization" in line and "--max-context" in line
    assert "offline" not in line and not (tmp_path / "hf" / "hub").exists()


def test_download_refuses_the_preset_before_fetching_anything(monkeypatch):
    from typer.testing import CliRunner

    from dflash2_mlx.cli.app import app
    from dflash2_mlx.models import loading

    calls = []
    monkeypatch.setattr(loading, "_download", lambda *a: calls.append(a))
    monkeypatch.setenv(memory.MEMORY_ENV, "8")
    result = CliRunner().invoke(app, ["download", "--preset", "qwen3.8-27b"])
    assert result.exit_code != 0 and calls == []
    assert "needs about" in str(result.exception) and "has 8.0 GB" in str(result.exception)


def test_load_pair_refuses_before_calling_the_hub(monkeypatch):
    """In process: neither the weights download nor the Hub's metadata is touched for a preset."""
    from dflash2_mlx.models import loading

    calls = []
    monkeypatch.setattr(loading, "_download", lambda *a: calls.append(("download", a)))
    monkeypatch.setattr(memory, "hub_config", lambda *a: calls.append(("config", a)))
    monkeypatch.setattr(memory, "hub_weight_bytes", lambda *a: calls.append(("sizes", a)))
    monkeypatch.setenv(memory.MEMORY_ENV, "8")
    preset = presets.get_preset("qwen3.8-27b")
    with pytest.raises(loading.LoadError, match=r"needs about 2\d\.\d GB .* has 8\.0 GB"):
        loading.load_pair(preset.target, preset.drafter)
    assert calls == []


def test_the_27b_preset_fits_a_32_gb_mac_at_32k_and_not_a_24_gb_one():
    """Weights 15 + 3.7 GB, KV 2 GiB per 32K tokens, 48 recurrent states of 3 MiB: on a Mac
    (rollback by replay, no kept verify states) about 22.6 GB with the 10% margin."""
    preset = presets.get_preset("qwen3.8-27b")
    needed = memory.plan(
        preset.target_shape,
        preset.target_bytes,
        preset.drafter_shape,
        preset.drafter_bytes,
        32768,
        keeps_verify_states=False,
    )
    assert needed.kv_cache == 2 * 2**30
    assert needed.gdn_states == 48 * (3 * 2**20 + 3 * 10240 * 2)
    assert needed.drafter_context == 2 * 5 * 8 * 128 * 2 * 2047
    assert 21e9 < needed.needed < 24e9
    memory.check_fits(needed, 32 * 10**9, "test", "preset")
    with pytest.raises(memory.DoesNotFit):
        memory.check_fits(needed, 22 * 10**9, "test", "preset")
    # the CPU's kept verify states (16 rows x 48 MiB per layer... 48 layers) add 2.25 GiB
    kept = memory.plan(
        preset.target_shape,
        preset.target_bytes,
        preset.drafter_shape,
        preset.drafter_bytes,
        32768,
        keeps_verify_states=True,
    )
    assert kept.verify_states == int(2.25 * 2**30)


def test_a_shorter_context_needs_less(monkeypatch):
    preset = presets.get_preset("qwen3.8-27b")
    monkeypatch.setenv(memory.MEMORY_ENV, "1000")
    long, short = (memory.preflight(preset.target, preset.drafter, context=n) for n in (131072, 4096))
    assert long.kv_cache == 32 * short.kv_cache and long.needed > short.needed


def test_a_local_pair_is_sized_from_its_files(embedded_pair, monkeypatch):
    target, drafter = embedded_pair
    monkeypatch.setenv(memory.MEMORY_ENV, "64")
    needed = memory.preflight(str(target), str(drafter))
    assert needed.target_weights == sum(f.stat().st_size for f in target.glob("*.safetensors"))
    assert needed.drafter_weights == sum(f.stat().st_size for f in drafter.glob("*.safetensors"))
    assert needed.context == 4096  # the model's own context is shorter than the default 32K
    assert needed.kv_cache > 0 and needed.gdn_states > 0 and needed.drafter_context > 0
    monkeypatch.setenv(memory.MEMORY_ENV, "0.01")
    with pytest.raises(memory.DoesNotFit, match="needs about 0.0 GB .* has 0.0 GB"):
        memory.preflight(str(target), str(drafter))


@pytest.mark.parametrize("value,message", [("lots", "is not a number of GB"), ("-3", "must be a positive number")])
def test_a_bad_memory_override_is_a_one_line_error(value, message, embedded_pair, monkeypatch):
    from dflash2_mlx.models.loading import LoadError, load_pair

    monkeypatch.setenv(memory.MEMORY_ENV, value)
    with pytest.raises(LoadError, match=f"DFLASH2_MLX_MEMORY_GB={value!r} is not|{message}") as raised:
        load_pair(str(embedded_pair[0]), str(embedded_pair[1]))
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_the_wired_limit_is_left_alone_without_a_metal_gpu():
    assert memory.set_wired_limit(10**9) is None and memory.wired_limit() is None


def test_the_estimate_counts_kept_verify_states_only_where_rollback_keeps_them(monkeypatch):
    from dflash2_mlx.backend import device
    from dflash2_mlx.caches import target as caches

    shape = presets.QWEN38_27B_SHAPE
    monkeypatch.setenv(caches.ROLLBACK_ENV, "replay")
    assert not memory.keeps_verify_states(shape)
    monkeypatch.setenv(caches.ROLLBACK_ENV, "keep")
    assert memory.keeps_verify_states(shape)
    monkeypatch.setenv(caches.ROLLBACK_ENV, "auto")
    assert memory.keeps_verify_states(shape)  # the CPU: 48 MiB per layer, within the bound
    monkeypatch.setenv(device.PATHS_ENV, "gpu")
    assert not memory.keeps_verify_states(shape)  # the GPU paths replay
