"""A draft vocabulary: the DFlash 2 drafter scores only some token ids, losslessly.

The drafter's head is the target's; with a draft vocabulary it reads only those rows
(``TargetRunner.head_rows``), the selector maps its candidates back to token ids, and verification
is unchanged, so decoding stays identical to plain decoding whatever the vocabulary holds (a token
outside it is simply never drafted). The sampled distribution is pinned in test_sampling.py.
"""

from __future__ import annotations

import json
import random
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten

from dflash2_mlx.decoding.autoregressive import generate_autoregressive
from dflash2_mlx.decoding.speculative import generate_speculative
from dflash2_mlx.decoding.types import GenerationSettings
from dflash2_mlx.models.drafter_config import ConfigError
from dflash2_mlx.models.loading import LoadError, load_drafter
from dflash2_mlx.models.target import TargetRunner
from dflash2_mlx.training.drafter.draft_vocab import (
    choose_draft_vocab,
    continuation_token_counts,
    coverage,
    write_draft_vocab,
)


def _tokens(events):
    return [t for e in events for t in e.tokens]


def _ids(values) -> mx.array:
    return mx.array(sorted(values), dtype=mx.int32)


@pytest.mark.parametrize("head", ["untied lm_head", "tied embedding", "quantized tied embedding"])
def test_a_head_over_some_rows_equals_those_columns_of_the_whole_head(head):
    cfg = tiny.plain_config(hidden=64)
    cfg["tie_word_embeddings"] = head != "untied lm_head"
    model = tiny.build_target(cfg, seed=2)
    if head.startswith("quantized"):
        nn.quantize(model, group_size=32, bits=4)
        mx.eval(model.parameters())
    runner = TargetRunner(model)
    ids = _ids(random.Random(0).sample(range(tiny.VOCAB), 37))
    hidden = mx.random.normal((1, 7, 64), key=mx.random.key(3))
    whole = runner.lm_head(hidden)
    rows = runner.head_rows(ids)(hidden)
    assert rows.shape == (1, 7, 37)
    np.testing.assert_allclose(np.array(rows), np.array(whole[..., ids]), rtol=1e-5, atol=1e-5)
    assert runner.head_rows(ids) is runner.head_rows(ids)  # made once per vocabulary, not per request


def _vocab_case(rng: random.Random, target, prompt, plain, seen: Counter):
    cfg, model = target
    block = rng.randint(2, 12)
    dcfg = tiny.drafter_config(cfg, version=2, block_size=16)
    base = tiny.build_drafter(dcfg, seed=rng.randrange(1000))
    continuation = prompt + plain
    corrupt = {p for p in range(len(prompt) + 1, len(continuation)) if rng.random() < 0.1}
    drafter = tiny.OracleDrafter(dcfg, continuation, corrupt)
    drafter.load_weights(tree_flatten(base.parameters()))
    # a vocabulary holding a random share of the answer's own tokens, and random others
    answer = sorted(set(plain))
    kept = {t for t in answer if rng.random() < rng.choice([0.5, 0.9, 1.0])}
    outside = [t for t in range(tiny.VOCAB) if t not in set(answer)]
    size = rng.randint(max(dcfg.selector_top_k, len(kept)), len(kept) + len(outside))
    others = rng.sample(outside, size - len(kept))
    drafter.set_draft_vocab(_ids(kept | set(others)))
    settings = GenerationSettings(max_tokens=len(plain), block_size=block)
    events = list(generate_speculative(TargetRunner(model), drafter, prompt, settings))
    assert _tokens(events) == plain
    vocab = set(np.array(drafter.draft_vocab).tolist())
    seen["accepted"] += sum(e.accepted or 0 for e in events)
    seen["answer tokens outside the vocabulary"] += sum(t not in vocab for t in plain)


def test_speculative_greedy_with_a_draft_vocabulary_equals_plain_greedy(hybrid_target, plain_target):
    rng = random.Random(20261206)
    seen: Counter = Counter()
    for case in range(24):
        target = hybrid_target if case % 2 else plain_target
        prompt = [rng.randrange(0, tiny.VOCAB - 4) for _ in range(rng.randint(1, 12))]
        plain = _tokens(generate_autoregressive(TargetRunner(target[1]), prompt, GenerationSettings(max_tokens=32)))
        _vocab_case(rng, target, prompt, plain, seen)
    # drafts were accepted, and the vocabularies left out tokens the target then emitted
    assert seen["accepted"] > 100 and seen["answer tokens outside the vocabulary"] > 10, seen


def test_the_selector_proposes_only_draft_vocabulary_ids(hybrid_target):
    cfg, model = hybrid_target
    drafter = tiny.build_drafter(tiny.drafter_config(cfg, version=2, block_size=8), seed=4)
    vocab = set(range(0, tiny.VOCAB, 7))
    drafter.set_draft_vocab(_ids(vocab))
    head = TargetRunner(model).head_rows(drafter.draft_vocab)
    hidden = mx.random.normal((2, 7, 64), key=mx.random.key(5))
    logits = drafter.logits(hidden, head)  # [2, 7, 43]: one column per vocabulary id
    anchor = mx.array([5, 9], dtype=mx.int32)
    selector = drafter.candidate_selector
    greedy = selector.greedy(hidden, logits, anchor)
    candidates_walked, _ = selector.pair_scores(hidden, logits, anchor)
    for proposed in (greedy, candidates_walked):
        assert set(np.array(proposed).ravel().tolist()) <= vocab
    # the greedy path is the whole head's path when the whole head's candidates are in the vocabulary
    assert logits.shape == (2, 7, len(vocab))


def test_a_draft_vocabulary_of_every_id_drafts_as_the_whole_head(hybrid_target):
    cfg, model = hybrid_target
    dcfg = tiny.drafter_config(cfg, version=2, block_size=8)
    settings = GenerationSettings(max_tokens=40, block_size=8)
    runs = []
    for vocab in (None, mx.arange(tiny.VOCAB, dtype=mx.int32)):
        drafter = tiny.build_drafter(dcfg, seed=6)
        drafter.set_draft_vocab(vocab)
        events = list(generate_speculative(TargetRunner(model), drafter, [3, 1, 4, 1, 5], settings))
        runs.append([(tuple(e.tokens), e.accepted) for e in events])
    assert runs[0] == runs[1]


def test_a_dflash1_drafter_has_no_draft_vocabulary(hybrid_target):
    cfg, _ = hybrid_target
    with pytest.raises(ConfigError, match="DFlash 2 option"):
        tiny.drafter_config(
            cfg, version=1, dflash_config={"block_size": 8, "mask_token_id": 299, "draft_vocab_size": 8}
        )
    drafter = tiny.build_drafter(tiny.drafter_config(cfg, version=1, block_size=8))
    with pytest.raises(ValueError, match="DFlash 2"):
        drafter.set_draft_vocab(_ids(range(16)))


def test_choosing_a_draft_vocabulary_takes_the_most_frequent_tokens_then_the_lowest_ids():
    counts = Counter({50: 9, 7: 5, 99: 4, 3: 1})
    assert choose_draft_vocab(counts, 3, 100).tolist() == [7, 50, 99]
    assert choose_draft_vocab(counts, 6, 100).tolist() == [0, 1, 3, 7, 50, 99]
    assert coverage(counts, np.array([7, 50])) == pytest.approx(14 / 19)
    with pytest.raises(ValueError, match="does not fit"):
        choose_draft_vocab(counts, 101, 100)


def test_token_counts_read_the_generated_part_of_the_builds_chunks(tmp_path):
    sequences = np.array([[1, 2, 3, 4], [5, 6, 7, 7]], dtype=np.int32)
    np.savez(tmp_path / "chunk_00000.npz", sequences=sequences, prompt_tokens=np.array([2, 3]))
    assert continuation_token_counts([tmp_path], 2) == Counter({3: 1, 4: 1, 7: 2})
    # chunks since issue 40: each row's answer from its start to its length (the rest is filler)
    unpadded = tmp_path / "unpadded"
    unpadded.mkdir()
    np.savez(unpadded / "chunk_00000.npz", sequences=sequences, starts=np.array([1, 2]), lengths=np.array([3, 4]))
    assert continuation_token_counts([unpadded], 2) == Counter({2: 1, 3: 1, 7: 2})
    with pytest.raises(ValueError, match="no continuation chunks"):
        continuation_token_counts([tmp_path / "empty"], 2)


def test_a_written_draft_vocabulary_loads_and_every_inconsistency_is_one_line(tiny_checkpoints, tmp_path):
    import shutil

    _, draft = tiny_checkpoints
    drafter_dir = tmp_path / "drafter"
    shutil.copytree(draft, drafter_dir)
    (drafter_dir / "MANIFEST.json").write_text(json.dumps({"files": {}}))
    ids = np.array([0, 3, 9, 17, 120, 298], dtype=np.int32)
    write_draft_vocab(drafter_dir, ids, {"size": 6})
    loaded = load_drafter(str(drafter_dir))
    assert np.array(loaded.draft_vocab).tolist() == ids.tolist()
    assert loaded.config.draft_vocab_size == 6
    manifest = json.loads((drafter_dir / "MANIFEST.json").read_text())
    assert manifest["draft_vocab"] == {"size": 6} and set(manifest["files"]) == {"model.safetensors", "config.json"}

    config_file = drafter_dir / "config.json"
    config = json.loads(config_file.read_text())
    config["dflash_config"]["draft_vocab_size"] = 7
    config_file.write_text(json.dumps(config))
    with pytest.raises(LoadError, match=r"draft_vocab has shape \(6,\)") as e:
        load_drafter(str(drafter_dir))
    assert "\n" not in str(e.value)
    del config["dflash_config"]["draft_vocab_size"]
    config_file.write_text(json.dumps(config))
    with pytest.raises(LoadError, match="hold a draft_vocab tensor but draft_vocab_size is 0"):
        load_drafter(str(drafter_dir))
    for bad in ([3, 3, 9, 17, 120, 298], [9, 3, 0, 17, 120, 298], [0, 3, 9, 17, 120, 300]):
        write_draft_vocab(drafter_dir, np.array(bad, dtype=np.int32))
        with pytest.raises(LoadError, match="distinct token ids in increasing order inside the vocabulary"):
            load_drafter(str(drafter_dir))
    write_draft_vocab(drafter_dir, None)
    assert load_drafter(str(drafter_dir)).draft_vocab is None
