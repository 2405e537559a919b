"""CPU harness that compiles the Metal kernel bodies in metal/ with g++ (test-only).

Use ``from kernel_harness import harness`` (tests/ is on sys.path under pytest's default import
mode) and ``with kernels.override(**harness.harness_kernels()): ...`` to run code through the
harness-compiled kernels.
"""
