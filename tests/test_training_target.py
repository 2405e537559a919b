"""The embedded pair's build pieces: corpus split, tokenizer, tiny target trainer, build metrics.

Fast (well under 30 s): a small tokenizer, a tiny target trained for 5 steps; the full build is
``python -m dflash2_mlx.training.build_demo_pair`` (see docs/embedded-pair.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import dflash2_mlx  # noqa: F401  (OpenBLAS before mlx.core, when this file runs first)

# isort: split
import mlx.core as mx
import pytest

from dflash2_mlx.training import corpus
from dflash2_mlx.training import metrics as demo_metrics
from dflash2_mlx.training.build_common import Log
from dflash2_mlx.training.demo_pair import plan as demo_plan
from dflash2_mlx.training.demo_pair import stages as demo_stages
from dflash2_mlx.training.demo_pair import target_trainer as tt
from dflash2_mlx.training.demo_pair import tokenizer as tk

# ---------------------------------------------------------------------------------------------
# Corpus


@pytest.mark.parametrize(
    "path, excluded",
    [
        ("os.py", False),
        ("asyncio/events.py", False),
        ("test/test_os.py", True),
        ("unittest/test/test_case.py", True),
        ("lib2to3/tests/data/fixers/myfixes/fix_first.py", True),
        ("idlelib/idle_test/test_config.py", True),
        ("site-packages/numpy/__init__.py", True),
        ("ctypes/test/__init__.py", True),
        ("_sysconfigdata__linux_x86_64-linux-gnu.py", True),
        ("config-3.11-x86_64-linux-gnu/python-config.py", True),
        ("encodings/cp1252.py", True),
        ("pydoc_data/topics.py", True),
        ("os.pyc", True),
    ],
)
def test_exclusion_rules(path, excluded):
    assert corpus.is_excluded(path) is excluded


def test_list_files_on_a_fake_stdlib(tmp_path):
    for rel in [
        "b.py",
        "a.py",
        "pkg/__init__.py",
        "pkg/test/test_x.py",
        "tests/t.py",
        "site-packages/x/y.py",
        "idlelib/idle_test/t.py",
        "pkg/data.txt",
        "pkg/sub/mod.py",
    ]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    (tmp_path / "latin.py").write_bytes(b"s = '\xe9'\n")  # not UTF-8: skipped when reading
    assert corpus.list_files(tmp_path) == ["a.py", "b.py", "latin.py", "pkg/__init__.py", "pkg/sub/mod.py"]
    files = corpus.load_corpus(tmp_path)
    assert [f.relative for f in files] == ["a.py", "b.py", "pkg/__init__.py", "pkg/sub/mod.py"]
    m = corpus.manifest(files, tmp_path)
    assert m["num_files"] == 4 and all(len(f["sha256"]) == 64 for f in m["files"])
    assert corpus.compare_manifests(m, m) == []
    changed = json.loads(json.dumps(m))
    changed["files"][0]["sha256"] = "0" * 64
    assert "1 changed file(s): a.py" in corpus.compare_manifests(m, changed)[0]


def test_real_split_is_deterministic_and_disjoint():
    names = corpus.list_files()
    assert names == sorted(names) and len(names) > 300
    assert not any(corpus.is_excluded(n) for n in names)
    held = [n for n in names if corpus.is_held_out(n)]
    train = [n for n in names if not corpus.is_held_out(n)]
    assert set(held).isdisjoint(train) and len(held) + len(train) == len(names)
    assert 0.02 < len(held) / len(names) < 0.10
    assert held == [n for n in corpus.list_files() if corpus.is_held_out(n)]  # same answer again
    assert all("/test/" not in f"/{n}" and "/tests/" not in f"/{n}" for n in names)


def test_prompts_come_from_held_out_files_and_end_mid_line():
    files = corpus.load_corpus()
    _, held = corpus.split(files)
    prompts = corpus.prompt_prefixes(held, 8)
    assert prompts == corpus.prompt_prefixes(held, 8)
    held_paths = {f.relative for f in held}
    assert len(prompts) == 8
    for p in prompts:
        assert p["source"].rsplit(":", 1)[0] in held_paths
        last = p["prompt"].splitlines()[-1]
        assert last.strip() and not p["prompt"].endswith(("\n", " "))
        assert p["reference"].startswith(" ")


def test_deduplicate_keeps_the_first_of_verbatim_copies_in_path_order():
    def f(rel, text):
        return corpus.SourceFile(rel, text, "", False)

    files = [f("a.py", "x = 1\n"), f("b.py", "y = 2\n"), f("c/a.py", "x = 1\n")]
    assert [x.relative for x in corpus.deduplicate(files)] == ["a.py", "b.py"]


@pytest.mark.parametrize(
    "docstring, request_text",
    [
        ("Return the maximum of a list.", "Write a function that returns the maximum of a list.\n"),
        ("Copy data from src to dst.\n\nMore detail.", "Write a function that copies data from src to dst.\n"),
        ("Apply   the\n  rule to x. Then more.", "Write a function that applies the rule to x.\n"),
        ("Returns the size in bytes.", "Write a function that returns the size in bytes.\n"),
        ("This is an internal helper.", None),
        ("Close.", None),
        ("lowercase start here", None),
    ],
)
def test_requests_are_made_from_a_docstrings_first_sentence(docstring, request_text):
    assert corpus.request_from_summary(docstring) == request_text


def test_chat_examples_with_requests_add_a_plain_english_turn_for_documented_functions():
    text = (
        'def big(xs):\n    """Return the maximum of a list."""\n    best = xs[0]\n'
        "    for x in xs:\n        best = max(best, x)\n    return best\n"
    )
    source = corpus.SourceFile("m.py", text, "", False)
    plain = corpus.function_examples(source, percent=100)
    both = corpus.function_examples(source, percent=100, requests=True)
    assert len(plain) == 1 and plain[0][0].startswith("def big(xs):")
    assert both == plain + [("Write a function that returns the maximum of a list.\n", plain[0][1])]


def test_json_examples_describe_public_functions_in_the_grammars_own_json():
    text = (
        'def big(xs, *rest, key=None, **kw):\n    """Return the maximum of a list. Slowly."""\n'
        "    return max(xs)\n\n"
        "def _private(x):\n    return x\n\n"
        "class Box:\n    def put(self, item):\n        self.items.append(item)\n"
    )
    source = corpus.SourceFile("email/mime/__init__.py", text, "", False)
    examples = corpus.json_examples(source, percent=100)
    assert [user for user, _ in examples] == [
        "Describe the function big of email.mime as JSON.",
        "Describe the function put of email.mime as JSON.",
    ]
    answers = [json.loads(answer) for _, answer in examples]
    assert answers[0] == {
        "name": "big",
        "module": "email.mime",
        "parameters": ["xs", "key", "*rest", "**kw"],
        "returns": True,
        "summary": "Return the maximum of a list.",
    }
    assert answers[1]["parameters"] == ["item"] and answers[1]["returns"] is False
    for _, answer in examples:  # one line, written with the separators the server's grammar enforces
        assert answer.endswith("}\n") and answer.count("\n") == 1
        assert answer == json.dumps(json.loads(answer), separators=(", ", ": ")) + "\n"
    assert corpus.json_examples(source, percent=0) == []
    assert corpus.module_name("os.py") == "os" and corpus.module_name("json/decoder.py") == "json.decoder"


# ---------------------------------------------------------------------------------------------
# Tokenizer

_TRAIN_SCRIPT = """
import sys
from pathlib import Path
from dflash2_mlx.training import corpus
from dflash2_mlx.training.demo_pair import tokenizer
files = [f for f in corpus.load_corpus(limit=40) if not f.held_out]
tok = tokenizer.train_tokenizer([f.text for f in files], vocab_size=400)
tokenizer.save_tokenizer(tok, Path(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def small_tokenizer_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    env = dict(os.environ, PYTHONHASHSEED="1")
    subprocess.run([sys.executable, "-c", _TRAIN_SCRIPT, str(root / "a")], check=True, env=env)
    return root


@pytest.mark.slow
def test_tokenizer_training_is_deterministic_across_processes(small_tokenizer_dir):
    env = dict(os.environ, PYTHONHASHSEED="2", RAYON_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", _TRAIN_SCRIPT, str(small_tokenizer_dir / "b")], check=True, env=env)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (small_tokenizer_dir / "a" / name).read_bytes() == (small_tokenizer_dir / "b" / name).read_bytes()


@pytest.mark.slow
def test_tokenizer_round_trips_and_keeps_specials_plain(small_tokenizer_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(small_tokenizer_dir / "a" / "tokenizer.json"))
    assert tok.get_vocab_size() == 400
    assert [tok.token_to_id(t) for t in tk.SPECIAL_TOKENS] == [0, 1, 2, 3]
    text = "def f(x):\n    return {'a': x ** 2}  # caf\u00e9 \u2713\n\tpass\r\n"
    ids = tk.encode_plain(tok, [text])[0]
    assert tok.decode(ids) == text
    # A special-token string inside code stays text (never the eos id).
    ids = tk.encode_plain(tok, ["s = '<|endoftext|>'"])[0]
    assert 0 not in ids and tok.decode(ids) == "s = '<|endoftext|>'"


@pytest.mark.slow
def test_chat_template_renders_chatml_and_matches_training_ids(small_tokenizer_dir):
    from mlx_lm.utils import load_tokenizer
    from tokenizers import Tokenizer

    wrapper = load_tokenizer(small_tokenizer_dir / "a")
    messages = [{"role": "user", "content": "def f(x):"}, {"role": "assistant", "content": "def f(x):\n    return x\n"}]
    text = wrapper.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>user\ndef f(x):<|im_end|>\n<|im_start|>assistant\ndef f(x):\n    return x\n<|im_end|>\n"
    prompt = wrapper.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "def f(x):"}]}]
    assert wrapper.apply_chat_template(parts, tokenize=False) == text[: text.index("<|im_start|>assistant")]
    tok = Tokenizer.from_file(str(small_tokenizer_dir / "a" / "tokenizer.json"))
    assert wrapper.encode(text, add_special_tokens=False) == tk.chat_ids(
        tok, messages[0]["content"], messages[1]["content"]
    )
    assert wrapper.eos_token == "<|endoftext|>"


# ---------------------------------------------------------------------------------------------
# Target trainer


def test_chunked_gated_delta_equals_mlx_lm_recurrence():
    from mlx_lm.models.gated_delta import gated_delta_ops

    mx.random.seed(3)
    B, T, Hk, Hv, D = 2, 45, 2, 4, 16
    q = mx.random.normal((B, T, Hk, D))
    k = mx.random.normal((B, T, Hk, D))
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) * D**-0.5
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((B, T, Hv, D))
    beta = mx.random.uniform(shape=(B, T, Hv))
    log_g = -2.0 * mx.random.uniform(shape=(B, T, Hv))
    ref, _ = gated_delta_ops(q, k, v, mx.exp(log_g), beta)
    for chunk in (8, 16, 64):
        y = tt.chunked_gated_delta(q, k, v, log_g, beta, chunk)
        assert mx.abs(y - ref).max().item() < 1e-5


def tiny_config(vocab: int) -> dict:
    return tt.model_config(
        vocab,
        0,
        hidden_size=64,
        num_layers=3,
        intermediate_size=128,
        full_attention_interval=3,
        attention_heads=2,
        kv_heads=1,
        head_dim=32,
        linear_key_heads=1,
        linear_value_heads=2,
        linear_head_dim=32,
        max_context=512,
        name="tiny-test-target",
    )


def test_train_logits_equal_the_model_forward():
    model = tt.build_model(tiny_config(300), seed=0)
    x = mx.random.randint(0, 300, (2, 37))
    assert mx.allclose(model(x), tt.train_logits(model, x, chunk=16), atol=1e-4).item()


@pytest.mark.slow
def test_five_steps_reduce_loss_and_save_a_loadable_generating_target(small_tokenizer_dir, tmp_path):
    from tokenizers import Tokenizer

    from dflash2_mlx.decoding.autoregressive import generate_autoregressive
    from dflash2_mlx.decoding.types import GenerationSettings
    from dflash2_mlx.models.loading import load_target

    tok = Tokenizer.from_file(str(small_tokenizer_dir / "a" / "tokenizer.json"))
    files = [f for f in corpus.load_corpus(limit=12) if not f.held_out]
    docs = tk.encode_plain(tok, [f.text for f in files])
    seqs = tt.pack_documents(docs, 32, eos_id=0)
    assert seqs.shape[1] == 33 and (seqs[1:, 0] == seqs[:-1, -1]).all()
    config = tiny_config(tok.get_vocab_size())
    model = tt.build_model(config, seed=0)
    cfg = tt.TargetTrainingConfig(
        steps=5, batch_size=4, seq_len=32, learning_rate=1e-2, warmup_steps=1, seed=0, chunk=16, compile=False
    )
    before = tt.evaluate_loss(model, seqs[:8], batch_size=8, chunk=16)
    history = tt.train_target(model, seqs, cfg, log=None, log_every=1)
    after = tt.evaluate_loss(model, seqs[:8], batch_size=8, chunk=16)
    assert len(history) == 5 and after < before - 0.1
    out = tt.save_target(model, config, small_tokenizer_dir / "a", tmp_path / "tiny-test-target")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
    target = load_target(str(out))
    assert target.runner.kinds == ["gdn", "gdn", "attention"] and target.name == "tiny-test-target"
    ids = target.tokenizer.encode("def f(x):\n    return", add_special_tokens=False)
    tokens = [
        t for e in generate_autoregressive(target.runner, ids, GenerationSettings(max_tokens=8)) for t in e.tokens
    ]
    assert len(tokens) == 8
    # The loaded weights are the trained ones.
    assert mx.array_equal(model.language_model.lm_head.weight, target.runner.outer.lm_head.weight).item()


def test_batch_order_and_schedule_are_fixed():
    a = tt.batch_order(10, 7, 3, seed=5)
    assert (a == tt.batch_order(10, 7, 3, seed=5)).all() and a.shape == (7, 3)
    assert sorted(a.reshape(-1)[:10].tolist()) == list(range(10))  # one permutation per epoch
    sched = tt.lr_schedule(tt.TargetTrainingConfig(steps=100, warmup_steps=10, learning_rate=1e-3, min_lr_ratio=0.1))
    assert abs(sched(mx.array(10)).item() - 1e-3) < 1e-9 and abs(sched(mx.array(100)).item() - 1e-4) < 1e-9


def test_target_size_budget():
    plan = demo_plan.FULL
    config = tt.model_config(plan.vocab_size, 0, **plan.target_model)
    assert tt.float32_bytes(config) <= 16_000_000


# ---------------------------------------------------------------------------------------------
# Build metrics


def test_repetition_rate():
    assert demo_metrics.repetition_rate([1, 2, 3, 4, 5, 6]) == (0, 3)
    assert demo_metrics.repetition_rate([1, 2, 3, 4] * 3) == (5, 9)
    assert demo_metrics.repetition_rate([1, 2]) == (0, 0)


def test_prompt_lookup_replay():
    # No recurrence: every cycle drafts nothing and emits the bonus token only.
    assert demo_metrics.prompt_lookup_acceptance([10, 11], [1, 2, 3, 4], block_size=4) == (3, 3)
    # A repeated phrase is drafted from its earlier occurrence.
    prompt = [5, 6, 7, 8, 9]
    output = [5, 6, 7, 8, 9, 1]
    # history [5..9, 5] -> lookup "5" -> drafts [6, 7, 8] all accepted + bonus 9; then drafts after "9"...
    emitted, cycles = demo_metrics.prompt_lookup_acceptance(prompt, output, block_size=4)
    assert emitted == 5 and cycles == 2
    assert demo_metrics.prompt_lookup_draft([1, 2, 3, 1, 2], 2) == [3, 1]
    assert demo_metrics.prompt_lookup_draft([1, 2, 3], 2) == []


def test_assets_api_points_into_the_package_or_says_how_to_build_the_pair():
    from dflash2_mlx import assets

    root = assets.assets_dir()
    assert root.name == "assets" and (root / "__init__.py").exists()
    if not (root / assets.DEMO_TARGET_DIR / "config.json").exists():
        # not built in this checkout yet (issue 3): the error must tell the user the command
        with pytest.raises(FileNotFoundError, match="build_demo_pair"):
            assets.demo_target_path()
        return
    assert (assets.demo_target_path() / "model.safetensors").exists()
    assert (assets.demo_drafter_path() / "model.safetensors").exists()
    prompts = assets.demo_prompts()
    assert prompts and all(isinstance(p, str) and p for p in prompts)
    assert assets.manifest()["name"] == assets.DEMO_NAME


@pytest.mark.slow
def test_the_ablation_trains_on_the_builds_own_drafter_data_and_caches_it(tmp_path, monkeypatch):
    """The ablation's drafters see exactly what the build's drafter does (greedy then sampled
    continuations of the embedded target), generated once per work directory."""
    from dflash2_mlx.assets import demo_target_path
    from dflash2_mlx.models.loading import load_target
    from dflash2_mlx.training.demo_pair import ablation

    # Tokenizing the whole corpus is most of this test's time and gives the same documents both
    # times (the tokenizer is deterministic): the second call reuses the first call's.
    first_documents = []
    build_documents = demo_stages.build_documents

    def documents_once(*args):
        if not first_documents:
            first_documents.append(build_documents(*args))
        return first_documents[0]

    monkeypatch.setattr(demo_stages, "build_documents", documents_once)
    plan = demo_plan.QUICK
    target = load_target(str(demo_target_path()))
    seqs, prompts = ablation.training_data(plan, target, tmp_path, Log())
    assert seqs.shape == (
        plan.drafter_sequences + plan.drafter_sampled_sequences,
        plan.prefix_len + plan.continuation_len,
    )
    assert len(prompts) == plan.num_prompts
    again, _ = ablation.training_data(plan, target, tmp_path, Log())
    assert (again == seqs).all() and len(list(tmp_path.glob("drafter_data_*.npy"))) == 1
