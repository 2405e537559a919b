"""The staged SmolLM2 drafter build, run end to end with its tiny plan on a tiny llama GGUF."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from test_gguf import write_tiny_gguf

from dflash2_mlx.training.build_smollm2_drafter import COMMITTED_PROMPTS, Build, StagePaused
from dflash2_mlx.training.smollm2_generation import left_pad
from dflash2_mlx.training.smollm2_plan import FULL, STAGES, TINY, StageRecord
from dflash2_mlx.training.smollm2_prompts import KINDS, fold, question_in, read_prompt_set
from dflash2_mlx.training.smollm2_stages import load_sequences


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


def test_left_padding_right_aligns_prompts_to_the_longest_or_the_minimum_length():
    padded = left_pad([[5, 6, 7], [8]], pad_id=0, min_len=2)
    assert padded.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert left_pad([[5]], pad_id=0, min_len=3).tolist() == [[0, 0, 5]]


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


def test_training_sequences_are_the_prompt_tail_then_the_answer_at_one_length(tiny_build):
    plan, work, _, records = tiny_build
    for stage in ("greedy", "sampled"):
        seqs = load_sequences(work / "continuations" / stage, records[stage].outputs["chunks"])
        assert seqs.shape == (records[stage].outputs["sequences"], plan.context_len + plan.continuation_len)
    greedy = load_sequences(work / "continuations" / "greedy", records["greedy"].outputs["chunks"])
    sampled = load_sequences(work / "continuations" / "sampled", records["sampled"].outputs["chunks"])
    assert np.array_equal(greedy[:, : plan.context_len], sampled[:, : plan.context_len])
    assert not np.array_equal(greedy, sampled)


def test_a_window_limit_keeps_the_first_windows_greedy_answers_first(tiny_build):
    plan, work, out, records = tiny_build
    every = Build(plan, work, out).sequences(records["greedy"], records["sampled"])
    greedy = load_sequences(work / "continuations" / "greedy", records["greedy"].outputs["chunks"])
    assert np.array_equal(every[: len(greedy)], greedy)
    first = Build(dataclasses.replace(plan, windows=5), work, out)
    assert np.array_equal(first.sequences(records["greedy"], records["sampled"]), every[:5])


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
    import dflash2_mlx.training.build_smollm2_drafter as build_module
    import dflash2_mlx.training.smollm2_stages as stages

    plan, work, out, records = tiny_build
    committed = tmp_path / "committed"
    monkeypatch.setattr(build_module, "COMMITTED_CONTINUATIONS", committed)
    Build(plan, work, out).save_continuations()
    assert len(list((committed / "greedy").glob("chunk_*.npz"))) == records["greedy"].outputs["chunks"]

    def no_generation(*args, **kwargs):
        raise AssertionError("a committed chunk was generated again")

    monkeypatch.setattr(stages, "generate_batch", no_generation)
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
