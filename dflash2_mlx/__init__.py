"""dflash2-mlx: lossless DFlash 2 speculative decoding on MLX.

The public Python API, as mlx-lm's package exposes its own::

    from dflash2_mlx import GenerationSettings, assets, collect, generate_speculative, load_pair

    target, drafter = load_pair(str(assets.demo_target_path()), str(assets.demo_drafter_path()))
    tokens, stats = collect(generate_speculative(target.runner, drafter, target.tokenizer.encode("def f("),
                                                 GenerationSettings(max_tokens=32)))

Names are imported on first use (PEP 562), so ``import dflash2_mlx.backend.device`` stays cheap and
the package's layers never import the package itself. docs/engine-api.md describes each one.
"""

from importlib import import_module
from typing import TYPE_CHECKING

from dflash2_mlx.backend import blas as _blas

_blas.preload()  # before any submodule imports mlx.core (see backend/blas.py)

__version__ = "0.1.0"

# public name -> the module that defines it
_API = {
    # loading the pair
    "load_pair": "dflash2_mlx.models.loading",
    "load_target": "dflash2_mlx.models.loading",
    "load_drafter": "dflash2_mlx.models.loading",
    "LoadError": "dflash2_mlx.models.loading",
    "Target": "dflash2_mlx.models.loading",
    # the two decoders, their settings, events and statistics
    "generate_speculative": "dflash2_mlx.decoding.speculative",
    "generate_autoregressive": "dflash2_mlx.decoding.autoregressive",
    "collect": "dflash2_mlx.decoding.output",
    "GenerationSettings": "dflash2_mlx.decoding.types",
    "GenerationEvent": "dflash2_mlx.decoding.types",
    "GenerationStats": "dflash2_mlx.decoding.types",
    "PromptTooLong": "dflash2_mlx.decoding.types",
    "Cancelled": "dflash2_mlx.decoding.types",
    "SamplingSettings": "dflash2_mlx.decoding.sampling",
    # the prompt cache and the grammar
    "PrefixCache": "dflash2_mlx.caches.prefix",
    "DiskPrefixCache": "dflash2_mlx.caches.disk",
    "Grammar": "dflash2_mlx.constraints.grammar",
    "GrammarError": "dflash2_mlx.constraints.grammar",
}
_SUBMODULES = {"assets"}

__all__ = [
    "Cancelled",
    "DiskPrefixCache",
    "GenerationEvent",
    "GenerationSettings",
    "GenerationStats",
    "Grammar",
    "GrammarError",
    "LoadError",
    "PrefixCache",
    "PromptTooLong",
    "SamplingSettings",
    "Target",
    "collect",
    "generate_autoregressive",
    "generate_speculative",
    "load_drafter",
    "load_pair",
    "load_target",
    "assets",
    "__version__",
]


def __getattr__(name: str):
    if name in _API:
        value = getattr(import_module(_API[name]), name)
    elif name in _SUBMODULES:
        value = import_module(f"dflash2_mlx.{name}")
    else:
        raise AttributeError(f"module 'dflash2_mlx' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # for editors and type checkers: the same names, imported eagerly
    from dflash2_mlx import assets
    from dflash2_mlx.caches.disk import DiskPrefixCache
    from dflash2_mlx.caches.prefix import PrefixCache
    from dflash2_mlx.constraints.grammar import Grammar, GrammarError
    from dflash2_mlx.decoding.autoregressive import generate_autoregressive
    from dflash2_mlx.decoding.output import collect
    from dflash2_mlx.decoding.sampling import SamplingSettings
    from dflash2_mlx.decoding.speculative import generate_speculative
    from dflash2_mlx.decoding.types import (
        Cancelled,
        GenerationEvent,
        GenerationSettings,
        GenerationStats,
        PromptTooLong,
    )
    from dflash2_mlx.models.loading import LoadError, Target, load_drafter, load_pair, load_target
