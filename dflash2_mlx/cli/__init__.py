"""The dflash2-mlx command line (installed as dflash2_mlx.cli)."""
