"""The backend: which device and code paths run, the optimised BLAS loaded before MLX, file hashing and
JSONL reading, progress bars. Imports nothing else of the package."""
