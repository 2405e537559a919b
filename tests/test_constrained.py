"""Constrained decoding stays lossless inside the speculative loop.

The grammar masks every verify row with the history plain decoding would have seen (committed
tokens + the drafts before that row), so constrained speculative greedy output is constrained
plain greedy output token for token, and constrained sampling follows the constrained target
distribution exactly. Drafters here are real modules; ``OracleDrafter`` proposes the constrained
continuation corrupted at random positions, so drafts that break the grammar, partial accepts and
full blocks all occur.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten

from dflash2_mlx.constraints.grammar import Grammar, GrammarError, GrammarState, json_schema_rules
from dflash2_mlx.decoding.autoregressive import generate_autoregressive
from dflash2_mlx.decoding.sampling import SamplingSettings, probabilities
from dflash2_mlx.decoding.speculative import generate_speculative
from dflash2_mlx.decoding.types import GenerationSettings
from dflash2_mlx.models.target import TargetRunner

# Every keyword the server promises, in one schema whose language is finite (bounded strings,
# integers and arrays): every constrained generation ends with the stop token by itself.
SCHEMA = {
    "$defs": {
        "point": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["x"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "kind": {"enum": ["cat", "dog", 7]},
        "version": {"const": "v1"},
        "tags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
        "at": {"$ref": "#/$defs/point"},
        "extra": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": -9, "maximum": 9}]},
    },
    "required": ["name", "kind", "version", "tags", "at"],
    "additionalProperties": False,
}
MAX_TOKENS = 160


def _tokens(events):
    return [t for e in events for t in e.tokens]


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    tiny.write_tokenizer(path)
    return tiny.load_tokenizer(path)


@pytest.fixture(scope="module")
def schema_grammar(byte_tokenizer):
    return Grammar.json_schema(SCHEMA, byte_tokenizer, [tiny.EOS_ID])


def _text(tokenizer, tokens):
    return tokenizer.decode([t for t in tokens if t != tiny.EOS_ID])


def test_every_constrained_output_of_a_random_model_validates_against_the_schema(
    hybrid_target, byte_tokenizer, schema_grammar
):
    jsonschema = pytest.importorskip("jsonschema")
    _, model = hybrid_target
    runner = TargetRunner(model)
    texts = set()
    for seed in range(6):
        settings = GenerationSettings(
            max_tokens=MAX_TOKENS,
            grammar=schema_grammar,
            seed=seed,
            sampling=SamplingSettings(temperature=1.0),
            stop_token_ids=[tiny.EOS_ID],
        )
        events = list(generate_autoregressive(runner, [3 + seed, 40, 7], settings))
        assert events[-1].finish_reason == "stop"  # the grammar ended the text, not max_tokens
        text = _text(byte_tokenizer, _tokens(events))
        jsonschema.validate(json.loads(text), SCHEMA)
        texts.add(text)
    assert len(texts) > 3  # sampling explored the schema's language, not one fixed answer


@pytest.mark.slow
def test_constrained_speculative_greedy_equals_constrained_plain_greedy(hybrid_target, plain_target, schema_grammar):
    """40 random set-ups: target kind, drafter version, block size 2..16, oracle drafter corrupted
    at random rates or a random drafter (whose drafts nearly always break the grammar), drafts
    walked under the grammar always, never, or while it pays (the default)."""
    rng = random.Random(20261203)
    targets = {"hybrid": hybrid_target, "plain": plain_target}
    accepted_counts, refused_drafts = set(), 0
    for case in range(40):
        kind = rng.choice(["hybrid", "plain"])
        cfg, model = targets[kind]
        runner = TargetRunner(model)
        prompt = [rng.randrange(0, tiny.VOCAB - 4) for _ in range(rng.randint(1, 12))]
        block = rng.randint(2, 16)
        settings = GenerationSettings(
            max_tokens=MAX_TOKENS, block_size=block, grammar=schema_grammar, stop_token_ids=[tiny.EOS_ID]
        )
        plain = _tokens(generate_autoregressive(runner, prompt, settings))
        dcfg = tiny.drafter_config(cfg, version=rng.choice([1, 2]), block_size=16)
        base = tiny.build_drafter(dcfg, seed=rng.randrange(1000))
        if rng.random() < 0.8:
            continuation = prompt + plain
            corrupt = {
                p for p in range(len(prompt) + 1, len(continuation)) if rng.random() < rng.choice([0.05, 0.2, 0.5])
            }
            refused_drafts += len(corrupt)
            drafter = tiny.OracleDrafter(dcfg, continuation, corrupt)
            drafter.load_weights(tree_flatten(base.parameters()))
        else:
            drafter = base
        settings.mask_drafts = random.Random(case).choice([None, True, False])
        events = list(generate_speculative(runner, drafter, prompt, settings))
        assert _tokens(events) == plain, f"case {case}: {kind}, block {block}, mask_drafts {settings.mask_drafts}"
        accepted_counts |= {e.accepted for e in events if e.accepted is not None}
    assert refused_drafts > 0 and {0, 1, 2, 3} <= accepted_counts and max(accepted_counts) >= 8


@pytest.mark.slow
def test_constrained_speculative_sampling_with_masked_drafts_always_gives_a_valid_answer(
    hybrid_target, plain_target, byte_tokenizer, schema_grammar
):
    """12 random set-ups of sampled DFlash 2 under the schema (the drafts walk the grammar): target
    kind, block size 2..16, temperature, oracle drafter corrupted at random or a random drafter.
    Each answer validates, ends by itself and is plain constrained sampling's with the same seed,
    token for token; the matcher survives every walk and rollback."""
    jsonschema = pytest.importorskip("jsonschema")
    rng = random.Random(20261204)
    targets = {"hybrid": hybrid_target, "plain": plain_target}
    accepted = 0
    for case in range(12):
        kind = rng.choice(["hybrid", "plain"])
        cfg, model = targets[kind]
        runner = TargetRunner(model)
        prompt = [rng.randrange(0, tiny.VOCAB - 4) for _ in range(rng.randint(1, 12))]
        settings = GenerationSettings(
            max_tokens=MAX_TOKENS,
            block_size=rng.randint(2, 16),
            grammar=schema_grammar,
            sampling=SamplingSettings(temperature=rng.choice([0.6, 1.0])),
            seed=case,
            stop_token_ids=[tiny.EOS_ID],
        )
        dcfg = tiny.drafter_config(cfg, version=2, block_size=16)
        drafter = tiny.build_drafter(dcfg, seed=rng.randrange(1000))
        plain = _tokens(generate_autoregressive(runner, prompt, settings))
        if rng.random() < 0.7:  # an oracle of another seed's constrained sample: this one parts from it
            other = _tokens(generate_autoregressive(runner, prompt, replace(settings, seed=case + 100)))
            continuation = prompt + other
            corrupt = {p for p in range(len(prompt) + 1, len(continuation)) if rng.random() < 0.2}
            oracle = tiny.OracleDrafter(dcfg, continuation, corrupt)
            oracle.load_weights(tree_flatten(drafter.parameters()))
            drafter = oracle
        events = list(generate_speculative(runner, drafter, prompt, settings))
        assert events[-1].finish_reason == "stop", f"case {case}: {kind}"
        assert _tokens(events) == plain, f"case {case}: {kind}"
        jsonschema.validate(json.loads(_text(byte_tokenizer, _tokens(events))), SCHEMA)
        accepted += sum(e.accepted or 0 for e in events)
    assert accepted > 0


def test_json_object_mode_gives_an_object_and_stays_lossless(hybrid_target, byte_tokenizer):
    cfg, model = hybrid_target
    runner = TargetRunner(model)
    grammar = Grammar.json_object(byte_tokenizer, [tiny.EOS_ID])
    prompt = [9, 8, 7]
    settings = GenerationSettings(max_tokens=40, block_size=6, grammar=grammar, stop_token_ids=[tiny.EOS_ID])
    plain = _tokens(generate_autoregressive(runner, prompt, settings))
    assert _text(byte_tokenizer, plain).startswith("{")
    dcfg = tiny.drafter_config(cfg, version=2)
    drafter = tiny.OracleDrafter(dcfg, prompt + plain, {6, 11, 17})
    drafter.load_weights(tree_flatten(tiny.build_drafter(dcfg).parameters()))
    assert _tokens(generate_speculative(runner, drafter, prompt, settings)) == plain


def test_a_grammar_after_reasoning_leaves_the_reasoning_free_and_stays_lossless(hybrid_target, byte_tokenizer):
    """With ``reasoning_end`` the text before the closing token is not constrained; after it the
    answer is, and speculative greedy output still equals plain greedy output."""
    jsonschema = pytest.importorskip("jsonschema")
    cfg, model = hybrid_target
    runner = TargetRunner(model)
    prompt, close, think_tokens = [4, 5, 6], 291, 7

    def close_reasoning(history, logits):  # the model "decides" to end its reasoning at token 8
        at = history.shape[-1] == len(prompt) + think_tokens
        return mx.where(mx.arange(logits.shape[-1]) == close, logits + 100.0 * at, logits)

    grammar = Grammar.json_schema(SCHEMA, byte_tokenizer, [tiny.EOS_ID], reasoning_end=[close])
    settings = GenerationSettings(
        max_tokens=MAX_TOKENS,
        block_size=5,
        grammar=grammar,
        stop_token_ids=[tiny.EOS_ID],
        logits_processors=[close_reasoning],
    )
    plain = _tokens(generate_autoregressive(runner, prompt, settings))
    assert plain[think_tokens] == close and plain[-1] == tiny.EOS_ID
    unconstrained = _tokens(generate_autoregressive(runner, prompt, GenerationSettings(max_tokens=think_tokens)))
    assert plain[:think_tokens] == unconstrained  # the reasoning was not masked
    jsonschema.validate(json.loads(_text(byte_tokenizer, plain[think_tokens + 1 :])), SCHEMA)
    dcfg = tiny.drafter_config(cfg, version=2)
    for corrupt in (set(), {5, 9, 14, 30}):
        drafter = tiny.OracleDrafter(dcfg, prompt + plain, corrupt)
        drafter.load_weights(tree_flatten(tiny.build_drafter(dcfg).parameters()))
        assert _tokens(generate_speculative(runner, drafter, prompt, settings)) == plain


def test_verify_masks_follow_the_drafts_and_leave_the_matcher_where_it_was(byte_tokenizer, schema_grammar):
    state = schema_grammar.start()
    good = byte_tokenizer.encode('{"name": "ab", "kind": 7', add_special_tokens=False)
    rows = state.mask_verify(mx.zeros((len(good) + 1, tiny.VOCAB)), good)
    assert all(rows[i, t].item() == 0 for i, t in enumerate(good))  # each draft allowed in its row
    assert (rows[0] > -1).sum().item() == 1  # only "{" may start the answer
    # a refused draft (a key the schema does not have) leaves the rows after it unmasked
    bad = byte_tokenizer.encode('{"zz"', add_special_tokens=False)
    rows = state.mask_verify(mx.zeros((len(bad) + 1, tiny.VOCAB)), bad)
    assert rows[2, bad[2]].item() == -float("inf")
    assert (rows[3:] > -1).all().item()
    # the matcher was rolled back both times: it still expects "{"
    first = state.mask_next(mx.zeros((1, tiny.VOCAB)))
    assert first[0, good[0]].item() == 0 and (first > -1).sum().item() == 1


def test_the_grammar_walk_skips_refused_candidates_for_the_best_allowed_one(byte_tokenizer, schema_grammar):
    """greedy_path: the selector's walk over pair scores, but a candidate the grammar refuses is
    passed over for the best-scoring allowed one, row after row along the chosen path."""
    state = schema_grammar.start()
    brace, quote, x, n = (byte_tokenizer.encode(c, add_special_tokens=False)[0] for c in '{"xn')
    candidates = np.array([[x, brace, quote], [brace, quote, x], [x, n, quote]])
    pairs = np.zeros((3, 3, 3), dtype=np.float32)
    pairs[0, 0] = [3.0, 2.0, 1.0]  # "x" scores best but cannot start the answer: "{" is chosen
    pairs[1, 1] = [3.0, 2.0, 1.0]  # after "{" (slot 1): "{" is refused, '"' is the best allowed
    pairs[2, 1] = [3.0, 2.0, 1.0]  # after '"' (slot 1): "x" starts no key of SCHEMA, "n" (name) does
    assert state.greedy_path(candidates, pairs) == [brace, quote, n]
    # the matcher is back at the start afterwards
    assert (state.mask_next(mx.zeros((1, tiny.VOCAB))) > -1).sum().item() == 1


def _reference_row_masks(state, drafts, rows):
    """The definition of the verify masks: row i is the mask after the drafts before it, one
    ``fill`` per row, until a draft is refused or ends the text (then every token: never used)."""
    from llguidance.numpy import fill_next_token_bitmask

    bits, consumed, stops = np.zeros((rows, state.grammar.words), dtype=np.int32), 0, set(state.grammar.stop_token_ids)
    for i in range(rows):
        fill_next_token_bitmask(state.matcher, bits, i)
        if not bits[i].any():
            for t in stops:
                bits[i, t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))
        if i == rows - 1:
            break
        d = int(drafts[i])
        if d in stops or not (int(bits[i, d >> 5]) >> (d & 31)) & 1 or not state.matcher.consume_token(d):
            bits[i + 1 :] = -1
            break
        consumed += 1
    state.matcher.rollback(consumed)
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, : tiny.VOCAB].astype(bool)
    return allowed


def _reference_greedy_walk(state, candidates, pairs):
    """The definition of the masked greedy walk: at every row, the best-scoring candidate the
    row's mask allows (never a stop token); with none, the best one and no mask from there on."""
    path, prev, consumed, masking = [], 0, 0, True
    for i in range(candidates.shape[0]):
        order = np.argsort(-pairs[i, prev], kind="stable")
        pick = order[0]
        if masking:
            allowed = _reference_row_masks(state, [], 1)[0]
            pick = next((b for b in order if candidates[i, b] != tiny.EOS_ID and allowed[candidates[i, b]]), None)
            if pick is None:
                pick, masking = order[0], False
            else:
                state.matcher.consume_token(int(candidates[i, pick]))
                consumed += 1
        path.append(int(candidates[i, pick]))
        prev = pick
    state.matcher.rollback(consumed)
    return path


def test_verify_masks_and_the_greedy_walk_equal_their_row_by_row_definitions(byte_tokenizer, schema_grammar):
    """The engine fills a verify block's masks in one native call and checks the greedy walk's
    drafts in bulk, building a row's mask only where its best candidate is refused: both must give
    exactly what masking every row one at a time gives, from any point of the answer, for drafts
    that follow the grammar, break it, or end the text."""
    rng = random.Random(11)
    answer = byte_tokenizer.encode(
        '{"name": "ab", "kind": "dog", "version": "v1", "tags": [true], "at": {"x": 4}}', add_special_tokens=False
    )
    near = sorted(set(answer)) + [tiny.EOS_ID, 5, 6]  # tokens that are often, not always, allowed
    checked = refused = 0
    for case in range(300):
        state = schema_grammar.start()
        start = rng.randrange(len(answer) + 1)  # up to a complete answer: then only the stop token
        state.commit(answer[:start])
        rows = rng.randint(1, 9)
        drafts = [
            answer[start + i] if start + i < len(answer) and rng.random() < 0.75 else rng.choice(near)
            for i in range(rows - 1)
        ]
        got = np.array(state.mask_verify(mx.zeros((rows, tiny.VOCAB)), drafts)) == 0
        assert (got == _reference_row_masks(state, drafts, rows)).all(), (case, start, drafts)
        k = rng.randint(1, 6)
        candidates = np.array([[rng.choice(near) for _ in range(k)] for _ in range(rows)])
        pairs = np.array(
            [[[rng.choice((0.0, 1.0, 2.0, 3.0)) for _ in range(k)] for _ in range(k)] for _ in range(rows)],
            dtype=np.float32,
        )  # ties: the walk breaks them by slot
        walk = state.greedy_path(candidates, pairs)
        assert walk == _reference_greedy_walk(state, candidates, pairs), (case, start)
        assert state.matcher.validate_tokens(answer[start:]) == len(answer) - start  # rolled back
        checked += 1
        prev, unmasked = 0, []
        for i in range(rows):
            prev = int(np.argmax(pairs[i, prev]))
            unmasked.append(int(candidates[i, prev]))
        refused += walk != unmasked
    assert checked == 300 and 15 < refused < 285  # walks with refused best candidates, and without


def test_drafts_are_walked_while_refused_drafts_end_the_accepted_run(byte_tokenizer, schema_grammar):
    """``walk_pays``: walking is on at the start; cycles whose selector path was refused at a draft
    the run reached keep it on, cycles with every draft allowed (or refused only after the run
    had ended) turn it off, and refusals coming back turn it on again."""
    answer = byte_tokenizer.encode(
        '{"name": "ab", "kind": "dog", "version": "v1", "tags": [true, false, true], "at": {"x": 42}, "extra": null}',
        add_special_tokens=False,
    )
    bad = byte_tokenizer.encode("~", add_special_tokens=False)[0]  # never allowed outside a string
    state, at, seen = schema_grammar.start(), 0, []

    def cycle(drafts, accepted):  # verify masks for these drafts, then the commit of accepted + bonus
        nonlocal at
        state.mask_verify(mx.zeros((len(drafts) + 1, tiny.VOCAB)), drafts)
        state.commit(answer[at : at + accepted + 1])
        at += accepted + 1
        seen.append(state.walk_pays)

    assert state.walk_pays
    for _ in range(3):  # refused at draft 1, and the run reached it: the walk could have helped
        cycle([answer[at], bad, answer[at + 2]], 1)
    assert seen == [True] * 3
    for _ in range(6):  # all allowed; then refused after the run had ended at draft 0: neither counts
        cycle(answer[at : at + 2] if len(seen) % 2 else [answer[at], answer[at + 1], bad], 1 if len(seen) % 2 else 0)
    assert seen[-1] is False
    for _ in range(3):
        cycle([bad, answer[at + 1]], 0)
    assert seen[-1] is True


def test_a_complete_answer_allows_only_the_stop_tokens(byte_tokenizer):
    grammar = Grammar.json_schema({"const": "x"}, byte_tokenizer, [tiny.EOS_ID, 297])
    state = grammar.start()
    state.commit(byte_tokenizer.encode('"x"', add_special_tokens=False))
    allowed = np.flatnonzero(np.array(state.mask_next(mx.zeros((1, tiny.VOCAB)))[0]) > -1)
    assert allowed.tolist() == [297, tiny.EOS_ID]


@pytest.mark.parametrize(
    "keyword, schema",
    [
        ("not", {"not": {"type": "string"}}),
        ("uniqueItems", {"type": "array", "uniqueItems": True}),
        ("if", {"if": {"type": "string"}, "then": {"minLength": 2}}),
        ("contains", {"type": "array", "contains": {"type": "integer"}}),
    ],
)
def test_a_keyword_the_engine_cannot_enforce_is_named(keyword, schema):
    with pytest.raises(GrammarError) as err:
        json_schema_rules(schema)
    assert err.value.keyword == keyword and repr(keyword) in str(err.value)


def test_strict_mode_closes_objects_that_do_not_say_otherwise(byte_tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    extra = byte_tokenizer.encode('{"a": 1, "b"', add_special_tokens=False)
    for strict, allowed in [(False, True), (True, False)]:
        state = Grammar.json_schema(schema, byte_tokenizer, [tiny.EOS_ID], strict=strict).start()
        rows = state.mask_verify(mx.zeros((len(extra) + 1, tiny.VOCAB)), extra)
        comma = len(byte_tokenizer.encode('{"a": 1', add_special_tokens=False))
        assert (rows[comma, extra[comma]].item() == 0) == allowed


# ---- sampling -----------------------------------------------------------------------------------

# A finite language over the letters a..d whose allowed next letters depend on the history.
LANGUAGE = ["aba", "abd", "acc", "bad", "bbc", "bdb", "cab", "cdd", "dcb", "ddc"]


def _allowed(prefix: list[int]) -> set[int]:
    letters = "".join("abcd"[t] for t in prefix)
    return {"abcd".index(s[len(letters)]) for s in LANGUAGE if s.startswith(letters) and len(s) > len(letters)}


def _exact_constrained_joint(runner, prompt, sampling, vocab):
    """P(t1 t2 t3 | prompt) under the target's processed distributions restricted to LANGUAGE."""
    table = np.zeros((vocab,) * 3)

    def walk(prefix, mass):
        out = prefix[len(prompt) :]
        logits, _ = runner(mx.array([prefix]), runner.make_cache())
        keep = mx.array([t in _allowed(out) for t in range(vocab)])
        p = np.array(probabilities(mx.where(keep, logits[0, -1:], -float("inf")), sampling))[0]
        for t in range(vocab):
            if p[t] == 0:
                continue
            if len(out) == 2:
                table[tuple(out + [t])] = mass * p[t]
            else:
                walk(prefix + [t], mass * p[t])

    walk(list(prompt), 1.0)
    return table


class _WalkRecorder:
    """The grammar, whose states keep every walk of the selector under it: (the selector's own
    path, the walked one), to see that sampled drafts were walked and refused candidates skipped."""

    def __init__(self, grammar: Grammar):
        self.grammar, self.walks = grammar, []

    def start(self) -> GrammarState:
        state, walks = self.grammar.start(), self.walks

        def greedy_path(candidates, pairs, unmasked=None):
            path = GrammarState.greedy_path(state, candidates, pairs, unmasked)
            walks.append((list(unmasked), path))
            return path

        state.greedy_path = greedy_path
        return state


@pytest.mark.slow
@pytest.mark.parametrize("version, mask_drafts", [(1, True), (2, True), (2, False)])
def test_constrained_speculative_sampling_matches_the_constrained_joint_distribution(version, mask_drafts, tmp_path):
    """The first three tokens (prefill's, then a cycle's drafts, accept/reject and bonus, all under
    the grammar's masks) follow the exact constrained joint distribution (G-test at ALPHA), with
    DFlash 2's drafts walked under the grammar (its noised greedy walk over the allowed
    candidates) or not."""
    from dflash2_mlx.diagnostics.distribution import ALPHA, g_test_pvalue

    eos, mask = tiny.write_letters_tokenizer(tmp_path)
    tokenizer = tiny.load_tokenizer(tmp_path)
    grammar = _WalkRecorder(Grammar("answer: " + " | ".join(json.dumps(s) for s in LANGUAGE), tokenizer, [eos]))
    vocab = mask + 1
    cfg = tiny.hybrid_config(vocab=vocab, hidden=32)
    runner = TargetRunner(tiny.build_target(cfg, seed=3, scale=1.5))
    sampling = SamplingSettings(temperature=0.9, top_p=0.95)
    prompt = [1, 0, 2]
    exact = _exact_constrained_joint(runner, prompt, sampling, vocab).ravel()
    assert exact.sum() == pytest.approx(1.0, abs=1e-4)
    dcfg = tiny.drafter_config(cfg, version=version, block_size=4, mask_token_id=mask, top_k=3)
    drafter = tiny.build_drafter(dcfg, seed=5)
    counts = np.zeros_like(exact)
    accepted_any = 0
    n = 1200
    for seed in range(n):
        settings = GenerationSettings(
            max_tokens=3,
            sampling=sampling,
            seed=seed,
            block_size=3,
            grammar=grammar,
            stop_token_ids=[eos],
            mask_drafts=mask_drafts,
        )
        events = list(generate_speculative(runner, drafter, prompt, settings))
        toks = [t for e in events for t in e.tokens]
        counts[np.ravel_multi_index(toks, (vocab,) * 3)] += 1
        accepted_any += any((e.accepted or 0) > 0 for e in events)
    assert 0.05 * n < accepted_any < n  # drafts were both accepted and rejected
    assert g_test_pvalue(counts, exact) > ALPHA
    if version == 2 and mask_drafts:  # every cycle walked the grammar, which refused candidates
        assert len(grammar.walks) >= n and sum(own != walked for own, walked in grammar.walks) > 0.3 * n
    else:
        assert not grammar.walks
