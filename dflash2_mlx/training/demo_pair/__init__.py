"""The embedded tiny demo pair's build (``python -m dflash2_mlx.training.build_demo_pair``).

``build`` is the one command that rebuilds ``dflash2_mlx/assets/`` from scratch, from ``plan``
(the recipes), ``stages`` (corpus, tokenizer, documents, target, drafter), ``tokenizer`` (a
byte-level BPE tokenizer with a ChatML template), ``target_trainer`` (the tiny Qwen3.5-architecture
hybrid target) and ``cards`` (READMEs, model card, summary from MANIFEST.json); ``ablation`` is the
tiny-scale ablation of DFlash 2's parts.
"""
