"""The drafter trainer and its data (``dflash2-mlx train-drafter``, both model builds).

- ``data``: corpus windows followed by the target's own continuation (greedy or sampled);
- ``trainer``: ``train_drafter``, the training loop, with its pieces: ``config`` (the settings),
  ``initialise`` (the drafter's config and initialisation), ``batches`` (one step's seeded data),
  ``features`` (the frozen target's taps), ``loss``, ``checkpoint`` (save and resume),
  ``schedule`` (learning rate, progress line) and ``evaluation`` (held-out acceptance);
- ``draft_vocab``: the token ids a DFlash 2 drafter's head scores (also a command).
"""
