"""The SmolLM2 drafter's staged build (``python -m dflash2_mlx.training.build_smollm2_drafter``,
docs/smollm2.md).

``build`` (command line, stage order, MANIFEST), ``plan`` (every knob, stage markers, atomic
writes), ``prompts`` (stage 1), ``generation`` (batched answers, each as the engine writes it
alone), ``stages`` (stages 2-5), ``cards`` (the model card); ``prompt_sets/`` holds the committed
prompt set and continuation chunks.
"""
