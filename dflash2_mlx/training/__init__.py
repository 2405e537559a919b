"""Training code for the embedded tiny demo pair (``python -m dflash2_mlx.training.build_demo_pair``).

- ``corpus``: the Python standard library's own source as a deterministic train / held-out split.
- ``tokenizer``: a byte-level BPE tokenizer with a ChatML template, in the Hugging Face layout.
- ``target_trainer``: the tiny Qwen3.5-architecture hybrid target (mlx-lm ``qwen3_5``).
- ``data`` / ``drafter_trainer``: the DFlash 2 drafter trained on the target's own continuations;
  the trainer's pieces are ``drafter_training_config`` (settings), ``drafter_init`` (config and
  initialisation), ``drafter_batches`` (one step's seeded data), ``target_features`` (the frozen
  target's taps), ``drafter_loss``, ``drafter_eval`` (held-out acceptance), ``drafter_checkpoint``
  (save and resume) and ``drafter_schedule`` (learning rate, progress line).
- ``build_demo_pair``: the one command that rebuilds ``dflash2_mlx/assets/`` from scratch, from
  ``demo_plan`` (the recipes), ``demo_stages`` (corpus, tokenizer, documents, target, drafter),
  ``demo_evaluation`` with ``demo_metrics`` (acceptance, repetition, the prompt-lookup baseline)
  and ``demo_cards`` (READMEs, model card, summary from MANIFEST.json).

None of this is needed at run time; importing ``dflash2_mlx`` does not import it.
"""
