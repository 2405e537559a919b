"""Training code, by job; none of it is needed at run time (importing ``dflash2_mlx`` does not
import it).

- ``drafter/``: the DFlash 2 drafter trainer and its data (``dflash2-mlx train-drafter``, and
  both builds below);
- ``demo_pair/``: the embedded tiny demo pair's build
  (``python -m dflash2_mlx.training.build_demo_pair``, an entry module kept at that path);
- ``smollm2/``: the SmolLM2 drafter's staged build
  (``python -m dflash2_mlx.training.build_smollm2_drafter``, likewise).

Shared by both builds: ``corpus`` (the Python standard library's own source as a deterministic
train / held-out split), ``evaluation`` with ``metrics`` (a pair's acceptance, identical-output
check, repetition and the prompt-lookup baseline on held-out prompts) and ``build_common`` (the
pinned BLAS thread count, the build's log).
"""
