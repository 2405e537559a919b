"""Forward-level parity with z-lab's PyTorch reference (`dflash==0.1.0`, `dflash/model.py`).

The same random float32 weights are written once in the real checkpoint layout (``save_drafter``:
``candidate_selector.predecessor_codebook`` without ``.weight``) and loaded by both sides: ours
through the project's ``Drafter``, the reference through ``DFlash2DraftModel.from_pretrained`` /
``DFlashDraftModel.from_pretrained``. The reference creates ``base_kernel`` uninitialised, so every
reference tensor is checked against the file before anything is compared.

Compared (max abs, tolerance 1e-4): the final-normed hidden rows of the whole block and the logits
(a random LM head shared by both; ``output_multiplier`` and ``final_logit_softcapping`` set),
for a first call with n context rows + a block of B rows and then incremental cycles: our
``ContextCache`` receives the new context rows each call, the reference gets its ``DynamicCache``
plus the new ``target_hidden`` rows and is cropped to the context length after each call, exactly
as its ``dflash_generate`` does. The block's token embeddings come from a random embedding matrix,
scaled by ``input_embedding_scale`` the way each side's generation loop does it.

DFlash 2 selector: greedy paths must equal ``propose(..., temperature=0)``; for sampling the
reference draws internally, so along the path it drew we compare its proposal rows q with the
softmax of our pair scores over the same predecessors, as maps token id -> probability
(candidates come in no fixed order): the selector's scores, not only their argmax, are the
reference's (our sampled drafting walks them greedily with noise, ``decoding/drafting.py``).

Without the parity extra (torch, transformers) and z-lab's `dflash` the module skips; CI installs
them (`pip install -e '.[test,parity]'` and `pip install --no-deps dflash==0.1.0`) and `.ci/run`
imports them before the tests, so there a missing one fails instead of skipping.
"""

from __future__ import annotations

import importlib.metadata
import itertools

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="needs the parity extra: pip install -e '.[parity]' && pip install --no-deps dflash==0.1.0"
)
pytest.importorskip(
    "dflash.model", reason="needs the parity extra: pip install -e '.[parity]' && pip install --no-deps dflash==0.1.0"
)

import tiny
from dflash.model import DFlash2DraftModel, DFlashDraftModel, _crop_to, _draft_value, _make_cache, _raw_input_embeddings
from mlx.utils import tree_flatten
from safetensors.numpy import load_file

torch.set_num_threads(1)  # tiny models: threads only add contention on small CI machines

TOL = 1e-4  # max abs, float32 hidden rows and logits
# max abs, proposal probabilities: two float32 implementations whose matmuls round differently
# (ours multiplies by row-major weight copies on the CPU) differ by ~1e-5 at q ~ 0.5; a wrong
# formula (temperature, renormalisation, a candidate's score) moves q by 1e-2 or more
Q_TOL = 5e-5
WINDOW = 6  # small sliding window: the first context (12 rows) is longer than it
EXTRAS = dict(input_embedding_scale=0.7, output_multiplier=1.5, final_logit_softcapping=8.0)

# name -> (version, drafter_config keyword arguments)
CASES = {
    # non-causal full attention (the drafter_config default without a window: is_causal false)
    "v2-full-noncausal": (2, dict(**EXTRAS)),
    "v2-full-noncausal-defaults": (2, {}),  # no scale / multiplier / softcap keys at all
    # no is_causal key: sliding layers are causal, as in the reference
    "v2-sliding-causal": (2, dict(sliding_window=WINDOW, **EXTRAS)),
    # the real DFlash 2 drafter's layout: sliding layers with is_causal false
    "v2-sliding-noncausal": (2, dict(sliding_window=WINDOW, is_causal=False, **EXTRAS)),
    # one causal sliding layer, one non-causal full layer (per-layer masks and cache windows)
    "v2-mixed": (2, dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], **EXTRAS)),
    "v1-full-noncausal": (1, dict(**EXTRAS)),
    "v1-sliding-causal": (1, dict(sliding_window=WINDOW, **EXTRAS)),
}
BLOCK_SIZES = (2, 8, 16)


def test_reference_version_is_pinned():
    # The helpers used below (_make_cache, _crop_to, ...) and the semantics compared are those of
    # this release; a different one needs a review of this file, not a silent pass.
    assert importlib.metadata.version("dflash") == "0.1.0"
    assert torch.__version__.split("+")[0] == "2.13.0"


# ---------------------------------------------------------------------------------------------
# Building the pair
# ---------------------------------------------------------------------------------------------


def _randomize(drafter, seed: int) -> None:
    """Every tensor random and nonzero: norms around 1, convs and codebooks strong enough to matter."""
    rng = np.random.default_rng(seed)
    new = []
    for name, p in tree_flatten(drafter.parameters()):
        if p.ndim == 1:  # RMSNorm weights: not the identity
            v = 1.0 + 0.3 * rng.standard_normal(p.shape)
        elif "codebook" in name:
            v = rng.standard_normal(p.shape)
        elif "base_kernel" in name:
            v = 0.5 * rng.standard_normal(p.shape)
        else:
            v = rng.standard_normal(p.shape) / np.sqrt(p.shape[-1])
        new.append((name, mx.array(v.astype(np.float32))))
    drafter.load_weights(new)
    mx.eval(drafter.parameters())


class _Pair:
    def __init__(self, name: str, root):
        version, kwargs = CASES[name]
        self.config = tiny.drafter_config(tiny.hybrid_config(), version=version, layers=2, block_size=16, **kwargs)
        self.ours = tiny.build_drafter(self.config, seed=1)
        _randomize(self.ours, seed=11 + version)
        path = tiny.save_drafter(self.ours, root / name)
        cls = DFlash2DraftModel if version == 2 else DFlashDraftModel
        self.ref, info = cls.from_pretrained(str(path), torch_dtype=torch.float32, output_loading_info=True)
        self.ref.eval()
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
        self.file = load_file(str(path / "model.safetensors"))
        self.check_every_tensor()

    def check_every_tensor(self) -> None:
        """Every reference tensor equals the file's: nothing left at its (uninitialised) default."""
        state = self.ref.state_dict()
        names = {}
        for name, value in state.items():
            is_codebook = name.startswith("candidate_selector.") and "codebook" in name
            file_name = name[: -len(".weight")] if is_codebook else name
            assert file_name in self.file, f"reference tensor {name} has no counterpart in the file"
            np.testing.assert_array_equal(value.numpy(), self.file[file_name], err_msg=name)
            names[file_name] = name
        assert set(names) == set(self.file), sorted(set(self.file) - set(names))
        ours = dict(tree_flatten(self.ours.parameters()))
        assert set(ours) == set(self.file)
        # both sides read the same per-layer attention semantics from the config
        for i, layer in enumerate(self.ref.layers):
            attn = layer.self_attn
            assert attn.is_causal == self.config.layer_is_causal(i), i
            window = self.config.sliding_window if self.config.layer_is_sliding(i) else None
            assert attn.sliding_window == window, i


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity_ref")
    cache = {}

    def get(name: str) -> _Pair:
        if name not in cache:
            cache[name] = _Pair(name, root)
        return cache[name]

    return get


class _Stub(torch.nn.Module):
    """The part of a target the reference's loop reads: input embeddings."""

    def __init__(self, embeddings: np.ndarray):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(*embeddings.shape)
        self.embed_tokens.weight.data = torch.from_numpy(embeddings)

    def get_input_embeddings(self):
        return self.embed_tokens


class _Harness:
    """Drives both drafters through the same cycles with the same random inputs."""

    def __init__(self, pair: _Pair, seed: int):
        cfg = self.cfg = pair.config
        self.pair = pair
        self.rng = np.random.default_rng(seed)
        hidden, vocab = cfg.hidden_size, cfg.vocab_size
        self.taps = len(cfg.target_layer_ids)
        self.embeddings = self.rng.standard_normal((vocab, hidden)).astype(np.float32)
        head = (2.0 * self.rng.standard_normal((vocab, hidden)) / np.sqrt(hidden)).astype(np.float32)
        self.head_mx = mx.array(head)
        self.head_torch = torch.nn.Linear(hidden, vocab, bias=False)
        self.head_torch.weight.data = torch.from_numpy(head)
        self.stub = _Stub(self.embeddings)
        self.ours_cache = pair.ours.make_cache()
        self.ref_cache = _make_cache(pair.ref.config)
        self.start = 0  # context rows committed so far = the block's first position

    def lm_head(self, h: mx.array) -> mx.array:
        return h @ self.head_mx.T

    def features(self, n: int) -> np.ndarray:
        return self.rng.standard_normal((1, n, self.taps * self.cfg.hidden_size)).astype(np.float32)

    def cycle(self, features: np.ndarray, block: int, ours_features: np.ndarray | None = None):
        """One draft call on both sides; returns (ours hidden, ours logits, ref hidden, ref logits, ids)."""
        n = features.shape[1]
        self.start += n
        anchor = int(self.rng.integers(0, tiny.EOS_ID))
        ids = np.array([[anchor] + [self.cfg.mask_token_id] * (block - 1)])
        # ours, as engine.generate_speculative: target embeddings times input_embedding_scale
        embeds = mx.array(self.embeddings[ids]) * self.cfg.input_embedding_scale
        feats = features if ours_features is None else ours_features
        h_ours = self.pair.ours(embeds, mx.array(feats), self.ours_cache)
        l_ours = self.pair.ours.logits(h_ours, self.lm_head)
        mx.eval(h_ours, l_ours)
        assert self.ours_cache.offset == self.start
        # the reference, as dflash_generate
        ref = self.pair.ref
        with torch.inference_mode():
            scale = float(_draft_value(ref.config, "input_embedding_scale", 1.0))
            noise = _raw_input_embeddings(self.stub, torch.from_numpy(ids), scale)
            positions = torch.arange(self.start - n, self.start + block)[None]
            h_ref = ref(
                target_hidden=torch.from_numpy(features),
                noise_embedding=noise,
                position_ids=positions,
                past_key_values=self.ref_cache,
                use_cache=True,
            )
            _crop_to(self.ref_cache, self.start)
            l_ref = ref.compute_logits(h_ref, self.head_torch)
        return h_ours, l_ours, h_ref, l_ref, ids


def _maxdiff(a: mx.array, b: torch.Tensor) -> float:
    return float(np.abs(np.array(a) - b.numpy()).max())


# ---------------------------------------------------------------------------------------------
# Selector helpers
# ---------------------------------------------------------------------------------------------


def _our_q_along(selector, hidden, logits, anchor, temperature, path):
    """Our candidates and the softmax of our pair scores / T along ``path`` (the reference's
    draw): row i's scores after the candidate slot that row i - 1 took (row 0: the anchor)."""
    candidates, pairs = selector.pair_scores(hidden, logits, anchor)
    candidates, pairs = np.array(candidates[0]), np.array(pairs[0]).astype(np.float64)
    q, slot = [], 0
    for i, token in enumerate(path):
        cand_i = candidates[i].tolist()
        assert token in cand_i, f"row {i}: reference token {token} is not among our candidates {cand_i}"
        scores = pairs[i, slot] / temperature
        q.append(np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum())
        slot = cand_i.index(token)
    return candidates, np.array(q)


def _compare_selector(pair: _Pair, h_ours, l_ours, h_ref, ids, harness: _Harness, temperature: float):
    """Greedy paths equal; sampled q rows equal as maps.

    Returns (our greedy path, the per-row argmax of our logits, the largest q difference)."""
    selector = pair.ours.candidate_selector
    hidden, logits = h_ours[:, 1:], l_ours[:, 1:]
    anchor = mx.array(ids[:, 0], dtype=mx.int32)
    draft_ref = h_ref[:, 1:]
    greedy = np.array(selector.greedy(hidden, logits, anchor)[0]).tolist()
    with torch.inference_mode():
        path_ref, _, q_none = pair.ref.propose(draft_ref, torch.from_numpy(ids[:, 0]), harness.head_torch, 0.0)
    assert q_none is None
    assert greedy == path_ref[0].tolist(), "greedy selector path differs from the reference's propose(T=0)"

    with torch.inference_mode():
        path_s, cand_s, q_s = pair.ref.propose(draft_ref, torch.from_numpy(ids[:, 0]), harness.head_torch, temperature)
    path_s, cand_s, q_s = path_s[0].tolist(), cand_s[0].numpy(), q_s[0].numpy()
    cand_o, q_o = _our_q_along(selector, hidden, logits, anchor, temperature, path_s)
    worst = 0.0
    for i in range(len(path_s)):
        ref_map = dict(zip(cand_s[i].tolist(), q_s[i].tolist()))
        our_map = dict(zip(cand_o[i].tolist(), q_o[i].tolist()))
        assert set(ref_map) == set(our_map), f"row {i}: candidate sets differ {sorted(ref_map)} vs {sorted(our_map)}"
        diff = max(abs(ref_map[t] - our_map[t]) for t in ref_map)
        assert diff <= Q_TOL, f"row {i}: q differs by {diff:.2e}: ours {our_map} reference {ref_map}"
        worst = max(worst, diff)
    return greedy, np.array(mx.argmax(logits[0], axis=-1)).tolist(), worst


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["v2-full-noncausal", "v1-full-noncausal"])
def test_reference_receives_every_tensor(pairs, name):
    pair = pairs(name)  # the constructor asserts tensor-by-tensor equality with the file
    state = pair.ref.state_dict()
    if pair.config.is_dflash2:
        kernels = [k for k in state if k.endswith("base_kernel")]
        assert len(kernels) == 2 * pair.config.num_hidden_layers
        for k in kernels:  # set from our file, not left as torch.empty
            np.testing.assert_array_equal(state[k].numpy(), pair.file[k])
            assert state[k].numpy().std() > 0.1
        for k in ("predecessor_codebook", "successor_codebook"):
            np.testing.assert_array_equal(
                state[f"candidate_selector.{k}.weight"].numpy(), pair.file[f"candidate_selector.{k}"]
            )


@pytest.mark.parametrize(
    "name,block",
    [pytest.param(n, b, id=f"{n}-B{b}") for n, b in itertools.product(CASES, BLOCK_SIZES)],
)
def test_drafter_matches_reference(pairs, name, block):
    """A first call (12 context rows + B block rows) then three incremental cycles.

    With B > W the sliding cases also check the window inside the block: the reference hides
    block keys more than W-1 positions before the query, and, when not causal, after it too."""
    pair = pairs(name)
    harness = _Harness(pair, seed=100 + block)
    torch.manual_seed(block)
    non_trivial = False
    report = []
    # context rows per call: first a long context (> window), then accepted+1 rows per cycle
    for cycle, n in enumerate([12, min(3, block), 1, block]):
        h_ours, l_ours, h_ref, l_ref, ids = harness.cycle(harness.features(n), block)
        dh, dl = _maxdiff(h_ours, h_ref), _maxdiff(l_ours, l_ref)
        report.append(f"cycle {cycle} (+{n} ctx): hidden {dh:.1e} logits {dl:.1e}")
        assert dh <= TOL and dl <= TOL, f"{name} B={block}: " + "; ".join(report)
        if pair.config.is_dflash2:
            temperature = (0.7, 1.3)[cycle % 2]
            greedy, argmax, dq = _compare_selector(pair, h_ours, l_ours, h_ref, ids, harness, temperature)
            report[-1] += f" q {dq:.1e}"
            non_trivial |= greedy != argmax
    print(f"{name} B={block}: " + "; ".join(report))
    if pair.config.is_dflash2 and block >= 8:
        # the pair scores must have changed some choice, or the selector was not exercised
        assert non_trivial, "the selector's greedy path always equalled the per-row argmax"


@pytest.mark.parametrize("name", ["v2-sliding-causal", "v2-sliding-noncausal"])
def test_context_skip_matches_full_context(pairs, name):
    """All layers sliding: our cache fed only the last W-1 prompt rows (plus ``skip``) as the
    engine's prefill does, the reference the whole prompt."""
    pair = pairs(name)
    assert pair.config.context_window == WINDOW - 1
    harness = _Harness(pair, seed=7)
    block = 4
    prompt = harness.features(20)
    harness.ours_cache.skip(20 - (WINDOW - 1))
    diffs = []
    h_ours, l_ours, h_ref, l_ref, _ = harness.cycle(prompt, block, ours_features=prompt[:, -(WINDOW - 1) :])
    diffs.append((_maxdiff(h_ours, h_ref), _maxdiff(l_ours, l_ref)))
    for n in (2, 4):
        h_ours, l_ours, h_ref, l_ref, _ = harness.cycle(harness.features(n), block)
        diffs.append((_maxdiff(h_ours, h_ref), _maxdiff(l_ours, l_ref)))
    print(f"{name} skip: " + "; ".join(f"hidden {a:.1e} logits {b:.1e}" for a, b in diffs))
    assert all(a <= TOL and b <= TOL for a, b in diffs), diffs
