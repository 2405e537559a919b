"""Request parameters -> generation settings.

``GenParams`` is plain data checked on the event loop (every problem a 400 naming the field);
``to_settings`` builds the engine's ``GenerationSettings`` and logits processors on the worker
thread, so that every MLX array is made by the thread that owns the model. Penalties and
logit_bias are logits processors: the engine applies them to each verify row with the history
plain decoding would have seen, so speculative decoding stays lossless with them on. Structured
output (``structured.OutputConstraint``: JSON mode, a JSON schema, forced tool calls) becomes the
engine's grammar, which masks every verify row the same way.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

from dflash2_mlx.server.errors import bad_request
from dflash2_mlx.server.schemas import MAX_STOP, MAX_TOP_LOGPROBS
from dflash2_mlx.server.structured import OutputConstraint

MAX_STOP_CHARS = 512
MAX_LOGIT_BIAS = 2048


@dataclass
class GenParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    constraint: Optional[OutputConstraint] = None  # structured output (structured.py)

    @property
    def forces_tool_calls(self) -> bool:
        return self.constraint is not None and self.constraint.forces_tool_calls


def check_max_tokens(value: Optional[int], default: int, param: str = "max_tokens") -> int:
    if value is None:
        return default
    if value < 1:
        raise bad_request(f"{param} must be at least 1, got {value}", param)
    return value


def build_params(
    req,
    *,
    max_tokens: int,
    vocab_size: int,
    defaults: dict,
    stop=None,
    logprobs: bool = False,
    top_logprobs: int = 0,
    constraint: Optional[OutputConstraint] = None,
) -> GenParams:
    """Check the sampling fields shared by all routes (``req`` has temperature, top_p, ... attributes)."""
    from dflash2_mlx.decoding.sampling import SamplingSettings

    n = getattr(req, "n", None)
    if n is not None and n != 1:
        raise bad_request(f"n must be 1: this server generates one choice per request (got n={n})", "n")
    temperature = _pick(getattr(req, "temperature", None), defaults.get("temperature"), 0.0)
    top_p = _pick(getattr(req, "top_p", None), defaults.get("top_p"), 1.0)
    top_k = _pick(getattr(req, "top_k", None), defaults.get("top_k"), 0)
    min_p = _pick(getattr(req, "min_p", None), defaults.get("min_p"), 0.0)
    if top_k == -1:
        top_k = 0  # vLLM's spelling of "off"
    if top_p == 0:
        top_p, top_k = 1.0, 1  # OpenAI accepts 0: keep only the most likely token
    try:
        SamplingSettings(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k), min_p=float(min_p))
    except ValueError as e:
        raise bad_request(str(e)) from None
    seed = getattr(req, "seed", None)
    stops = _stops(stop if stop is not None else getattr(req, "stop", None))
    bias = _logit_bias(getattr(req, "logit_bias", None), vocab_size)
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {top_logprobs}", "top_logprobs")
    return GenParams(
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        min_p=float(min_p),
        seed=None if seed is None else seed % 2**64,
        stop=stops,
        presence_penalty=getattr(req, "presence_penalty", None),
        frequency_penalty=getattr(req, "frequency_penalty", None),
        repetition_penalty=getattr(req, "repetition_penalty", None),
        logit_bias=bias,
        logprobs=logprobs or top_logprobs > 0,
        top_logprobs=top_logprobs,
        constraint=constraint,
    )


def _pick(*values):
    return next(v for v in values if v is not None)


def _stops(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP:
        raise bad_request(f"at most {MAX_STOP} stop strings are allowed, got {len(stops)}", "stop")
    for s in stops:
        if len(s) > MAX_STOP_CHARS:
            raise bad_request(f"a stop string may have at most {MAX_STOP_CHARS} characters", "stop")
    return [s for s in stops if s]


def _logit_bias(bias, vocab_size: int) -> dict[int, float]:
    if not bias:
        return {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries", "logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise bad_request(
                f"logit_bias token id {token} is outside the vocabulary (0..{vocab_size - 1})", "logit_bias"
            )
        if not -100 <= value <= 100:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")
        out[token] = float(value)
    return out


def to_settings(
    p: GenParams, tokenizer, cancel: threading.Event, prompt: Sequence[int] = (), block_size: Optional[int] = None
):
    """The engine settings for one request (worker thread only: makes MLX arrays). ``prompt``
    tells whether the answer starts inside a reasoning block (the constraint then starts after it);
    ``block_size``: the server's ``--block-size`` (None: the break-even controller)."""
    from mlx_lm.sample_utils import make_logits_processors

    from dflash2_mlx.decoding.sampling import SamplingSettings
    from dflash2_mlx.engine import GenerationSettings

    processors = list(
        make_logits_processors(
            logit_bias=p.logit_bias or None,
            repetition_penalty=p.repetition_penalty,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
        )
    )
    stop_ids = sorted(tokenizer.eos_token_ids)
    return GenerationSettings(
        max_tokens=p.max_tokens,
        sampling=SamplingSettings(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p),
        seed=p.seed,
        stop_token_ids=stop_ids,
        stop_strings=list(p.stop),
        logits_processors=processors,
        logprobs=max(p.top_logprobs, 1) if p.logprobs else 0,
        cancel=cancel,
        block_size=block_size,
        grammar=_grammar(p.constraint, tokenizer, stop_ids, prompt) if p.constraint is not None else None,
    )


def _grammar(constraint: OutputConstraint, tokenizer, stop_ids: list[int], prompt: Sequence[int]):
    from dflash2_mlx.constraints.grammar import reasoning_end_for

    return constraint.grammar(tokenizer, stop_ids, reasoning_end_for(tokenizer, prompt))
