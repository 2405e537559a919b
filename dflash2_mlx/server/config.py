"""What ``dflash2-mlx serve`` tells the app: the models, the limits, the key, the served names."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from dflash2_mlx.server.responses.store import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES

MAX_BODY_BYTES = 4 * 2**20
FALLBACK_MAX_TOKENS = 4096  # a request's max_tokens when neither it, the server nor the model sets one


@dataclass
class ServerConfig:
    model: str
    draft_model: Optional[str] = None
    api_key: Optional[str] = None
    allowed_origins: Sequence[str] = ()
    max_queue: int = 64
    max_concurrent: int = 4
    batch_verify: str = "auto"  # batch the active requests' verify passes: auto (measured), on, off
    max_context: Optional[int] = None
    served_model_names: Sequence[str] = ()
    prefix_cache_gb: float = 2.0
    prompt_cache_dir: Optional[str] = None  # prefix snapshots on disk (the CLI's default: disk_cache.default_dir())
    prompt_cache_gb: float = 8.0
    request_timeout: float = 600.0
    default_max_tokens: Optional[int] = None  # None: generation_config.json's max_new_tokens, else 4096
    max_body_bytes: int = MAX_BODY_BYTES
    model_name: Optional[str] = None  # shown in /v1/models; default: repo id or directory name
    responses_max_entries: int = DEFAULT_MAX_ENTRIES  # stored /v1/responses (previous_response_id), LRU
    responses_max_bytes: int = DEFAULT_MAX_BYTES
    copy_drafting: bool = True  # --no-copy-drafting turns copy drafts off
    copy_index_mb: float = 64.0  # per API key: earlier answers kept for copy drafts (0: none kept)


def model_name_for(model: str) -> str:
    """The name a model is served under: its repo id, or its directory's name (as loading.Target.name)."""
    path = Path(model).expanduser()
    return path.resolve().name if path.exists() else model
