"""Temporary re-export: the decode loops moved to ``dflash2_mlx.decoding`` (one module per purpose).

Importers still name ``dflash2_mlx.engine`` in this wave; import from ``dflash2_mlx.decoding.*``
in new code. This module goes once every importer has moved.
"""

from dflash2_mlx.decoding.autoregressive import generate_autoregressive  # noqa: F401
from dflash2_mlx.decoding.context_feed import UNSEEN_BATCH  # noqa: F401
from dflash2_mlx.decoding.output import OutputCollector, collect  # noqa: F401
from dflash2_mlx.decoding.picking import logprob_list, pick_token, token_logprobs  # noqa: F401
from dflash2_mlx.decoding.prefill import prefill, prefill_and_pick, prefill_chunks  # noqa: F401
from dflash2_mlx.decoding.setup import check_prompt, start_request  # noqa: F401
from dflash2_mlx.decoding.speculative import generate_speculative, speculative_steps  # noqa: F401
