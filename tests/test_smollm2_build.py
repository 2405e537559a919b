"""The staged SmolLM2 drafter build, run end to end with its tiny plan on a tiny llama GGUF."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from test_gguf import write_tiny_gguf

from dflash2_mlx.training.smollm2.build import COMMITTED_PROMPTS, Build, StagePaused
from dflash2_mlx.training.smollm2.generation import answer_prompts
from dflash2_mlx.training.smollm2.plan import FULL, STAGES, TINY, StageRecord
from dflash2_mlx.training.smollm2.prompts import KINDS, fold, question_in, read_prompt_set
from dflash2_mlx.training.smollm2.stages import load_sequences, load_windows, make_windows, window_features


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory):
    """The tiny plan built once to its end; returns (plan, work, out, the first run's records)."""
    root = tmp_path_factory.mktemp("smol")
    write_tiny_gguf(root / "m.gguf", "llama", seed=3)
    plan = dataclasses.replace(TINY, target=str(root / "m.gguf"))
    work, out = root / "work", root / "out"
    first = Build(plan, work, out)
    records = first.run()
    assert first.ran == list(STAGES)
    return plan, work, out, records


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from dflash2_mlx.models.loading import load_target

    path = tmp_path_factory.mktemp("alone") / "m.gguf"
    write_tiny_gguf(path, "llama", seed=5)
    return load_target(str(path))


def _alone(target, prompt, max_tokens, stops=(), sampling=None, seed=0):
    """The engine's plain decoding of ``prompt`` (greedy), or answer_prompts with it alone."""
    if sampling is None:
        from dflash2_mlx.decoding.autoregressive import generate_autoregressive
        from dflash2_mlx.decoding.types import GenerationSettings

        settings = GenerationSettings(max_tokens=max_tokens, stop_token_ids=list(stops))
        return [t for e in generate_autoregressive(target.runner, prompt, settings) for t in e.tokens]
    return answer_prompts(target.runner, [prompt], max_tokens, sampling, seed=seed, stop_ids=stops)[0].tolist()


def test_every_batched_answer_and_its_features_equal_the_prompt_answered_alone(tiny_target):
    """Issue 40: prompts of different lengths in one call, no padding seen, each answer what the
    engine writes for it alone and stopped at its end token; its window's features those of its
    whole prompt + answer alone."""
    import mlx.core as mx

    from dflash2_mlx.decoding.sampling import SamplingSettings

    rng = np.random.default_rng(0)
    vocab = tiny_target.runner.vocab_size
    prompts = [rng.integers(3, vocab, size=n).tolist() for n in (5, 23, 9, 23, 14, 40, 2)]
    max_tokens, context = 20, 12
    plain = [_alone(tiny_target, p, max_tokens) for p in prompts]
    # an end token: the 4th token prompt 1's answer writes (not written before it there)
    stop = next(t for t in plain[1][3:] if t not in plain[1][:3])
    stopped = [_alone(tiny_target, p, max_tokens, stops=[stop]) for p in prompts]
    assert stopped[1][-1] == stop and len(stopped[1]) < max_tokens
    for method in ("padded", "equal"):
        batched = answer_prompts(tiny_target.runner, prompts, max_tokens, stop_ids=[stop], method=method)
        assert [a.tolist() for a in batched] == stopped, method
    assert [a.tolist() for a in answer_prompts(tiny_target.runner, prompts, max_tokens)] == plain
    # sampled: each prompt's draws are its own, whatever the batch
    sampling = SamplingSettings(0.9, 0.95)
    batched = answer_prompts(tiny_target.runner, prompts, max_tokens, sampling, seed=7, stop_ids=[stop])
    for prompt, answer in zip(prompts, batched):
        assert answer.tolist() == _alone(tiny_target, prompt, max_tokens, [stop], sampling, seed=7)
    assert [a.tolist() for a in batched] != stopped

    # features of the windows (the prompt's tail, the answer, fill) against each prompt + answer alone
    answers = answer_prompts(tiny_target.runner, prompts, max_tokens, stop_ids=[stop])
    windows = make_windows(prompts, answers, context, max_tokens)
    assert windows.starts.tolist() == [min(len(p), context) for p in prompts]
    taps = [0, 1]
    feats, final = window_features(tiny_target.runner, windows, taps, final=True)
    runner = tiny_target.runner
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        real = int(windows.lengths[i])
        assert windows.sequences[i, :real].tolist() == (prompt[-context:] + answer.tolist())
        whole = mx.array([prompt + answer.tolist()], dtype=mx.int32)
        _, alone = runner(whole, runner.make_cache(), taps=taps + [len(runner.layers) - 1], logits_from=whole.shape[1])
        begin = len(prompt) - int(windows.starts[i])
        width = len(taps) * runner.hidden_size
        np.testing.assert_allclose(np.array(feats[i, :real]), np.array(alone[0, begin:, :width]), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(
            np.array(final[i, :real]), np.array(runner.inner.norm(alone[0, begin:, width:])), rtol=1e-4, atol=1e-5
        )
        assert not np.array(feats[i, real:]).any()


@pytest.mark.parametrize(
    "written,question",
    [
        ('A student might ask: "What is a bicycle?"', "What is a bicycle?"),
        ("The answer to this is: What is the sum of the first n numbers?", "What is the sum of the first n numbers?"),
        ("Sure. Here is one: how do bees make honey? They collect nectar.", "how do bees make honey?"),
        ("What is a rainbow?", "What is a rainbow?"),
        ("What a wonderful topic! Networks are the backbone of the internet.", None),
    ],
)
def test_a_question_is_taken_from_what_the_target_wrote_around_it(written, question):
    assert question_in(written) == question


def test_the_prompt_set_holds_out_every_kind_and_shares_no_request_with_training(tiny_build):
    plan, work, _, _ = tiny_build
    rows = read_prompt_set(work / "prompts.jsonl")
    held = [r for r in rows if r["split"] == "heldout"]
    assert sorted(r["kind"] for r in held) == sorted(k for k in KINDS if plan.heldout_per_kind[k])
    train_requests = {fold(r["messages"][0]["content"]) for r in rows if r["split"] == "train"}
    assert not train_requests & {fold(r["messages"][0]["content"]) for r in held}
    assert all(
        r["prompt"].startswith("<|im_start|>user\n") and r["prompt"].endswith("<|im_start|>assistant\n") for r in rows
    )


def test_training_windows_are_the_prompt_tail_then_the_answer_stopped_at_its_end(tiny_build):
    plan, work, _, records = tiny_build
    width = plan.context_len + plan.continuation_len
    for stage in ("greedy", "sampled"):
        windows = load_windows(work / "continuations" / stage, records[stage].outputs["chunks"])
        assert windows.sequences.shape == (records[stage].outputs["sequences"], width)
        for i, prompt in enumerate(windows.prompts):
            start, length = int(windows.starts[i]), int(windows.lengths[i])
            assert start == min(len(prompt), plan.context_len) and start < length <= width
            assert windows.sequences[i, :start].tolist() == prompt[-plan.context_len :].tolist()
            answer = windows.answer(i).tolist()
            assert len(answer) == plan.continuation_len or answer[-1] == 2  # the tiny GGUF's <|im_end|>
            assert 2 not in answer[:-1]  # nothing after the end token
    greedy = load_windows(work / "continuations" / "greedy", records["greedy"].outputs["chunks"])
    sampled = load_windows(work / "continuations" / "sampled", records["sampled"].outputs["chunks"])
    assert [p.tolist() for p in greedy.prompts] == [p.tolist() for p in sampled.prompts]
    assert not np.array_equal(greedy.sequences, sampled.sequences)


def test_a_chunk_made_before_issue_40_is_never_reused(tiny_build, tmp_path):
    """The committed chunks of the left-padded recipe have no lengths: a chunk file of that
    layout is generated again even if its key matched."""
    import dflash2_mlx.training.smollm2.stages as stages

    plan, work, _, _ = tiny_build
    chunk = sorted((work / "continuations" / "greedy").glob("chunk_*.npz"))[0]
    with np.load(chunk) as data:
        key = str(data["key"])
        old = {"sequences": data["sequences"], "prompt_tokens": data["prompt_tokens"], "key": data["key"]}
    assert stages._chunk_done(chunk, key)
    np.savez(tmp_path / "chunk_00000.npz", **old)
    assert not stages._chunk_done(tmp_path / "chunk_00000.npz", key)


def test_a_window_limit_keeps_the_first_windows_greedy_answers_first(tiny_build):
    plan, work, out, records = tiny_build
    every = Build(plan, work, out).sequences(records["greedy"], records["sampled"]).sequences
    greedy = load_sequences(work / "continuations" / "greedy", records["greedy"].outputs["chunks"])
    assert np.array_equal(every[: len(greedy)], greedy)
    first = Build(dataclasses.replace(plan, windows=5), work, out)
    assert np.array_equal(first.sequences(records["greedy"], records["sampled"]).sequences, every[:5])


def test_the_build_writes_a_manifest_a_model_card_and_a_drafter_identical_to_plain_decoding(tiny_build):
    plan, _, out, _ = tiny_build
    manifest = json.loads((out / "MANIFEST.json").read_text())
    evaluation = manifest["stages"]["evaluate"]["outputs"]
    assert evaluation["identical_to_autoregressive"] is True
    assert evaluation["prompts"] == sum(plan.heldout_per_kind.values())
    assert evaluation["acceptance_length_t0"] >= 1.0 and evaluation["acceptance_length_t07"] >= 1.0
    assert set(manifest["timings_seconds"]) == set(STAGES)
    card = (out / "README.md").read_text()
    assert "Apache-2.0" in card and "SmolLM2" in card and "| train |" in card
    assert json.loads((out / "config.json").read_text())["dflash_config"]["target_layer_ids"] == list(plan.drafter_taps)
    held = [json.loads(line) for line in (out / "heldout_prompts.jsonl").read_text().splitlines()]
    assert len(held) == evaluation["prompts"] and all(set(row) == {"messages"} for row in held)


def test_a_rerun_skips_every_finished_stage(tiny_build):
    plan, work, out, _ = tiny_build
    again = Build(plan, work, out)
    again.run()
    assert again.ran == []


def test_a_build_killed_inside_a_stage_redoes_only_the_lost_chunk_and_the_stages_after(tiny_build):
    plan, work, out, records = tiny_build
    # a kill while the last greedy chunk was being written: that chunk and the stage marker are missing
    chunks = sorted((work / "continuations" / "greedy").glob("chunk_*.npz"))
    chunks[-1].unlink()
    StageRecord.path(work, "greedy").unlink()
    resumed = Build(plan, work, out)
    redone = resumed.run()
    assert resumed.ran == ["greedy"]  # same data again (deterministic), so train and evaluate keep their keys
    assert redone["greedy"].outputs["chunks_reused"] == len(chunks) - 1
    assert redone["greedy"].outputs["sha256"] == records["greedy"].outputs["sha256"]


def test_training_paused_part_way_goes_on_to_the_weights_of_an_uninterrupted_build(tiny_build, tmp_path):
    plan, _, _, records = tiny_build
    with pytest.raises(StagePaused, match="paused at step 2"):
        Build(plan, tmp_path / "work", tmp_path / "out", train_until_step=2).run()
    assert not StageRecord.path(tmp_path / "work", "train").exists()
    resumed = Build(plan, tmp_path / "work", tmp_path / "out")
    finished = resumed.run()
    assert resumed.ran == ["train", "evaluate"]
    assert finished["train"].outputs["weights_sha256"] == records["train"].outputs["weights_sha256"]


def test_the_committed_prompt_set_has_held_out_prompts_of_every_kind():
    rows = read_prompt_set(COMMITTED_PROMPTS)
    held = [r for r in rows if r["split"] == "heldout"]
    assert len(held) >= 24 and {r["kind"] for r in held} == set(KINDS)
    assert len({fold(r["messages"][0]["content"]) for r in rows}) == len(rows)


def test_a_fresh_full_build_reuses_the_committed_prompt_set_without_running_the_target(tmp_path, monkeypatch):
    def no_target(self):
        raise AssertionError("the prompts stage loaded the target")

    monkeypatch.setattr(Build, "target", property(no_target))
    record = Build(FULL, tmp_path / "work", tmp_path / "out").prompts()
    assert record.outputs["counts"] == {"reused_committed": True}
    assert (tmp_path / "work" / "prompts.jsonl").read_bytes() == COMMITTED_PROMPTS.read_bytes()


def test_committed_continuation_chunks_are_copied_instead_of_generated(tiny_build, tmp_path, monkeypatch):
    import dflash2_mlx.training.smollm2.build as build_module
    import dflash2_mlx.training.smollm2.stages as stages

    plan, work, out, records = tiny_build
    committed = tmp_path / "committed"
    monkeypatch.setattr(build_module, "COMMITTED_CONTINUATIONS", committed)
    Build(plan, work, out).save_continuations()
    assert len(list((committed / "greedy").glob("chunk_*.npz"))) == records["greedy"].outputs["chunks"]

    def no_generation(*args, **kwargs):
        raise AssertionError("a committed chunk was generated again")

    monkeypatch.setattr(stages, "answer_prompts", no_generation)
    fresh = Build(plan, tmp_path / "work", tmp_path / "out")
    again = fresh.run("sampled")
    for name in ("greedy", "sampled"):
        assert again[name].outputs["sha256"] == records[name].outputs["sha256"]
        assert again[name].outputs["chunks_copied_from_committed"] == records[name].outputs["chunks"]
    # a chunk whose inputs changed is generated, not copied
    monkeypatch.undo()
    monkeypatch.setattr(build_module, "COMMITTED_CONTINUATIONS", committed)
    longer = Build(
        dataclasses.replace(plan, continuation_len=plan.continuation_len + 1), tmp_path / "w2", tmp_path / "o2"
    )
    assert longer.run("greedy")["greedy"].outputs["chunks_copied_from_committed"] == 0
