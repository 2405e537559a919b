"""A seed reproduces a sampled request, speculative or not, whatever block sizes the break-even
controller chose and whatever else ran beside it (each token is the request's keyed draw at its
position: ``decoding/sampling.py``).

The requests here run the embedded demo pair (a trained drafter, so the controller really
speculates, with blocks of its choosing) at T 0.7, top-p 0.9.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import mlx.core as mx
import pytest

from dflash2_mlx.decoding.autoregressive import generate_autoregressive
from dflash2_mlx.decoding.batched_verify import run_together
from dflash2_mlx.decoding.sampling import SamplingSettings
from dflash2_mlx.decoding.speculative import generate_speculative, speculative_steps
from dflash2_mlx.decoding.types import GenerationSettings

SAMPLING = SamplingSettings(temperature=0.7, top_p=0.9)
PROMPT = "def fibonacci(n):"
OTHER_PROMPT = "class Stack:\n    def push(self, item):"


@pytest.fixture(scope="module")
def pair(embedded_pair):
    from dflash2_mlx.models.loading import load_pair

    target, drafter = load_pair(*map(str, embedded_pair))
    return target, drafter, target.tokenizer.encode(PROMPT), target.tokenizer.encode(OTHER_PROMPT)


def _tokens(events) -> list[int]:
    return [t for e in events for t in e.tokens]


def test_the_same_seeded_request_gives_the_same_tokens_beside_other_requests(pair):
    """Five runs of one seeded request under the controller, with unseeded and other seeded
    requests (speculative and plain) run between them and interleaved with them cycle by cycle:
    every run gives plain sampled decoding's tokens for that seed."""
    target, drafter, prompt, other = pair
    runner = target.runner
    seeded = GenerationSettings(max_tokens=48, sampling=SAMPLING, seed=1234)
    plain = _tokens(generate_autoregressive(runner, prompt, seeded))
    runs, sizes = [], set()
    for run in range(5):
        if run % 2:  # between runs: an unseeded request and another seed's, each moving the global state
            _tokens(generate_speculative(runner, drafter, other, replace(seeded, seed=None)))
            _tokens(generate_autoregressive(runner, other, replace(seeded, seed=run)))
            mx.random.uniform(shape=(3,))
        if run < 3:
            events = list(generate_speculative(runner, drafter, prompt, seeded))
            runs.append(_tokens(events))
            sizes |= {e.drafted + 1 for e in events if e.accepted is not None}
        else:  # in lock step with two other requests, verify passes batched
            loops = [
                speculative_steps(runner, drafter, other, replace(seeded, seed=None)),
                speculative_steps(runner, drafter, prompt, seeded),
                speculative_steps(runner, drafter, other, replace(seeded, seed=77, block_size=3)),
            ]
            tokens = defaultdict(list)
            for i, event in run_together(runner, loops, batch=run == 3):
                tokens[i] += event.tokens
            runs.append(tokens[1])
    assert runs == [plain] * 5
    assert sizes  # the controller speculated (blocks of its choosing)


def test_unseeded_requests_differ_and_follow_the_global_seed(pair):
    """Without a seed a request draws its key from MLX's global random state: two unseeded runs
    differ, and after ``mx.random.seed`` the same unseeded run repeats."""
    target, drafter, prompt, _ = pair
    unseeded = GenerationSettings(max_tokens=24, sampling=SAMPLING, block_size=4)
    runs = []
    for global_seed in (5, 5, 6):
        mx.random.seed(global_seed)
        runs.append(_tokens(generate_speculative(target.runner, drafter, prompt, unseeded)))
    assert runs[0] == runs[1] != runs[2]


@pytest.mark.slow
def test_a_seeded_chat_request_repeats_through_the_server_beside_other_requests(embedded_pair, tmp_path):
    """Through a real server (the openai SDK's ``seed``), the break-even controller choosing block
    sizes and two requests decoding at once: the same seeded request (T 0.7, top-p 0.9) gives the
    same answer five times in a row and five times beside unseeded requests."""
    from concurrent.futures import ThreadPoolExecutor

    from server_helpers import running_server

    openai = pytest.importorskip("openai")
    target, drafter = embedded_pair
    args = ["--model", str(target), "--draft-model", str(drafter), "--max-concurrent", "2", "--max-context", "512"]
    with running_server(args, tmp_path / "server.log", wait=900) as srv:  # calibrates at load
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0, timeout=120)

        def complete(seed):
            kw = {"seed": seed} if seed is not None else {}
            messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
            r = client.chat.completions.create(
                model="tiny-code-demo-target", messages=messages, max_tokens=40, temperature=0.7, top_p=0.9, **kw
            )
            return r.choices[0].message.content

        alone = [complete(1234) for _ in range(5)]
        with ThreadPoolExecutor(4) as pool:
            beside = list(pool.map(complete, [1234, None, 1234, None, 1234, 1234, None, 1234]))
        other_seed = complete(4321)
    assert len(set(alone)) == 1
    assert {beside[i] for i in (0, 2, 4, 5, 7)} == set(alone)
    assert other_seed != alone[0]  # the seed matters
