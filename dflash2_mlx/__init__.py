"""dflash2-mlx: lossless DFlash 2 speculative decoding on MLX."""

from dflash2_mlx.backend import blas as _blas

_blas.preload()  # before any submodule imports mlx.core (see blas.py)

__version__ = "0.1.0"
