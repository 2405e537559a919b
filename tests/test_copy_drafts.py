"""Copy drafts: the context's own continuation verified instead of the drafter's block.

The index finds the earlier occurrence of the last tokens that agrees the longest; a copy cycle
keeps the output exactly the target's (greedy: token for token; sampled: the exact joint
distribution); the controller copies only where copying is expected to pay; one API key's
answers are never proposed to another key's requests.

Copies here come from a shared index holding the target's own continuation of the prompt,
corrupted at random positions, so that every accepted count of a copy cycle occurs (the copy
drafts' ``OracleDrafter``), and the tests assert that they did.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten

from dflash2_mlx.caches.token_index import BYTES_PER_TOKEN, NGRAM, SharedIndexes, TokenIndex
from dflash2_mlx.decoding.autoregressive import generate_autoregressive
from dflash2_mlx.decoding.sampling import SamplingSettings, probabilities
from dflash2_mlx.decoding.speculative import generate_speculative
from dflash2_mlx.decoding.types import GenerationSettings
from dflash2_mlx.diagnostics.distribution import ALPHA, exact_joint, g_test_pvalue
from dflash2_mlx.models.target import TargetRunner
from dflash2_mlx.policies.block_size import PLAIN, BreakEvenController, PairProfile, ScheduledBlocks


def _tokens(events):
    return [t for e in events for t in e.tokens]


# -- the index ---------------------------------------------------------------------------------


def test_the_index_proposes_what_followed_the_longest_agreeing_earlier_occurrence():
    index = TokenIndex()
    index.add([9, 1, 2, 3, 50, 51])  # agrees on 3 tokens with the tail below
    index.add([7, 8, 1, 2, 3, 60, 61, 62])  # agrees on 5
    index.add([4, 1, 2, 3, 70])  # agrees on 3, latest
    match = index.longest_match([5, 7, 8, 1, 2, 3], max_tokens=2)
    assert match.continuation == [60, 61] and match.agreement == 5
    # among equal agreements the latest occurrence wins
    assert index.longest_match([0, 1, 2, 3], max_tokens=5).continuation == [70]


def test_a_growing_sequence_never_matches_its_own_end_and_indexes_what_is_appended():
    tokens = [1, 2, 3, 4, 1, 2]
    index = TokenIndex()
    index.track(tokens)
    assert index.longest_match(tokens, 8) is None  # (1, 2) is shorter than an n-gram
    tokens.append(3)
    match = index.longest_match(tokens, 8)
    assert match.continuation == [4, 1, 2, 3] and match.agreement == 3
    tokens += [9, 9, 9]
    assert index.longest_match(tokens, 8) is None  # (9, 9, 9) only occurs at the end


def test_no_match_shorter_than_an_ngram_is_proposed():
    index = TokenIndex()
    index.add([1, 2, 5, 6])
    assert NGRAM >= 3
    assert index.longest_match([7, 1, 2], 4) is None


def test_a_byte_budget_forgets_the_oldest_answers_first():
    index = TokenIndex(max_bytes=30 * BYTES_PER_TOKEN)
    index.add(list(range(100, 120)))
    index.add(list(range(200, 220)))  # over budget: the first answer goes
    assert index.bytes <= 30 * BYTES_PER_TOKEN
    assert index.longest_match([100, 101, 102], 3) is None
    assert index.longest_match([200, 201, 202], 3).continuation == [203, 204, 205]
    assert all(seq_id in index.sequences for places in index.grams.values() for seq_id, _ in places)


def test_one_keys_answers_are_never_proposed_to_another_keys_request(hybrid_target):
    """A request drafts from its own key's earlier answers and never from another key's."""
    cfg, model = hybrid_target
    runner = TargetRunner(model)
    prompt = [11, 22, 33, 44, 55]
    answer = _tokens(generate_autoregressive(runner, prompt, GenerationSettings(max_tokens=30)))
    indexes = SharedIndexes(max_bytes=1 << 20)
    drafter = tiny.build_drafter(tiny.drafter_config(cfg, version=2, block_size=8), seed=1)

    def run(key):
        settings = GenerationSettings(
            max_tokens=30, copy_index=indexes.for_key(key), policy=ScheduledBlocks([2], copies=[8])
        )
        return list(generate_speculative(runner, drafter, prompt, settings))

    run("alice")  # alice's answer joins alice's index
    assert indexes.for_key("alice").sequences and not indexes.for_key("bob").sequences
    bob = run("bob")
    assert _tokens(bob) == answer
    assert bob[-1].stats.by_source["copy"]["cycles"] == 0  # the prompt itself never repeats
    alice = run("alice")
    assert _tokens(alice) == answer
    assert alice[-1].stats.by_source["copy"]["accepted"] > 0  # drafted from her earlier answer


# -- exactness ---------------------------------------------------------------------------------


def _corrupted_index(rng, prompt, continuation, rate):
    seq = list(prompt) + list(continuation)
    for i in range(len(prompt) + 1, len(seq)):
        if rng.random() < rate:
            seq[i] = (seq[i] + 1 + rng.randrange(tiny.VOCAB - 5)) % (tiny.VOCAB - 4)
    index = TokenIndex(source="shared")
    index.add(seq)
    return index


def test_greedy_output_equals_plain_with_copy_drafts_under_random_schedules(hybrid_target, plain_target):
    """Copy cycles of every length up to 31 tokens, mixed with the drafter's blocks and plain
    steps, emit exactly plain decoding's tokens; every accepted count of the copies occurred."""
    targets = {"hybrid": hybrid_target, "plain": plain_target}
    rng = random.Random(39)
    seen = defaultdict(set)  # copied tokens verified -> accepted counts seen
    copy_cycles = 0
    for case in range(24):
        kind = rng.choice(["hybrid", "plain"])
        cfg, model = targets[kind]
        runner = TargetRunner(model)
        prompt = [rng.randrange(0, tiny.VOCAB - 4) for _ in range(rng.randint(3, 16))]
        plain = _tokens(generate_autoregressive(runner, prompt, GenerationSettings(max_tokens=64)))
        index = _corrupted_index(rng, prompt, plain, rng.choice([0.03, 0.1, 0.3]))
        dcfg = tiny.drafter_config(cfg, version=1 + case % 2, block_size=16)
        drafter = tiny.build_drafter(dcfg, seed=case)
        schedule = [rng.choice([1, 2, 3, 8]) for _ in range(7)]
        copies = [rng.choice([0, 1, 2, 3, 5, 7, 11, 15, 23, 31]) for _ in range(5)]
        policy = ScheduledBlocks(schedule, copies=copies)
        settings = GenerationSettings(max_tokens=64, policy=policy, copy_index=index)
        events = list(generate_speculative(runner, drafter, prompt, settings))
        assert _tokens(events) == plain
        for e in events:
            if e.source == "copy":
                seen[e.drafted].add(e.accepted)
                copy_cycles += 1
        stats = events[-1].stats
        assert stats.by_source["copy"]["cycles"] + stats.by_source["dflash"]["cycles"] == stats.verify_steps
        assert stats.cycle_tokens + stats.plain_tokens == len(plain) - 1
    assert copy_cycles > 100
    assert max(seen) >= 23
    for drafted in (1, 2, 3):
        assert seen[drafted] == set(range(drafted + 1)), (drafted, seen[drafted])
    for drafted in (5, 7):  # none, all, and most counts between
        assert {0, drafted} <= seen[drafted] and len(seen[drafted]) > drafted // 2 + 1, (drafted, seen[drafted])
    assert any(drafted in seen[drafted] for drafted in seen if drafted >= 15), seen  # a long copy kept whole


@pytest.mark.slow
def test_sampled_copy_drafts_keep_the_targets_joint_distribution():
    """The first three generated tokens, the last two from a copy cycle (a deterministic
    proposal accepted and rejected by the target's own probabilities), follow the target's
    exact joint distribution."""
    vocab = 6
    cfg = tiny.hybrid_config(vocab=vocab, hidden=32)
    runner = TargetRunner(tiny.build_target(cfg, seed=3, scale=1.5))
    sampling = SamplingSettings(temperature=0.9, top_p=0.95)
    prompt = [1, 4, 2, 3, 1, 4]

    def next_probs(generated):
        logits, _ = runner(mx.array([prompt + list(generated)]), runner.make_cache())
        return np.array(probabilities(logits[0, -1:], sampling))[0]

    exact = np.zeros((vocab,) * 3)
    for seq, p in exact_joint(next_probs, 3).cells.items():
        exact[seq] = p
    dcfg = tiny.drafter_config(cfg, version=2, block_size=4, mask_token_id=vocab - 1, top_k=3)
    drafter = tiny.build_drafter(dcfg, seed=5)
    # whatever the first token t, the tail (1, 4, t) has a copy: the index knows (1, 4, t, x, y)
    # with x, y drawn anew for each generation (a proposal independent of the target's draws)
    rng = np.random.default_rng(0)
    # n = 800: a copy accepted or refused against the wrong row or distribution is a gross error
    n, counts, copies, accepted_any = 800, np.zeros(vocab**3), 0, 0
    for seed in range(n):
        index = TokenIndex(source="shared")
        for t in range(vocab):
            index.add([1, 4, t] + [int(x) for x in rng.integers(0, vocab, size=2)])
        settings = GenerationSettings(
            max_tokens=3, sampling=sampling, seed=seed, copy_index=index, policy=ScheduledBlocks([2], copies=[2])
        )
        events = list(generate_speculative(runner, drafter, prompt, settings))
        toks = _tokens(events)
        counts[np.ravel_multi_index(toks, (vocab,) * 3)] += 1
        copy_events = [e for e in events if e.source == "copy"]
        copies += bool(copy_events)
        accepted_any += any(e.accepted for e in copy_events)
    assert copies > 0.2 * n and 0.05 * n < accepted_any < copies
    assert g_test_pvalue(counts, exact.ravel()) > ALPHA


# -- the controller ----------------------------------------------------------------------------


def _controller(step=0.05, per_row=0.01, draft=0.02) -> BreakEvenController:
    profile = PairProfile(7)
    costs = profile.cost_table(greedy=True)
    costs.observe(PLAIN, 100, step)
    for b in range(2, 9):
        costs.observe(b, 100, step + draft + per_row * b)
    for _ in range(30):  # a drafter that is never right: plain steps pay
        profile.acceptance(0.0).observe(8, 0, 0.9)
    return BreakEvenController(profile, 8, greedy=True, temperature=0.0)


def test_the_controller_copies_a_long_agreeing_match_and_stops_when_copies_are_refused():
    controller = _controller()
    controller.choose(100)
    assert controller.mode == "plain"  # the drafter does not pay
    drafts = controller.choose_copy(100, agreement=30, available=40)
    assert drafts >= 7  # a long agreement is trusted with a long copy
    for _ in range(12):  # ... until copies of that class are refused
        controller.observe(drafts + 1, 0, 0.05 + 0.01 * (drafts + 1), 100, copied=30)
    assert controller.choose_copy(100, agreement=30, available=40) == 0
    assert controller.summary()["tokens_by_mode"]["copy"] == 12


def test_copy_costs_are_learnt_from_copy_cycles_and_start_from_the_block_table():
    controller = _controller()
    block4 = controller.costs.estimate(4, 100)
    assert controller.copying.cost(4, 100) == pytest.approx(block4)  # untimed: the block's price
    assert controller.copying.cost(24, 100) > controller.copying.cost(8, 100)  # extrapolated
    controller.observe(4, 3, 0.03, 100, copied=8)
    assert controller.copying.cost(4, 100) == pytest.approx(0.03)


def test_pinned_block_sizes_never_copy():
    from dflash2_mlx.policies.block_size import FixedBlock

    assert FixedBlock(4).choose_copy(100, agreement=60, available=30) == 0


def test_copy_drafting_can_be_turned_off(hybrid_target):
    cfg, model = hybrid_target
    runner = TargetRunner(model)
    prompt = [5, 6, 7, 8]
    answer = _tokens(generate_autoregressive(runner, prompt, GenerationSettings(max_tokens=20)))
    index = TokenIndex(source="shared")
    index.add(prompt + answer)
    dcfg = tiny.drafter_config(cfg, version=2, block_size=8)
    drafter = tiny.OracleDrafter(dcfg, prompt + answer, set())
    drafter.load_weights(tree_flatten(tiny.build_drafter(dcfg, seed=0).parameters()))
    policy = ScheduledBlocks([2], copies=[4])
    settings = GenerationSettings(max_tokens=20, policy=policy, copy_index=index, copy_drafting=False)
    events = list(generate_speculative(runner, drafter, prompt, settings))
    assert _tokens(events) == answer
    assert events[-1].stats.by_source["copy"]["cycles"] == 0 and len(index.sequences) == 1


def test_the_server_tells_clients_apart_by_the_key_they_present():
    """The copy index a request reads and feeds is keyed by the credential it presents (a digest),
    whether the server checks keys or not; x-api-key and a Bearer token of the same key match."""
    from starlette.requests import Request

    from dflash2_mlx.server.dependencies import client_key

    def request(**headers):
        raw = [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]
        return Request({"type": "http", "headers": raw})

    alice, bob = client_key(request(authorization="Bearer alice")), client_key(request(authorization="Bearer bob"))
    assert alice and bob and alice != bob and "alice" not in alice
    assert client_key(request(x_api_key="alice")) == alice
    assert client_key(request()) == "" and client_key(request(authorization="Basic xyz")) == ""
    indexes = SharedIndexes(max_bytes=1 << 20)
    indexes.for_key(alice).add([1, 2, 3, 4])
    assert indexes.for_key(bob).longest_match([1, 2, 3], 1) is None
    assert indexes.for_key(alice).longest_match([1, 2, 3], 1).continuation == [4]


def test_a_copy_the_grammar_refuses_is_cut_where_it_is_refused_and_output_stays_exact(tmp_path, hybrid_target):
    """Under a JSON schema a copy is verified only up to the first token the grammar refuses, and
    constrained speculative greedy output equals constrained plain greedy output."""
    from dflash2_mlx.constraints.grammar import Grammar

    tiny.write_tokenizer(tmp_path)
    tokenizer = tiny.load_tokenizer(tmp_path)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    grammar = Grammar.json_schema(schema, tokenizer, [tiny.EOS_ID])
    cfg, model = hybrid_target
    runner = TargetRunner(model)
    prompt = [3, 40, 7]
    settings = GenerationSettings(max_tokens=48, grammar=grammar, stop_token_ids=[tiny.EOS_ID])
    plain = _tokens(generate_autoregressive(runner, prompt, settings))
    # the comma after the name: a "}" there is refused (the schema requires "n")
    comma = next(k for k in range(len(plain)) if tokenizer.decode(plain[: k + 1]).rstrip().endswith(","))
    index = TokenIndex(source="shared")
    index.add(prompt + plain)
    index.add(prompt + plain[:comma] + tokenizer.encode("}}}}}}", add_special_tokens=False))  # latest: proposed first
    drafter = tiny.build_drafter(tiny.drafter_config(cfg, version=2, block_size=8), seed=2)
    policy = ScheduledBlocks([2], copies=[31])
    events = list(generate_speculative(runner, drafter, prompt, replace(settings, policy=policy, copy_index=index)))
    assert _tokens(events) == plain
    ends, emitted = [], 0
    for e in events:
        if e.source == "copy":
            ends.append(emitted + e.drafted)  # the answer position the copy's last draft stands at
        emitted += len(e.tokens)
    assert comma in ends  # a copy stopped right before the refused "}"
