"""Speculative decoding is token-for-token plain decoding (float32, CPU): greedy, and sampled with
the same seed (each position's token is the request's keyed draw there, whoever draws it).

The drafters here are real DFlash / DFlash 2 modules; ``OracleDrafter`` replaces their proposals
by the target's own greedy continuation corrupted at random positions, so every accepted count
0..B-1 and the full-block bonus happen for every block size, and the tests assert they did.
"""

from __future__ import annotations

import random
from collections import defaultdict

import mlx.core as mx
import pytest
import tiny
from mlx.utils import tree_flatten

from dflash2_mlx.decoding.autoregressive import generate_autoregressive
from dflash2_mlx.decoding.speculative import generate_speculative
from dflash2_mlx.decoding.types import GenerationSettings
from dflash2_mlx.models.target import TargetRunner

MAX_TOKENS = 40
# 220 random cases over 110 random prompts: a prompt's plain greedy continuation does not depend
# on the drafter, block size or window it is compared with, so each is decoded once and checked
# against two independently drawn speculative set-ups.
N_PROMPTS, CASES_PER_PROMPT = 110, 2
FORCED_PROMPT = [7, 3, 200, 41]


def _tokens(events):
    return [t for e in events for t in e.tokens]


@pytest.fixture(scope="module")
def plain_greedy():
    """plain_greedy(target, prompt, n): ``generate_autoregressive``'s first n tokens, decoded once
    per (target, prompt) for the whole module. Greedy decoding with no stop tokens computes token
    i the same way whatever max_tokens is, so the first n tokens of a longer run are the n-token run."""
    memo = {}

    def plain(target, prompt, n):
        from dflash2_mlx.backend import device

        _, model = target
        # the GPU code paths (forced on the CPU) round differently: their plain run is their own
        key = (id(model), tuple(prompt), device.forced_gpu_paths())
        if len(memo.get(key, ())) < n:
            memo[key] = _tokens(generate_autoregressive(TargetRunner(model), prompt, GenerationSettings(max_tokens=n)))
        return memo[key][:n]

    return plain


def _random_prompts(seed, n):
    """n (target kind, prompt) pairs; the same seed gives the same pairs in the same order."""
    rng = random.Random(seed)
    return [
        (rng.choice(["hybrid", "plain"]), [rng.randrange(0, tiny.VOCAB - 4) for _ in range(rng.randint(1, 24))])
        for _ in range(n)
    ]


def _assert_identical_or_near_tie(runner, prompt, spec, plain, settings):
    """Identity, or a divergence proven to be a float near-tie of the target's top two logits."""
    if spec == plain:
        return
    i = next((j for j, (a, b) in enumerate(zip(spec, plain)) if a != b), min(len(spec), len(plain)))
    assert i < len(plain), f"speculative output is longer than plain output: {spec} vs {plain}"
    cache = runner.make_cache()
    logits, _ = runner(mx.array([prompt + plain[:i]]), cache)
    top2 = mx.sort(logits[0, -1])[-2:]
    gap = float(top2[1] - top2[0])
    assert gap < 1e-4, (
        f"divergence at token {i}: spec {spec[i : i + 3]} vs plain {plain[i : i + 3]}, top-2 gap {gap:.3g} is no "
        f"near-tie"
    )


def _case(rng: random.Random, target, prompt, plain, record_counts):
    """One random speculative set-up (drafter version, block size, window, weights, oracle or not,
    corruption rate) on ``prompt``, checked against its plain greedy continuation ``plain``."""
    cfg, model = target
    runner = TargetRunner(model)
    version = rng.choice([1, 2])
    block = rng.randint(2, 16)
    window = rng.choice([None, None, 5, 12])
    settings = GenerationSettings(max_tokens=MAX_TOKENS, block_size=block)
    dcfg = tiny.drafter_config(cfg, version=version, block_size=16, sliding_window=window)
    base = tiny.build_drafter(dcfg, seed=rng.randrange(1000))
    if rng.random() < 0.8:
        continuation = prompt + plain
        corrupt = {p for p in range(len(prompt) + 1, len(continuation)) if rng.random() < rng.choice([0.05, 0.15, 0.4])}
        drafter = tiny.OracleDrafter(dcfg, continuation, corrupt)
        drafter.load_weights(tree_flatten(base.parameters()))
    else:
        drafter = base
    events = list(generate_speculative(runner, drafter, prompt, settings))
    spec = _tokens(events)
    _assert_identical_or_near_tie(runner, prompt, spec, plain, settings)
    for e in events:
        if e.accepted is not None:
            record_counts[block].add(e.accepted)
    stats = events[-1].stats
    times = [e.elapsed for e in events]
    assert times == sorted(times) and times[0] > 0
    assert stats.generation_tokens == len(spec) <= MAX_TOKENS
    assert stats.cycle_tokens == len(spec) - 1
    assert stats.acceptance_length == pytest.approx((len(spec) - 1) / stats.verify_steps)


def test_speculative_greedy_equals_plain_greedy_on_220_random_cases(hybrid_target, plain_target, plain_greedy):
    targets = {"hybrid": hybrid_target, "plain": plain_target}
    rng = random.Random(20261202)
    seen = defaultdict(set)
    cases = 0
    for kind, prompt in _random_prompts(20261202, N_PROMPTS):
        plain = plain_greedy(targets[kind], prompt, MAX_TOKENS)
        for _ in range(CASES_PER_PROMPT):
            _case(rng, targets[kind], prompt, plain, seen)
            cases += 1
    assert cases == 220
    _assert_full_coverage(seen)


def test_lossless_through_the_compiled_kernel_bodies(hybrid_target, plain_target, plain_greedy):
    """The same property with the conv and selector running the .metal bodies compiled for the CPU."""
    from kernel_harness import harness

    from dflash2_mlx.kernels import dispatch as kernels

    targets = {"hybrid": hybrid_target, "plain": plain_target}
    rng = random.Random(7)
    seen = defaultdict(set)
    calls = defaultdict(int)

    def counted(name, fn):
        def run(*args):
            calls[name] += 1
            return fn(*args)

        return run

    # 40 of the same random prompts (their plain continuations are decoded once, without the
    # override: the target never calls these kernels), each with its own random set-up
    prompts = _random_prompts(20261202, 40)
    references = [plain_greedy(targets[kind], prompt, MAX_TOKENS) for kind, prompt in prompts]
    with kernels.override(**{k: counted(k, f) for k, f in harness.harness_kernels().items()}):
        assert set(kernels.active_kernels().values()) == {"override"}
        for (kind, prompt), plain in zip(prompts, references):
            _case(rng, targets[kind], prompt, plain, seen)
        for block in range(2, 17):  # every accepted count 0..B-1 for every B, through the kernels
            _forced_accepted_counts(hybrid_target if block % 2 else plain_target, block, plain_greedy)
    assert calls["two_tap_conv"] > 0 and calls["select_greedy"] > 0


@pytest.mark.parametrize("path", ["keep", "replay", "replay-gpu-paths"])
def test_speculative_greedy_equals_plain_greedy_with_each_rollback_path(
    path, hybrid_target, plain_target, plain_greedy, monkeypatch
):
    """The same property with rollback forced to keep per-step states, to replay the recurrence
    (Metal's path), and to replay with every GPU code path the CPU can take (mlx-lm's
    gated_delta_update in the layer, RoPE and masks as on a GPU, the fused drafter attention):
    random cases plus every accepted count for every block size."""
    from dflash2_mlx.backend import device
    from dflash2_mlx.caches import target as caches

    monkeypatch.setenv(caches.ROLLBACK_ENV, path.split("-")[0])
    if path.endswith("gpu-paths"):
        monkeypatch.setenv(device.PATHS_ENV, "gpu")
    targets = {"hybrid": hybrid_target, "plain": plain_target}
    assert TargetRunner(hybrid_target[1]).rollback_path() == path.split("-")[0]
    rng = random.Random(31)
    seen = defaultdict(set)
    for kind, prompt in _random_prompts(4242, 16):
        _case(rng, targets[kind], prompt, plain_greedy(targets[kind], prompt, MAX_TOKENS), seen)
    for block in range(2, 17):  # asserts that every accepted count 0..B-1 occurred
        _forced_accepted_counts(hybrid_target, block, plain_greedy)


def _assert_full_coverage(seen):
    # every block size 2..16 saw 0 accepted and the full block (accepted B-1) at least once
    for block in range(2, 17):
        assert 0 in seen[block] and block - 1 in seen[block], f"block {block} only saw {sorted(seen[block])}"
    assert len(set().union(*seen.values())) == 16  # 0..15 all occurred


@pytest.mark.parametrize("block", range(2, 17))
def test_every_accepted_count_occurs_for_every_block_size(hybrid_target, plain_greedy, block):
    """For each B, drive accepted counts 0..B-1 on purpose with corruption offsets."""
    _forced_accepted_counts(hybrid_target, block, plain_greedy)


def _forced_accepted_counts(target, block, plain_greedy, version=2):
    cfg, model = target
    runner = TargetRunner(model)
    prompt = FORCED_PROMPT
    n_tokens = block * (block + 1) + 4
    settings = GenerationSettings(max_tokens=n_tokens, block_size=block)
    plain = plain_greedy(target, prompt, 16 * 17 + 4)[:n_tokens]  # one decode serves every B
    assert len(plain) == n_tokens
    continuation = prompt + plain
    dcfg = tiny.drafter_config(cfg, version=version, block_size=16)
    wanted = list(range(block))
    drafter = tiny.OracleDrafter(dcfg, continuation, tiny.corrupted_for(len(prompt), wanted, block))
    drafter.load_weights(tree_flatten(tiny.build_drafter(dcfg).parameters()))
    events = list(generate_speculative(runner, drafter, prompt, settings))
    assert _tokens(events) == plain
    accepted = [e.accepted for e in events if e.accepted is not None]
    assert accepted[: len(wanted)] == wanted


def test_logits_processors_are_applied_with_each_rows_history(hybrid_target):
    """Repetition penalty and logit bias see committed + d1..di on verify row i, as plain decoding does."""
    from mlx_lm.sample_utils import make_logits_processors

    cfg, model = hybrid_target
    runner = TargetRunner(model)
    prompt = [5, 9, 5, 9, 12]
    procs = make_logits_processors(logit_bias={17: 2.0, 40: -5.0}, repetition_penalty=1.3, repetition_context_size=8)
    settings = GenerationSettings(max_tokens=30, block_size=6, logits_processors=procs)
    plain = _tokens(generate_autoregressive(runner, prompt, settings))
    unprocessed = _tokens(generate_autoregressive(runner, prompt, GenerationSettings(max_tokens=30)))
    assert plain != unprocessed  # the processors really change the output
    dcfg = tiny.drafter_config(cfg, version=2)
    for corrupt in (set(), {8, 13, 20}):
        drafter = tiny.OracleDrafter(dcfg, prompt + plain, corrupt)
        drafter.load_weights(tree_flatten(tiny.build_drafter(dcfg).parameters()))
        assert _tokens(generate_speculative(runner, drafter, prompt, settings)) == plain


def test_stop_tokens_and_max_tokens_clip_a_cycle(hybrid_target):
    cfg, model = hybrid_target
    runner = TargetRunner(model)
    prompt = [1, 2, 3]
    plain = _tokens(generate_autoregressive(runner, prompt, GenerationSettings(max_tokens=30)))
    stop = plain[9]
    first = plain.index(stop)
    dcfg = tiny.drafter_config(cfg, version=2)
    drafter = tiny.OracleDrafter(dcfg, prompt + plain, set())
    drafter.load_weights(tree_flatten(tiny.build_drafter(dcfg).parameters()))
    events = list(
        generate_speculative(
            runner, drafter, prompt, GenerationSettings(max_tokens=30, block_size=8, stop_token_ids=[stop])
        )
    )
    assert _tokens(events) == plain[: first + 1]  # the stop token is included, nothing after it
    assert events[-1].finish_reason == "stop"
    drafter = tiny.OracleDrafter(dcfg, prompt + plain, set())
    drafter.load_weights(tree_flatten(tiny.build_drafter(dcfg).parameters()))
    events = list(generate_speculative(runner, drafter, prompt, GenerationSettings(max_tokens=11, block_size=8)))
    assert _tokens(events) == plain[:11] and events[-1].finish_reason == "length"
    stats = events[-1].stats
    # 1 prefill token + cycles of 8, 2 (clipped to max tokens: the last block is drafted short)
    assert stats.cycle_tokens == 10 and stats.verify_steps == 2 and stats.acceptance_length == 5.0


def test_sampled_decoding_through_the_compiled_kernels_draws_what_the_reference_draws(hybrid_target):
    """Sampled drafts go through the selector's greedy kernel on noised scores: the compiled kernel
    bodies draft what the reference does, and both outputs are plain sampled decoding's."""
    from kernel_harness import harness

    from dflash2_mlx.decoding.sampling import SamplingSettings
    from dflash2_mlx.kernels import dispatch as kernels

    cfg, model = hybrid_target
    runner = TargetRunner(model)
    dcfg = tiny.drafter_config(cfg, version=2, block_size=8)
    drafter = tiny.build_drafter(dcfg)
    settings = GenerationSettings(max_tokens=24, sampling=SamplingSettings(temperature=1.0), seed=11, block_size=8)
    reference = _tokens(generate_speculative(runner, drafter, [3, 4, 5], settings))
    with kernels.override(**harness.harness_kernels()):
        compiled = _tokens(generate_speculative(runner, drafter, [3, 4, 5], settings))
    assert compiled == reference == _tokens(generate_autoregressive(runner, [3, 4, 5], settings))


# -- the block-size controller: any schedule of plain steps and block sizes is lossless ---------


def _schedule(rng: random.Random, max_block: int) -> list[int]:
    """Runs of plain steps and of block sizes 2..max_block, switching several times."""
    out = []
    while len(out) < 60:
        size = 1 if rng.random() < 0.4 else rng.randint(2, max_block)
        out += [size] * rng.randint(1, 6)
    return out


def test_greedy_output_equals_plain_under_forced_switching_schedules(hybrid_target, plain_target, plain_greedy):
    """Plain steps (cycles of block size 1) and blocks of every size, mixed by a schedule, emit
    exactly plain decoding's tokens; the schedule really ran (switches and every size seen)."""
    from dflash2_mlx.policies.block_size import ScheduledBlocks

    targets = {"hybrid": hybrid_target, "plain": plain_target}
    rng = random.Random(14)
    sizes_seen, switches = set(), 0
    for case, (kind, prompt) in enumerate(_random_prompts(1414, 14)):
        cfg, model = targets[kind]
        runner = TargetRunner(model)
        plain = plain_greedy(targets[kind], prompt, 72)
        dcfg = tiny.drafter_config(cfg, version=1 + case % 2, block_size=16, sliding_window=rng.choice([None, 5]))
        corrupt = {p for p in range(len(prompt) + 1, len(prompt) + 73) if rng.random() < 0.15}
        drafter = tiny.OracleDrafter(dcfg, prompt + plain, corrupt)
        drafter.load_weights(tree_flatten(tiny.build_drafter(dcfg, seed=case).parameters()))
        policy = ScheduledBlocks(_schedule(rng, 16))
        events = list(generate_speculative(runner, drafter, prompt, GenerationSettings(max_tokens=72, policy=policy)))
        assert _tokens(events) == plain
        ran, emitted = [], 1  # the prefill's token
        for i, (size, accepted) in enumerate(policy.observed):
            assert size == min(policy.schedule[i % len(policy.schedule)], 72 - emitted + 1)  # clipped to max_tokens
            ran.append(size)
            emitted += accepted + 1
        sizes_seen |= set(ran)
        switches += sum(a != b for a, b in zip(ran, ran[1:]))
        stats = events[-1].stats
        assert stats.plain_steps == ran.count(1) and stats.verify_steps == len(ran) - ran.count(1)
        assert stats.cycle_tokens + stats.plain_tokens == len(plain) - 1
    assert sizes_seen == set(range(1, 17)), sorted(sizes_seen)
    assert switches >= 80


def test_logits_processors_and_stop_tokens_hold_across_plain_steps(hybrid_target):
    """History-dependent processors see the same history in plain steps, blocks and the steps
    launched ahead of a host sync; a stop token inside a plain stretch ends the output there."""
    from mlx_lm.sample_utils import make_logits_processors

    from dflash2_mlx.policies.block_size import ScheduledBlocks

    cfg, model = hybrid_target
    runner = TargetRunner(model)
    prompt = [5, 9, 5, 9, 12]
    procs = make_logits_processors(logit_bias={17: 2.0, 40: -5.0}, repetition_penalty=1.3, repetition_context_size=8)
    settings = GenerationSettings(max_tokens=40, logits_processors=procs)
    plain = _tokens(generate_autoregressive(runner, prompt, settings))
    dcfg = tiny.drafter_config(cfg, version=2)
    drafter = tiny.OracleDrafter(dcfg, prompt + plain, {9, 16, 30})
    drafter.load_weights(tree_flatten(tiny.build_drafter(dcfg).parameters()))
    schedule = [1, 1, 1, 4, 4, 1, 6, 1, 1, 2, 8, 1, 1, 1]
    spec = _tokens(
        generate_speculative(
            runner,
            drafter,
            prompt,
            GenerationSettings(max_tokens=40, logits_processors=procs, policy=ScheduledBlocks(schedule)),
        )
    )
    assert spec == plain
    stop = plain[2]  # emitted by the second plain step
    events = list(
        generate_speculative(
            runner,
            drafter,
            prompt,
            GenerationSettings(
                max_tokens=40, logits_processors=procs, stop_token_ids=[stop], policy=ScheduledBlocks(schedule)
            ),
        )
    )
    assert _tokens(events) == plain[: plain.index(stop) + 1] and events[-1].finish_reason == "stop"


class _RecordingDrafter(tiny.Drafter):
    """A real drafter that keeps every block's position and final hidden rows (lazy)."""

    def __init__(self, config):
        super().__init__(config)
        self.blocks = []

    def __call__(self, block_embeds, features, cache):
        hidden = super().__call__(block_embeds, features, cache)
        self.blocks.append((cache.next_position()[0], hidden))
        return hidden


@pytest.mark.parametrize("window", [None, 12])
def test_blocks_drafted_after_a_plain_stretch_equal_those_of_a_run_that_never_left_speculation(hybrid_target, window):
    """Plain steps feed the target's tapped features into the drafter's context cache: a block
    drafted after a plain stretch (longer than the window and the context batch) sees the same
    context as the same block in a run that speculated all along."""
    from dflash2_mlx.policies.block_size import ScheduledBlocks

    cfg, model = hybrid_target
    runner = TargetRunner(model)
    dcfg = tiny.drafter_config(cfg, version=2, block_size=8, sliding_window=window)
    weights = tree_flatten(tiny.build_drafter(dcfg, seed=3).parameters())
    runs = {}
    # a random drafter rarely agrees with the target: the speculating run drafts at nearly every position
    for name, schedule in (("speculating", [4]), ("switching", [4, 4, 4] + [1] * 40 + [4] * 6 + [1] * 3 + [4] * 20)):
        drafter = _RecordingDrafter(dcfg)
        drafter.load_weights(weights)
        tokens = _tokens(
            generate_speculative(
                runner, drafter, [3, 1, 4, 1, 5], GenerationSettings(max_tokens=90, policy=ScheduledBlocks(schedule))
            )
        )
        runs[name] = (tokens, {int(p.item()): h for p, h in drafter.blocks})
    assert runs["speculating"][0] == runs["switching"][0]
    always, switching = runs["speculating"][1], runs["switching"][1]
    after_plain = [p for p in switching if p > 5 + 3 + 40]
    compared = [p for p in after_plain if p in always]
    assert len(compared) >= 15  # a context that missed the plain rows would draft them at other positions
    for p in compared:
        # float rounding only (batched and one-row BLAS matmuls of the context rows round differently)
        gap = mx.abs(switching[p] - always[p]).max().item()
        assert gap < 1e-4, f"block at position {p} differs by {gap}"


# -- sampling: the same seed draws the same token at each position, speculative or not ---------


def _sampled_case(targets, case) -> None:
    """One set-up drawn by hypothesis: the plain sampled continuation of a prompt with a seed, then
    the speculative run with the same seed, drafter (an oracle of that continuation corrupted at
    random positions, of another seed's, or a random drafter), block size or block schedule."""
    from dflash2_mlx.decoding.sampling import SamplingSettings
    from dflash2_mlx.policies.block_size import ScheduledBlocks

    cfg, model = targets[case["kind"]]
    runner = TargetRunner(model)
    prompt, seed = case["prompt"], case["seed"]
    sampling = SamplingSettings(temperature=case["temperature"], top_p=case["top_p"], top_k=case["top_k"])
    plain = _tokens(generate_autoregressive(runner, prompt, GenerationSettings(MAX_TOKENS, sampling, seed=seed)))
    dcfg = tiny.drafter_config(cfg, version=case["version"], block_size=16, sliding_window=case["window"])
    base = tiny.build_drafter(dcfg, seed=case["weights"])
    if case["drafter"] == "random":
        drafter = base
    else:
        continuation = plain
        if case["drafter"] == "oracle of another seed":
            other = GenerationSettings(MAX_TOKENS, sampling, seed=seed ^ 1)
            continuation = _tokens(generate_autoregressive(runner, prompt, other))
        corrupt = {len(prompt) + 1 + i for i in case["corrupt"]}
        drafter = tiny.OracleDrafter(dcfg, prompt + continuation, corrupt)
        drafter.load_weights(tree_flatten(base.parameters()))
    blocks = case["blocks"]
    if len(blocks) == 1:
        settings = GenerationSettings(MAX_TOKENS, sampling, seed=seed, block_size=max(blocks[0], 2))
    else:
        settings = GenerationSettings(MAX_TOKENS, sampling, seed=seed, policy=ScheduledBlocks(blocks))
    events = list(generate_speculative(runner, drafter, prompt, settings))
    assert _tokens(events) == plain, case
    if case["drafter"] == "oracle" and not case["corrupt"] and len(blocks) == 1:
        stats = events[-1].stats  # nothing was refused: every block was kept whole (but a clipped last one)
        assert stats.accepted_tokens >= stats.drafted_tokens - max(blocks[0], 2) + 1


def test_sampled_speculative_output_equals_plain_sampled_output_for_every_seed(hybrid_target, plain_target):
    """For every seed, prompt, sampling settings (top-p on), drafter, block size and block
    schedule (plain steps, blocks drafted and verified ahead of a host sync), speculative sampled
    output is plain sampled output token for token: each position's token is the request's keyed
    draw there, whoever draws it."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    targets = {"hybrid": hybrid_target, "plain": plain_target}
    cases = st.fixed_dictionaries(
        {
            "kind": st.sampled_from(["hybrid", "plain"]),
            "prompt": st.lists(st.integers(0, tiny.VOCAB - 5), min_size=1, max_size=24),
            "seed": st.integers(0, 2**64 - 1),
            "temperature": st.sampled_from([0.3, 0.7, 1.0, 1.5]),
            "top_p": st.sampled_from([0.5, 0.9, 0.95]),
            "top_k": st.sampled_from([0, 0, 20]),
            "version": st.sampled_from([1, 2]),
            "window": st.sampled_from([None, None, 5]),
            "weights": st.integers(0, 999),
            "drafter": st.sampled_from(["oracle", "oracle", "oracle of another seed", "random"]),
            "corrupt": st.sets(st.integers(0, MAX_TOKENS), max_size=8),
            "blocks": st.lists(st.integers(1, 16), min_size=1, max_size=12),
        }
    )

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(case=cases)
    def check(case):
        _sampled_case(targets, case)

    check()


@pytest.mark.parametrize("version", [1, 2])
def test_every_accepted_count_occurs_for_every_block_size_when_sampling(hybrid_target, version):
    """Sampled, with top-p: for each B, an oracle of the plain sampled continuation corrupted at
    chosen offsets drives accepted counts 0..B-1, and the output is still plain sampled decoding's."""
    from dflash2_mlx.decoding.sampling import SamplingSettings

    cfg, model = hybrid_target
    runner = TargetRunner(model)
    prompt, sampling = FORCED_PROMPT, SamplingSettings(temperature=1.0, top_p=0.9)
    longest = 16 * 17 + 4
    plain = _tokens(generate_autoregressive(runner, prompt, GenerationSettings(longest, sampling, seed=version)))
    dcfg = tiny.drafter_config(cfg, version=version, block_size=16)
    weights = tree_flatten(tiny.build_drafter(dcfg).parameters())
    for block in range(2, 17):
        n_tokens = block * (block + 1) + 4
        wanted = list(range(block))
        drafter = tiny.OracleDrafter(dcfg, prompt + plain, tiny.corrupted_for(len(prompt), wanted, block))
        drafter.load_weights(weights)
        settings = GenerationSettings(n_tokens, sampling, seed=version, block_size=block)
        events = list(generate_speculative(runner, drafter, prompt, settings))
        assert _tokens(events) == plain[:n_tokens]
        assert [e.accepted for e in events if e.accepted is not None][: len(wanted)] == wanted


class _MirrorDrafter(tiny.OracleDrafter):
    """A drafter whose logits at each row are the target's own for the position the row drafts
    (from one pass over the known continuation): its distribution q is the target's p."""

    def __init__(self, config, weights, target_logits):
        super().__init__(config, [], set())
        self.load_weights(weights)
        self.table = target_logits  # [positions, V]: row m predicts sequence position m + 1

    def logits(self, hidden, lm_head):
        real = super().logits(hidden, lm_head)  # [1, R, V] (the forward still runs)
        return 0 * real + mx.take(self.table, self._block_pos + mx.arange(hidden.shape[1]), axis=0)


def test_a_drafter_whose_distribution_is_the_targets_has_every_sampled_draft_kept(hybrid_target):
    """DFlash 1 drafting with q = p draws each row with the noise the target's draw for the same
    position uses, so every draft equals the target's draw: every block is kept whole, through
    plain steps and blocks drafted ahead of a host sync alike."""
    from dflash2_mlx.decoding.sampling import SamplingSettings
    from dflash2_mlx.policies.block_size import ScheduledBlocks

    cfg, model = hybrid_target
    runner = TargetRunner(model)
    prompt, sampling = [3, 1, 4, 1, 5], SamplingSettings(temperature=1.0, top_p=0.9)
    plain = _tokens(generate_autoregressive(runner, prompt, GenerationSettings(60, sampling, seed=9)))
    table, _ = runner(mx.array([prompt + plain]), runner.make_cache())
    dcfg = tiny.drafter_config(cfg, version=1, block_size=8)
    drafter = _MirrorDrafter(dcfg, tree_flatten(tiny.build_drafter(dcfg).parameters()), table[0])
    for policy in (ScheduledBlocks([6]), ScheduledBlocks([4, 1, 1, 8, 2, 1])):
        events = list(
            generate_speculative(runner, drafter, prompt, GenerationSettings(60, sampling, seed=9, policy=policy))
        )
        assert _tokens(events) == plain
        kept = [(e.accepted, e.drafted) for e in events if e.accepted is not None]
        assert len(kept) > 5 and all(a == d for a, d in kept[:-1])
