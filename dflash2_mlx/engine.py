"""Temporary re-export: the decode loops moved to ``dflash2_mlx.decoding`` (one module per purpose).

Importers still name ``dflash2_mlx.engine`` in this wave; import from ``dflash2_mlx.decoding.*``
in new code. This module goes once every importer has moved.
"""

from .decoding.autoregressive import generate_autoregressive  # noqa: F401
from .decoding.context_feed import UNSEEN_BATCH  # noqa: F401
from .decoding.output import OutputCollector, collect  # noqa: F401
from .decoding.picking import logprob_list, pick_token, token_logprobs  # noqa: F401
from .decoding.prefill import prefill, prefill_and_pick, prefill_chunks  # noqa: F401
from .decoding.setup import check_prompt, start_request  # noqa: F401
from .decoding.speculative import generate_speculative, speculative_steps  # noqa: F401
from .decoding.types import (  # noqa: F401
    Cancelled,
    GenerationEvent,
    GenerationSettings,
    GenerationStats,
    PromptTooLong,
)
