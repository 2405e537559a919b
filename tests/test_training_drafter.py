"""The drafter trainer: data, anchors, masking, loss weights, selector loss, init, checkpoints.

Runs on the tiny hybrid target of tests/tiny.py (float32, CPU). Full training is not run here:
a few steps check that the loss falls, and short runs check the checkpoint round trip, bit-for-bit
resume and that z-lab's PyTorch reference loads what the trainer writes.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten
from safetensors.numpy import load_file

from dflash2_mlx.models.drafter_config import DFLASH1, DFLASH2
from dflash2_mlx.models.loading import load_drafter, load_target
from dflash2_mlx.models.selector import top_k_candidates
from dflash2_mlx.training.drafter.batches import (
    anchor_range,
    answer_ends,
    batch_indices,
    block_arrays,
    loss_weights,
    sample_anchors,
)
from dflash2_mlx.training.drafter.checkpoint import STATE_DIR, load_checkpoint_state
from dflash2_mlx.training.drafter.config import DrafterTrainingConfig
from dflash2_mlx.training.drafter.data import generate_training_sequences, sample_windows
from dflash2_mlx.training.drafter.evaluation import evaluate_drafter, greedy_walk_correct, simulated_cycles
from dflash2_mlx.training.drafter.initialise import default_target_layer_ids, init_drafter, make_drafter_config
from dflash2_mlx.training.drafter.loss import drafter_head, drafter_loss, forward_blocks
from dflash2_mlx.training.drafter.trainer import train_drafter

PREFIX, CONT, B = 12, 28, 8


def small_config(**kw) -> DrafterTrainingConfig:
    base = dict(
        block_size=B,
        layers=2,
        steps=4,
        seed=3,
        batch_size=3,
        blocks_per_sequence=4,
        selector_top_k=4,
        selector_rank=8,
        learning_rate=3e-3,
        compile=False,
        log_every=1,
        checkpoint_every=0,
        sliding_window=None,
    )
    base.update(kw)
    return DrafterTrainingConfig(**base)


@pytest.fixture(scope="module")
def target(tmp_path_factory, hybrid_target):
    cfg, model = hybrid_target
    path = tiny.save_target(model, cfg, tmp_path_factory.mktemp("train_target") / "tiny-hybrid")
    return load_target(str(path))


@pytest.fixture(scope="module")
def documents():
    rng = np.random.default_rng(5)
    return [list(map(int, rng.integers(0, 256, size=int(n)))) for n in rng.integers(5, 80, size=12)]


@pytest.fixture(scope="module")
def sequences(target, documents):
    return generate_training_sequences(target, documents, 10, PREFIX, CONT, seed=0, batch_size=4)


@pytest.fixture(scope="module")
def trained(target, sequences, tmp_path_factory):
    """A short DFlash 2 run (4 steps), shared by the checkpoint tests."""
    out = tmp_path_factory.mktemp("trained") / "drafter"
    train_drafter(target, sequences, out, small_config(compile=True), continuation_start=PREFIX, progress=False)
    return out


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def test_sequences_are_corpus_windows_then_the_targets_greedy_continuation(target, documents, sequences):
    assert sequences.shape == (10, PREFIX + CONT) and sequences.dtype == np.int32
    again = generate_training_sequences(target, documents, 10, PREFIX, CONT, seed=0, batch_size=3)
    np.testing.assert_array_equal(sequences, again)  # deterministic, whatever the batch size
    other = generate_training_sequences(target, documents, 10, PREFIX, 2, seed=1)
    assert not np.array_equal(other[:, :PREFIX], sequences[:, :PREFIX])
    for row in sequences:
        prefix = row[:PREFIX].tolist()
        assert any(prefix == d[i : i + PREFIX] for d in documents for i in range(len(d) - PREFIX + 1))
    # the continuation is what plain decoding (one sequence, one token at a time) emits
    runner = target.runner
    for row in sequences[:2]:
        cache = runner.make_cache()
        logits, _ = runner(mx.array(row[None, :PREFIX]), cache)
        out = []
        for _ in range(CONT):
            token = int(mx.argmax(logits[0, -1]).item())
            out.append(token)
            logits, _ = runner(mx.array([[token]]), cache)
        assert out == row[PREFIX:].tolist()


def test_windows_skip_short_documents_and_fail_clearly():
    rng = np.random.default_rng(0)
    docs = [[1, 2], [3, 4, 5, 6, 7]]
    w = sample_windows(docs, 50, 4, rng)
    assert {tuple(r) for r in w.tolist()} == {(3, 4, 5, 6), (4, 5, 6, 7)}
    with pytest.raises(ValueError, match="no document has at least 9 tokens"):
        sample_windows(docs, 1, 9, rng)


# ---------------------------------------------------------------------------------------------
# Anchors, batches, blocks
# ---------------------------------------------------------------------------------------------


def test_anchor_sampling_inside_the_generated_part_with_room_for_the_block():
    seq_len, start = 40, 12
    lo, hi = anchor_range(seq_len, B, start)
    assert (lo, hi) == (12, 32)  # the last row predicts position a + B - 1 = 39
    seen = set()
    for s in range(200):
        a = sample_anchors(np.random.default_rng(s), seq_len, B, 6, start)
        assert a.dtype == np.int32 and len(a) == 6 and len(set(a.tolist())) == 6
        assert (np.diff(a) > 0).all() and a.min() >= start and a.max() + B - 1 <= seq_len - 1
        seen |= set(a.tolist())
    assert seen == set(range(lo, hi + 1))  # every valid anchor gets drawn
    np.testing.assert_array_equal(
        sample_anchors(np.random.default_rng(7), seq_len, B, 6, start),
        sample_anchors(np.random.default_rng(7), seq_len, B, 6, start),
    )
    assert anchor_range(seq_len, B, 0)[0] == 1  # at least one context row
    assert len(sample_anchors(np.random.default_rng(0), 10, B, 5, 0)) == 5  # 2 choices: drawn with replacement
    with pytest.raises(ValueError, match="no room for a block"):
        anchor_range(15, B, 12)


def test_anchors_stop_at_the_end_of_the_answer_so_the_text_after_it_is_never_drafted():
    seq_len, start, end_ids = 40, 12, [2, 0]
    sequences = np.full((3, seq_len), 7, dtype=np.int32)
    sequences[0, 20] = 2  # the answer ends at 20 (a 0 before the start is prompt, not an end)
    sequences[0, 5] = 0
    sequences[1, 12] = 0  # ends at once
    ends = answer_ends(sequences, start, end_ids)
    assert ends.tolist() == [20, 12, seq_len]  # the third never ends: its whole length
    assert answer_ends(sequences, start, []).tolist() == [seq_len] * 3
    seen = set()
    for s in range(200):
        seen |= set(sample_anchors(np.random.default_rng(s), seq_len, B, 4, start, int(ends[0])).tolist())
    assert seen == set(range(12, 20))  # the last anchor's first row predicts the end token
    assert set(sample_anchors(np.random.default_rng(0), seq_len, B, 3, start, int(ends[1])).tolist()) == {12}
    # no end: the same draws as without the setting
    np.testing.assert_array_equal(
        sample_anchors(np.random.default_rng(3), seq_len, B, 6, start, int(ends[2])),
        sample_anchors(np.random.default_rng(3), seq_len, B, 6, start),
    )


def test_batches_cover_every_sequence_once_per_epoch():
    order = np.concatenate([batch_indices(10, 4, seed=1, step=s) for s in range(5)])
    assert sorted(order[:10].tolist()) == list(range(10))
    assert sorted(order[10:20].tolist()) == list(range(10))
    np.testing.assert_array_equal(batch_indices(10, 4, 1, 3), batch_indices(10, 4, 1, 3))
    assert not np.array_equal(order[:10], np.concatenate([batch_indices(10, 4, 2, s) for s in range(3)])[:10])


def test_block_arrays_anchor_then_masks_labels_are_the_sequence():
    seqs = np.arange(100, 140, dtype=np.int32).reshape(2, 20)
    anchors = np.array([[3, 9], [1, 12]], dtype=np.int32)
    blocks, labels, preds = block_arrays(seqs, anchors, 4, 7)
    np.testing.assert_array_equal(blocks[0, 1], [109, 7, 7, 7])
    np.testing.assert_array_equal(labels[0, 1], [110, 111, 112])
    np.testing.assert_array_equal(preds[0, 1], [109, 110, 111])
    np.testing.assert_array_equal(blocks[1, 0], [121, 7, 7, 7])
    np.testing.assert_array_equal(labels[1, 0], [122, 123, 124])


# ---------------------------------------------------------------------------------------------
# Masking: a block sees its own context prefix and itself, nothing else
# ---------------------------------------------------------------------------------------------


def _randomized(target, config):
    drafter = init_drafter(make_drafter_config(target, config), config)
    params = tree_flatten(drafter.parameters())
    keys = mx.random.split(mx.random.key(9), len(params))
    drafter.load_weights([(n, p + 0.3 * mx.random.normal(p.shape, key=k)) for (n, p), k in zip(params, keys)])
    return drafter


@pytest.mark.parametrize("window", [None, 6])
def test_a_block_never_sees_other_blocks_or_context_at_or_after_its_anchor(target, sequences, window):
    config = small_config(sliding_window=window)
    drafter = _randomized(target, config)
    cfg = drafter.config
    runner = target.runner
    seqs = sequences[:2]
    _, feats = runner(mx.array(seqs), runner.make_cache(), taps=cfg.target_layer_ids)
    anchors = np.array([[14, 20, 25, 30], [12, 18, 22, 31]], dtype=np.int32)
    blocks, _, _ = block_arrays(seqs, anchors, B, cfg.mask_token_id)
    base = forward_blocks(drafter, runner.embed, feats, mx.array(blocks), mx.array(anchors))
    a = int(anchors[0, 1])  # block 1 of sequence 0
    noisy = np.array(feats)
    noisy[0, a:] += 5.0 * np.random.default_rng(0).standard_normal(noisy[0, a:].shape)  # at/after its anchor
    noisy[1] += 5.0  # another sequence
    other = blocks.copy()
    other[0, [0, 2, 3], 0] = (other[0, [0, 2, 3], 0] + 17) % 256  # other blocks' anchor tokens
    other[1, :, 0] = 3
    moved = forward_blocks(drafter, runner.embed, mx.array(noisy), mx.array(other), mx.array(anchors))
    np.testing.assert_array_equal(np.array(moved[1]), np.array(base[1]))
    assert not np.allclose(np.array(moved[0]), np.array(base[0]))  # the perturbation does reach others
    # a context row before the anchor does matter
    before = np.array(feats)
    before[0, a - 1] += 5.0
    changed = forward_blocks(drafter, runner.embed, mx.array(before), mx.array(blocks), mx.array(anchors))
    assert not np.allclose(np.array(changed[1]), np.array(base[1]))
    # and the block's rows are exactly what inference computes for that block
    cache = drafter.make_cache()
    h = drafter(runner.embed(mx.array(blocks[0, 1][None])), feats[:1, :a], cache)
    np.testing.assert_allclose(
        np.array(h[0]), np.array(base[1]), rtol=1e-5, atol=2e-5
    )  # float rounding of different matmul layouts


# ---------------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------------


def test_loss_weights_decay_along_the_block_and_sum_to_one():
    w = loss_weights(8, 4.0)
    assert w.shape == (7,)
    np.testing.assert_allclose(w / w[0], np.exp(-np.arange(7) / 4.0), rtol=1e-6)
    assert abs(w.sum() - 1.0) < 1e-6
    assert small_config(block_size=8).resolved_gamma() == 4.0
    assert small_config(block_size=16).resolved_gamma() == 7.0
    assert small_config(block_size=8, gamma=2.5).resolved_gamma() == 2.5


def _loss_inputs(target, config, rows=5):
    drafter = _randomized(target, config)
    rng = np.random.default_rng(1)
    hidden = mx.array(rng.standard_normal((rows, B, 64)).astype(np.float32))
    labels = mx.array(rng.integers(0, 256, (rows, B - 1)).astype(np.int32))
    preds = mx.array(rng.integers(0, 256, (rows, B - 1)).astype(np.int32))
    return drafter, hidden, labels, preds


def test_cross_entropy_is_weighted_per_row_and_averaged_over_blocks(target):
    config = small_config()
    drafter, hidden, labels, preds = _loss_inputs(target, config)
    w = mx.array(loss_weights(B, 4.0))
    _, metrics = drafter_loss(drafter, target.runner.lm_head, hidden, labels, preds, w, config)
    logits = np.array(drafter.logits(hidden[:, 1:], target.runner.lm_head), dtype=np.float64)
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    ce = -np.take_along_axis(logp, np.array(labels)[..., None], -1)[..., 0]
    expected = (ce * np.array(w)).sum(-1).mean()
    assert abs(float(metrics["ce"]) - expected) < 1e-4
    # the anchor row is never scored: changing it changes nothing
    h2 = hidden.at[:, 0].add(3.0)
    _, m2 = drafter_loss(drafter, target.runner.lm_head, h2, labels, preds, w, config)
    assert float(m2["ce"]) == float(metrics["ce"])


def test_soft_targets_mix_the_targets_distribution_into_each_rows_cross_entropy(target):
    w = mx.array(loss_weights(B, 4.0))
    hard_config = small_config()
    drafter, hidden, labels, preds = _loss_inputs(target, hard_config)
    rng = np.random.default_rng(2)
    vocab = target.runner.vocab_size
    target_logits = mx.array(rng.standard_normal((hidden.shape[0], B - 1, vocab)).astype(np.float32) * 3)
    _, hard = drafter_loss(drafter, target.runner.lm_head, hidden, labels, preds, w, hard_config, target_logits)
    _, mixed = drafter_loss(
        drafter, target.runner.lm_head, hidden, labels, preds, w, small_config(soft_target_weight=0.25), target_logits
    )
    logits = np.array(drafter.logits(hidden[:, 1:], target.runner.lm_head), dtype=np.float64)
    logq = logits - logits.max(-1, keepdims=True)
    logq -= np.log(np.exp(logq).sum(-1, keepdims=True))
    t = np.array(target_logits, dtype=np.float64)
    p = np.exp(t - t.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    soft = (-(p * logq).sum(-1) * np.array(w)).sum(-1).mean()
    assert "soft" not in hard  # weight 0: labels only, whatever logits are passed
    assert abs(float(mixed["soft"]) - soft) < 1e-4
    assert abs(float(mixed["ce"]) - (0.75 * float(hard["ce"]) + 0.25 * soft)) < 1e-4


def test_block_target_logits_are_the_targets_prediction_of_each_rows_label(target, sequences):
    """On greedy continuations the target's argmax at row i's position is row i's label."""
    from dflash2_mlx.training.drafter.features import TargetFeatures
    from dflash2_mlx.training.drafter.loss import block_target_logits

    runner = target.runner
    feats, final = TargetFeatures(runner, sequences, [0], 1 << 30, final=True)(np.arange(len(sequences)))
    plain, none = TargetFeatures(runner, sequences, [0], 1 << 30)(np.arange(len(sequences)))
    assert none is None and np.array_equal(np.array(feats), np.array(plain))
    anchors = np.stack(
        [sample_anchors(np.random.default_rng(i), sequences.shape[1], B, 3, PREFIX) for i in range(len(sequences))]
    )
    _, labels, _ = block_arrays(sequences, anchors, B, 0)
    logits = block_target_logits(runner.lm_head, final, mx.array(anchors), B)
    assert np.array_equal(np.array(mx.argmax(logits, axis=-1)), labels.reshape(-1, B - 1))


def test_soft_target_training_runs_and_lowers_the_loss(target, sequences, tmp_path):
    config = small_config(steps=6, soft_target_weight=0.5, compile=True)
    out = train_drafter(target, sequences, tmp_path / "soft", config, continuation_start=PREFIX, progress=False)
    history = load_checkpoint_state(out)["history"]
    assert "soft" in history[0] and history[-1]["soft"] < history[0]["soft"]


def test_sampled_continuations_are_deterministic_and_differ_from_greedy(target, documents, sequences):
    a = generate_training_sequences(target, documents, 10, PREFIX, CONT, seed=0, batch_size=4, temperature=1.0)
    b = generate_training_sequences(target, documents, 10, PREFIX, CONT, seed=0, batch_size=4, temperature=1.0)
    assert np.array_equal(a, b)
    assert np.array_equal(a[:, :PREFIX], sequences[:, :PREFIX])  # the same corpus windows
    assert not np.array_equal(a[:, PREFIX:], sequences[:, PREFIX:])


def test_selector_loss_counts_only_rows_whose_label_is_a_candidate(target):
    config = small_config()
    drafter, hidden, labels, preds = _loss_inputs(target, config)
    lm_head = target.runner.lm_head
    logits = drafter.logits(hidden[:, 1:], lm_head)
    candidates, unary = top_k_candidates(logits, config.selector_top_k)
    cand = np.array(candidates)
    lab = np.array(labels)
    lab[:, ::2] = cand[:, ::2, 2]  # even rows: the label is the third candidate; odd rows: random
    labels = mx.array(lab)
    valid = (cand == lab[..., None]).any(-1)
    assert valid[:, ::2].all() and not valid.all()
    w = mx.array(loss_weights(B, 4.0))
    _, metrics = drafter_loss(drafter, lm_head, hidden, labels, preds, w, config)
    sel = drafter.candidate_selector
    left = np.array(sel.predecessor_codebook[preds] * sel.hidden_projection(hidden[:, 1:]))
    scores = np.array(unary) + np.einsum("mrkd,mrd->mrk", np.array(sel.successor_codebook[candidates]), left)
    index = np.argmax(cand == lab[..., None], -1)
    logq = (
        scores
        - np.log(np.exp(scores - scores.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - scores.max(-1, keepdims=True)
    )
    sce = -np.take_along_axis(logq, index[..., None], -1)[..., 0]
    wv = np.array(w)[None] * valid
    assert abs(float(metrics["sel"]) - (sce * wv).sum() / wv.sum()) < 1e-4
    assert abs(float(metrics["hit"]) - valid.mean()) < 1e-6
    # no valid row at all: the selector loss is 0, not NaN
    far = mx.array((cand.max(-1) + 1 + np.arange(B - 1)[None]) % 256)  # labels outside every top-k
    far = mx.where(mx.array((cand == np.array(far)[..., None]).any(-1)), 299, far)
    _, m3 = drafter_loss(drafter, lm_head, hidden, far, preds, w, config)
    assert float(m3["sel"]) == 0.0 and float(m3["hit"]) == 0.0


def test_selector_loss_does_not_reach_the_drafter_by_default(target):
    config = small_config()
    drafter, hidden, labels, preds = _loss_inputs(target, config)
    w = mx.array(loss_weights(B, 4.0))
    candidates, _ = top_k_candidates(drafter.logits(hidden[:, 1:], target.runner.lm_head), config.selector_top_k)
    labels = candidates[..., 1]  # every row counts

    def selector_only(hidden):
        _, m = drafter_loss(drafter, target.runner.lm_head, hidden, labels, preds, w, config)
        return m["sel"]

    assert float(mx.abs(mx.grad(selector_only)(hidden)).max()) == 0.0
    on = small_config(selector_grad_to_drafter=True)

    def selector_joint(hidden):
        _, m = drafter_loss(drafter, target.runner.lm_head, hidden, labels, preds, w, on)
        return m["sel"]

    assert float(mx.abs(mx.grad(selector_joint)(hidden)).max()) > 0.0


def test_the_selector_leaves_the_drafters_training_unchanged(target, sequences, tmp_path):
    """With the detached selector loss (and its gradients clipped on their own), "+ convs" and
    "+ both" train the same drafter: the ablation isolates the selector."""
    both = train_drafter(
        target, sequences, tmp_path / "both", small_config(steps=3), continuation_start=PREFIX, progress=False
    )
    convs = train_drafter(
        target,
        sequences,
        tmp_path / "convs",
        small_config(steps=3, selector=False),
        continuation_start=PREFIX,
        progress=False,
    )
    a, b = load_file(str(both / "model.safetensors")), load_file(str(convs / "model.safetensors"))
    assert set(a) == set(b)
    for name in a:
        if not name.startswith("candidate_selector."):
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert np.abs(a["candidate_selector.successor_codebook"]).max() > 0


# ---------------------------------------------------------------------------------------------
# Initialisation and ablation variants
# ---------------------------------------------------------------------------------------------


def test_init_identity_convs_zero_projections_and_successor(target):
    config = small_config()
    drafter = init_drafter(make_drafter_config(target, config), config)
    for layer in drafter.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            k = np.array(conv.base_kernel)
            assert (k[:, 0, :] == 1).all() and (k[:, 1, :] == 0).all()
            assert (np.array(conv.kernel_projection.weight) == 0).all()
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            assert (np.array(norm.weight) == 1).all()
    sel = drafter.candidate_selector
    assert (np.array(sel.successor_codebook) == 0).all()
    pred = np.array(sel.predecessor_codebook)
    assert 0 < np.abs(pred).mean() < 0.5 and np.abs(np.array(sel.hidden_projection.weight)).max() > 0
    again = init_drafter(make_drafter_config(target, config), config)
    for (n, a), (_, b) in zip(tree_flatten(drafter.parameters()), tree_flatten(again.parameters())):
        np.testing.assert_array_equal(np.array(a), np.array(b), err_msg=n)


def test_default_taps_are_spread_and_never_the_last_layer():
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # the reference's rule
    assert default_target_layer_ids(6, 2) == [1, 3]
    assert default_target_layer_ids(4, 2) == [1, 2]
    assert default_target_layer_ids(2, 2) == [0]
    for n in range(2, 20):
        for c in range(1, 6):
            ids = default_target_layer_ids(n, c)
            assert len(set(ids)) == len(ids) == min(c, n - 1) and max(ids) <= n - 2 and min(ids) >= 0


def test_identity_convs_compute_exactly_a_drafter_without_them(target, sequences):
    """The "no convs" ablation (frozen identity convs) is bit for bit a convless drafter."""
    config = small_config(convs=False)
    v2 = _randomized(target, config)
    from dflash2_mlx.training.drafter.initialise import _reset_convs

    _reset_convs(v2)
    v1_config = make_drafter_config(target, small_config(convs=False, selector=False))
    v1 = init_drafter(v1_config, small_config(convs=False, selector=False))
    shared = {k: v for k, v in tree_flatten(v2.parameters()) if "conv" not in k and "candidate_selector" not in k}
    v1.load_weights(list(shared.items()))
    runner = target.runner
    _, feats = runner(mx.array(sequences[:1]), runner.make_cache(), taps=v2.config.target_layer_ids)
    anchors = np.array([[13, 20, 27]], dtype=np.int32)
    blocks, _, _ = block_arrays(sequences[:1], anchors, B, v2.config.mask_token_id)
    args = (feats, mx.array(blocks), mx.array(anchors))
    np.testing.assert_array_equal(
        np.array(forward_blocks(v2, runner.embed, *args)), np.array(forward_blocks(v1, runner.embed, *args))
    )


def test_zero_selector_walk_is_the_per_row_argmax(target):
    config = small_config(selector=False)
    drafter = _randomized(target, config)
    from dflash2_mlx.training.drafter.initialise import _zero_selector

    _zero_selector(drafter)
    rng = np.random.default_rng(4)
    hidden = mx.array(rng.standard_normal((6, B - 1, 64)).astype(np.float32))
    logits = drafter.logits(hidden, target.runner.lm_head)
    path = drafter.candidate_selector.greedy(hidden, logits, mx.array(rng.integers(0, 256, 6)))
    np.testing.assert_array_equal(np.array(path), np.array(mx.argmax(logits, axis=-1)))


def test_ablations_stay_frozen_and_dflash1_has_the_v1_layout(target, sequences, tmp_path):
    no_convs = train_drafter(
        target,
        sequences,
        tmp_path / "nc",
        small_config(steps=2, convs=False),
        continuation_start=PREFIX,
        progress=False,
    )
    w = load_file(str(no_convs / "model.safetensors"))
    for name, v in w.items():
        if name.endswith("base_kernel"):
            assert (v[:, 0] == 1).all() and (v[:, 1] == 0).all(), name
        if "kernel_projection" in name:
            assert (v == 0).all(), name
    assert np.abs(w["candidate_selector.successor_codebook"]).max() > 0  # the selector did train
    no_sel = train_drafter(
        target,
        sequences,
        tmp_path / "ns",
        small_config(steps=2, selector=False),
        continuation_start=PREFIX,
        progress=False,
    )
    w = load_file(str(no_sel / "model.safetensors"))
    assert all((v == 0).all() for n, v in w.items() if n.startswith("candidate_selector."))
    assert any(np.abs(v[:, 1]).max() > 0 for n, v in w.items() if n.endswith("base_kernel"))  # convs did train
    v1 = train_drafter(
        target,
        sequences,
        tmp_path / "v1",
        small_config(steps=2, convs=False, selector=False),
        continuation_start=PREFIX,
        progress=False,
    )
    cfg = json.loads((v1 / "config.json").read_text())
    assert cfg["architectures"] == [DFLASH1]
    assert set(cfg["dflash_config"]) == {"block_size", "mask_token_id", "target_layer_ids", "target_model"}
    w = load_file(str(v1 / "model.safetensors"))
    assert not any("conv" in n or "selector" in n for n in w)
    assert load_drafter(str(v1)).config.architecture == DFLASH1
    torch = pytest.importorskip(
        "torch", reason="needs the parity extra: pip install -e '.[parity]' && pip install --no-deps dflash==0.1.0"
    )
    pytest.importorskip("dflash.model", reason="z-lab's reference: pip install --no-deps dflash==0.1.0")
    from dflash.model import DFlashDraftModel

    ref, info = DFlashDraftModel.from_pretrained(str(v1), torch_dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


# ---------------------------------------------------------------------------------------------
# Training and checkpoints
# ---------------------------------------------------------------------------------------------


def test_a_few_steps_reduce_the_loss(target, sequences, tmp_path):
    config = small_config(steps=12, learning_rate=5e-3, warmup_fraction=0.0)
    out = train_drafter(target, sequences, tmp_path / "d", config, continuation_start=PREFIX, progress=False)
    history = load_checkpoint_state(out)["history"]
    assert len(history) == 12 and all(h["tok_s"] > 0 and h["steps_s"] > 0 for h in history)
    # the same held-fixed blocks, scored by the initial and the trained drafter
    runner = target.runner
    before = init_drafter(make_drafter_config(target, config), config)
    after = load_drafter(str(out))
    _, feats = runner(mx.array(sequences), runner.make_cache(), taps=after.config.target_layer_ids)
    anchors = np.tile(np.arange(PREFIX, PREFIX + CONT - B + 1, 4, dtype=np.int32), (len(sequences), 1))
    blocks, labels, preds = block_arrays(sequences, anchors, B, after.config.mask_token_id)
    w = mx.array(loss_weights(B, config.resolved_gamma()))
    ce = []
    for drafter in (before, after):
        h = forward_blocks(drafter, runner.embed, feats, mx.array(blocks), mx.array(anchors))
        _, m = drafter_loss(
            drafter,
            runner.lm_head,
            h,
            mx.array(labels.reshape(len(h), -1)),
            mx.array(preds.reshape(len(h), -1)),
            w,
            config,
        )
        ce.append(float(m["ce"]))
    assert ce[1] < ce[0] - 0.5, ce


def test_simulated_cycles_follow_the_engines_rule():
    # a cycle at j emits leading[j] + 1 tokens, the next is anchored where it ended
    assert simulated_cycles(np.array([2, 9, 9, 0, 7, 9, 9, 9, 9, 9, 9, 9, 1])) == [3, 1, 8, 2]
    assert simulated_cycles(np.array([2, 9, 9, 0, 7, 9, 9, 9, 9, 9, 9, 9])) == [3, 1, 8]
    assert simulated_cycles(np.zeros(5, dtype=int)) == [1] * 5


@pytest.fixture(scope="module")
def trained_on_vocab(target, sequences, tmp_path_factory):
    """A short run scoring a draft vocabulary: the answers' tokens but every third, then ids 0..7."""
    vocab = np.unique(
        np.concatenate([np.setdiff1d(sequences[:, PREFIX:], sequences[:, PREFIX:].ravel()[::3]), np.arange(8)])
    )
    out = tmp_path_factory.mktemp("trained_vocab") / "drafter"
    cfg = small_config(compile=True, steps=6, soft_target_weight=0.5)
    train_drafter(target, sequences, out, cfg, continuation_start=PREFIX, progress=False, draft_vocab=vocab)
    return out


@pytest.mark.parametrize("checkpoint", ["trained", "trained_on_vocab"])
def test_evaluation_reproduces_the_engines_cycles(target, checkpoint, documents, request):
    """Training's view of a block is inference's: the simulated cycles are the engine's (with the
    whole head, and with a draft vocabulary that leaves out tokens the target writes)."""
    from dflash2_mlx.decoding.speculative import generate_speculative
    from dflash2_mlx.decoding.types import GenerationSettings

    drafter = load_drafter(str(request.getfixturevalue(checkpoint)))
    # (a barely trained drafter on a random target accepts little; the same check passed cycle for
    # cycle with a drafter accepting 1..8 tokens per cycle on a trained byte-level target)
    seqs = generate_training_sequences(target, documents, 3, PREFIX, CONT, seed=4)
    metrics = evaluate_drafter(target, drafter, seqs, continuation_start=PREFIX)
    runner = target.runner
    lo, hi = anchor_range(seqs.shape[1], B, PREFIX)
    _, feats = runner(mx.array(seqs), runner.make_cache(), taps=drafter.config.target_layer_ids)
    anchors = np.tile(np.arange(lo, hi + 1, dtype=np.int32), (len(seqs), 1))
    blocks, labels, preds = block_arrays(seqs, anchors, B, drafter.config.mask_token_id)
    hidden = forward_blocks(drafter, runner.embed, feats, mx.array(blocks), mx.array(anchors))
    m = len(hidden)
    head, _ = drafter_head(runner, drafter)
    right = np.array(
        greedy_walk_correct(drafter, head, hidden, mx.array(labels.reshape(m, -1)), mx.array(preds.reshape(m, -1)))
    )
    leading = np.cumprod(right, axis=-1).sum(-1).reshape(len(seqs), -1)
    total_tokens = total_cycles = 0
    for row, lead in zip(seqs, leading):
        events = list(generate_speculative(runner, drafter, row[:PREFIX].tolist(), GenerationSettings(max_tokens=CONT)))
        assert sum((e.tokens for e in events), []) == row[PREFIX:].tolist()
        sim = simulated_cycles(lead)
        assert [len(e.tokens) for e in events][1 : 1 + len(sim)] == sim
        total_tokens, total_cycles = total_tokens + sum(sim), total_cycles + len(sim)
    assert metrics["acceptance"] == total_tokens / total_cycles and metrics["cycles"] == total_cycles


def test_checkpoint_is_the_real_layout_and_loads_identically(target, trained):
    cfg = json.loads((trained / "config.json").read_text())
    assert cfg["architectures"] == [DFLASH2] and cfg["model_type"] == "qwen3"
    d = cfg["dflash_config"]
    assert d["block_size"] == B and d["mask_token_id"] == tiny.MASK_ID
    assert d["target_model"] == "tiny-hybrid" and d["target_layer_ids"] == [1, 2]
    assert (d["selector_top_k"], d["selector_rank"], d["conv_group_size"], d["conv_kernel_size"]) == (4, 8, 16, 2)
    assert sorted(p.name for p in trained.glob("*.safetensors")) == [
        "model.safetensors"
    ]  # nothing else for loaders to glob
    state = load_checkpoint_state(trained)
    assert state["step"] == 4 and state["complete"] and state["architecture"] == DFLASH2
    file = load_file(str(trained / "model.safetensors"))
    drafter = load_drafter(str(trained))
    ours = dict(tree_flatten(drafter.parameters()))
    assert set(ours) == set(file)
    for name, value in ours.items():
        np.testing.assert_array_equal(np.array(value), file[name], err_msg=name)
    assert any(np.abs(v).max() > 0 for n, v in file.items() if "kernel_projection" in n)  # trained, not init


def test_zlab_reference_loads_the_checkpoint(trained):
    torch = pytest.importorskip(
        "torch", reason="needs the parity extra: pip install -e '.[parity]' && pip install --no-deps dflash==0.1.0"
    )
    pytest.importorskip("dflash.model", reason="z-lab's reference: pip install --no-deps dflash==0.1.0")
    from dflash.model import DFlash2DraftModel

    ref, info = DFlash2DraftModel.from_pretrained(str(trained), torch_dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    file = load_file(str(trained / "model.safetensors"))
    state = ref.state_dict()
    for name, value in state.items():
        key = name[: -len(".weight")] if "codebook" in name else name
        np.testing.assert_array_equal(value.numpy(), file[key], err_msg=name)
    assert len(state) == len(file)
    assert ref.block_size == B and ref.mask_token_id == tiny.MASK_ID and list(ref.target_layer_ids) == [1, 2]
    assert ref.candidate_selector.top_k == 4


def test_resume_continues_bit_for_bit(target, sequences, trained, tmp_path):
    """N steps == N/2 steps, stop, resume N/2 steps (compiled steps, as in real runs)."""
    out = tmp_path / "resumed"
    train_drafter(
        target, sequences, out, small_config(compile=True, stop_at_step=2), continuation_start=PREFIX, progress=False
    )
    assert load_checkpoint_state(out)["step"] == 2 and not load_checkpoint_state(out)["complete"]
    train_drafter(target, sequences, out, small_config(compile=True), continuation_start=PREFIX, progress=False)
    assert load_checkpoint_state(out)["step"] == 4
    for name in ("model.safetensors", f"{STATE_DIR}/optimizer.safetensors"):
        assert (out / name).read_bytes() == (trained / name).read_bytes(), name
    # the uncompiled step computes the same update (to float rounding)
    plain = train_drafter(
        target, sequences, tmp_path / "plain", small_config(), continuation_start=PREFIX, progress=False
    )
    a, b = load_file(str(plain / "model.safetensors")), load_file(str(trained / "model.safetensors"))
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) < 1e-5
    # a finished run is left alone; other settings are refused
    train_drafter(target, sequences, out, small_config(compile=True), continuation_start=PREFIX, progress=False)
    assert (out / "model.safetensors").read_bytes() == (trained / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="other settings"):
        train_drafter(target, sequences, out, small_config(layers=1), continuation_start=PREFIX, progress=False)
    with pytest.raises(ValueError, match="other data"):
        train_drafter(target, sequences[:5], out, small_config(), continuation_start=PREFIX, progress=False)


def test_features_computed_per_step_train_the_same_drafter(target, sequences, trained, tmp_path):
    """Without room to precompute the target's features, each step runs the target itself."""
    out = train_drafter(
        target,
        sequences,
        tmp_path / "f",
        small_config(compile=True, feature_cache_bytes=0),
        continuation_start=PREFIX,
        progress=False,
    )
    a, b = load_file(str(out / "model.safetensors")), load_file(str(trained / "model.safetensors"))
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) < 1e-6


def test_features_kept_from_before_train_bit_for_bit_the_same_drafter(target, sequences, trained, tmp_path):
    """A staged build keeps the target's features on disk and hands them to the trainer."""
    from dflash2_mlx.training.drafter.features import TargetFeatures

    taps = json.loads((trained / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    feats, _ = TargetFeatures(target.runner, sequences, taps, budget=1 << 40).cached
    kept = TargetFeatures.from_arrays(target.runner, sequences, taps, mx.array(np.array(feats)))
    out = train_drafter(
        target,
        sequences,
        tmp_path / "kept",
        small_config(compile=True),
        continuation_start=PREFIX,
        progress=False,
        features=kept,
    )
    assert (out / "model.safetensors").read_bytes() == (trained / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="other taps"):
        train_drafter(
            target,
            sequences,
            tmp_path / "other",
            small_config(soft_target_weight=0.5),
            continuation_start=PREFIX,
            progress=False,
            features=kept,
        )


def test_a_minutes_budget_ends_the_run_by_the_clock(target, sequences, tmp_path):
    out = train_drafter(
        target,
        sequences,
        tmp_path / "m",
        small_config(steps=None, minutes=0.002),
        continuation_start=PREFIX,
        progress=False,
    )
    state = load_checkpoint_state(out)
    assert state["complete"] and state["step"] >= 1 and state["elapsed"] >= 0.12
    assert load_drafter(str(out)).config.architecture == DFLASH2


def test_a_drafter_over_its_size_budget_is_refused_before_it_trains(target, sequences, tmp_path):
    def train(name, max_bytes=None):
        config = small_config(steps=1)
        return train_drafter(
            target, sequences, tmp_path / name, config, continuation_start=PREFIX, progress=False, max_bytes=max_bytes
        )

    size = (train("fits") / "model.safetensors").stat().st_size
    with pytest.raises(ValueError, match="over the .* MB budget"):
        train("big", max_bytes=size // 2)
    assert not (tmp_path / "big" / "model.safetensors").exists()  # no step ran, nothing was written
    train("ok", max_bytes=size)  # the parameters' bytes are within the file's


def test_init_from_a_dflash1_drafter_grows_dflash2_parts(target, sequences, tmp_path):
    v1 = train_drafter(
        target,
        sequences,
        tmp_path / "v1",
        small_config(steps=1, convs=False, selector=False),
        continuation_start=PREFIX,
        progress=False,
    )
    v2 = train_drafter(
        target,
        sequences,
        tmp_path / "v2",
        small_config(steps=1, block_size=6),
        init=v1,
        continuation_start=PREFIX,
        progress=False,
    )
    cfg = load_drafter(str(v2)).config
    assert cfg.architecture == DFLASH2 and cfg.block_size == 6


def test_missing_mask_token_is_a_clear_error(target):
    class NoMask:
        def get_vocab(self):
            return {"a": 0}

    from dflash2_mlx.models.loading import Target

    bare = Target(target.runner, NoMask(), target.config, "x", target.path)
    with pytest.raises(ValueError, match="<\\|mask\\|>"):
        make_drafter_config(bare, small_config())
    assert make_drafter_config(bare, small_config(mask_token_id=5)).mask_token_id == 5


def test_cli_trains_from_a_text_directory(target, tmp_path):
    import typer
    from typer.testing import CliRunner

    from dflash2_mlx.cli.train import train_drafter_command

    app = typer.Typer()
    app.command()(train_drafter_command)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the quick brown fox jumps over the lazy dog " * 4)
    (corpus / "b.jsonl").write_text(json.dumps({"text": "pack my box with five dozen liquor jugs"}) + "\n")
    out = tmp_path / "out"
    args = [
        "--model",
        str(target.path),
        "--data",
        str(corpus),
        "--out",
        str(out),
        "--steps",
        "2",
        "--num-sequences",
        "3",
        "--prefix-len",
        "8",
        "--continuation-len",
        "16",
        "--batch-size",
        "2",
        "--blocks-per-sequence",
        "2",
        "--no-progress",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    assert load_drafter(str(out)).config.architecture == DFLASH2
    meta = json.loads((out / STATE_DIR / "data.json").read_text())
    assert [f["file"].split("/")[-1] for f in meta["files"]] == ["a.txt", "b.jsonl"]
    bad = CliRunner().invoke(app, args[:2] + ["--data", str(tmp_path / "missing"), "--out", str(tmp_path / "o2")])
    assert bad.exit_code != 0 and "does not exist" in str(bad.exception)


# ---------------------------------------------------------------------------------------------
# Training on a draft vocabulary
# ---------------------------------------------------------------------------------------------


def test_training_on_a_draft_vocabulary_of_every_id_trains_the_drafter_the_whole_head_trains(
    target, sequences, trained, tmp_path
):
    """Same logits, same soft targets, labels as columns: the same weights to float rounding."""
    every = np.arange(target.runner.vocab_size, dtype=np.int32)
    config = small_config(compile=True, soft_target_weight=0.5)
    out = train_drafter(target, sequences, tmp_path / "every", config, continuation_start=PREFIX, draft_vocab=every)
    whole = train_drafter(target, sequences, tmp_path / "whole", config, continuation_start=PREFIX)
    a, b = load_file(str(out / "model.safetensors")), load_file(str(whole / "model.safetensors"))
    np.testing.assert_array_equal(a.pop("draft_vocab"), every)
    assert set(a) == set(b)
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) < 1e-5


def test_a_drafter_trained_on_a_draft_vocabulary_loads_with_it_and_decodes_losslessly(
    target, sequences, trained_on_vocab
):
    from dflash2_mlx.decoding.autoregressive import generate_autoregressive
    from dflash2_mlx.decoding.output import collect
    from dflash2_mlx.decoding.speculative import generate_speculative
    from dflash2_mlx.decoding.types import GenerationSettings

    history = load_checkpoint_state(trained_on_vocab)["history"]
    assert len(history) == 6 and all(np.isfinite(h["loss"]) for h in history)
    drafter = load_drafter(str(trained_on_vocab))
    vocab = np.array(drafter.draft_vocab)
    assert drafter.config.draft_vocab_size == len(vocab) and len(np.setdiff1d(sequences[:, PREFIX:], vocab)) > 0
    settings = GenerationSettings(max_tokens=24, block_size=B)
    prompt = sequences[3, :PREFIX].tolist()
    spec = [t for e in generate_speculative(target.runner, drafter, prompt, settings) for t in e.tokens]
    assert spec == collect(generate_autoregressive(target.runner, prompt, settings))[0]


def test_labels_outside_the_draft_vocabulary_count_no_cross_entropy_and_are_never_right(target):
    config = small_config(soft_target_weight=0.0)
    drafter = init_drafter(make_drafter_config(target, config), config)
    vocab = mx.arange(0, 64, dtype=mx.int32)
    drafter.set_draft_vocab(vocab)
    head = target.runner.head_rows(vocab)
    hidden = mx.random.normal((2, B, target.runner.hidden_size), key=mx.random.key(0))
    w = mx.array(loss_weights(B, config.resolved_gamma()))
    preds = mx.zeros((2, B - 1), dtype=mx.int32)
    outside = mx.full((2, B - 1), -1, dtype=mx.int32)
    _, m = drafter_loss(drafter, head, hidden, outside, preds, w, config)
    assert float(m["ce"]) == 0.0 and float(m["acc"]) == 0.0 and float(m["hit"]) == 0.0 and float(m["tau"]) == 1.0
    inside = mx.full((2, B - 1), 5, dtype=mx.int32)
    _, m = drafter_loss(drafter, head, hidden, inside, preds, w, config)
    assert float(m["ce"]) > 0.0


def test_a_run_resumes_only_with_the_draft_vocabulary_it_started_with(target, sequences, tmp_path):
    out = tmp_path / "d"
    vocab = np.arange(0, 200, dtype=np.int32)
    cfg = small_config(stop_at_step=2)
    train_drafter(target, sequences, out, cfg, continuation_start=PREFIX, progress=False, draft_vocab=vocab)
    with pytest.raises(ValueError, match="another draft vocabulary"):
        train_drafter(target, sequences, out, small_config(), continuation_start=PREFIX, progress=False)
    with pytest.raises(ValueError, match="another draft vocabulary"):
        train_drafter(
            target, sequences, out, small_config(), continuation_start=PREFIX, progress=False, draft_vocab=vocab[1:]
        )
    train_drafter(target, sequences, out, small_config(), continuation_start=PREFIX, progress=False, draft_vocab=vocab)
    assert load_checkpoint_state(out)["step"] == 4
    with pytest.raises(ValueError, match="increasing order"):
        train_drafter(
            target, sequences, tmp_path / "e", small_config(), continuation_start=PREFIX, draft_vocab=vocab[::-1]
        )


def test_evaluation_up_to_each_answers_end_is_the_engine_stopping_there(target, trained, documents):
    from dflash2_mlx.decoding.speculative import generate_speculative
    from dflash2_mlx.decoding.types import GenerationSettings

    drafter = load_drafter(str(trained))
    seqs = generate_training_sequences(target, documents, 3, PREFIX, CONT, seed=4)
    stop = int(seqs[0, PREFIX + CONT // 2])  # a token the first answer writes half-way: its end
    lo, hi = anchor_range(seqs.shape[1], B, PREFIX)
    ends = answer_ends(seqs, PREFIX, [stop])
    ending = ends <= hi  # answers that end where whole blocks still fit (the first one, at least)
    seqs, ends = seqs[ending], ends[ending]
    metrics = evaluate_drafter(target, drafter, seqs, continuation_start=PREFIX, ends=ends)
    tokens = cycles = 0
    settings = GenerationSettings(max_tokens=CONT, block_size=B, stop_token_ids=[stop])
    for row, end in zip(seqs, ends):
        events = list(generate_speculative(target.runner, drafter, row[:PREFIX].tolist(), settings))
        emitted = [len(e.tokens) for e in events if e.tokens][1:]  # the cycles after the prefill's token
        assert sum(emitted) == end - PREFIX  # it stopped with the end token
        tokens, cycles = tokens + sum(emitted), cycles + len(emitted)
    assert metrics["acceptance"] == tokens / cycles and metrics["cycles"] == cycles


def test_no_token_after_an_answers_end_is_trained_on(target, sequences, tmp_path):
    """Issue 40: a row's tokens after its length (its answer's end token, or where the answer was
    cut) are filler: the same rows with other filler train bit for bit the same drafter, answers
    starting where each row says (``continuation_start`` per row)."""
    n, seq_len = sequences.shape
    starts = np.array([PREFIX - (i % 3) for i in range(n)])
    lengths = np.array([PREFIX + 6 + 2 * i for i in range(n)])
    other = sequences.copy()
    rng = np.random.default_rng(0)
    for i, length in enumerate(lengths):
        other[i, length:] = rng.integers(0, 256, size=seq_len - length)
    config = small_config(soft_target_weight=0.5)

    def weights(seqs, name, **kw):
        out = train_drafter(target, seqs, tmp_path / name, config, continuation_start=starts, progress=False, **kw)
        return load_file(str(out / "model.safetensors"))

    first, second = weights(sequences, "a", lengths=lengths), weights(other, "b", lengths=lengths)
    assert all(np.array_equal(first[k], second[k]) for k in first)
    unmasked = weights(other, "c")  # without lengths, the filler is trained on
    assert not all(np.array_equal(first[k], unmasked[k]) for k in first)


def test_evaluation_with_a_start_per_row_is_each_row_evaluated_alone(target, trained, sequences):
    drafter = load_drafter(str(trained))
    seqs, starts = sequences[:3], np.array([PREFIX, PREFIX - 3, PREFIX - 5])
    ends = np.array([PREFIX + 10, PREFIX + 20, PREFIX + CONT])
    together = evaluate_drafter(target, drafter, seqs, starts, ends=ends)
    alone = [evaluate_drafter(target, drafter, seqs[i : i + 1], int(starts[i]), ends=ends[i : i + 1]) for i in range(3)]
    assert together["cycles"] == sum(a["cycles"] for a in alone)
    assert together["acceptance"] == pytest.approx(
        sum(a["acceptance"] * a["cycles"] for a in alone) / together["cycles"], rel=1e-12
    )
    assert together["blocks"] == sum(a["blocks"] for a in alone)
