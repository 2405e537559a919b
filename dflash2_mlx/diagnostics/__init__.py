"""Diagnostics: prompt-set benchmarking (``bench``) and the acceptance report of ``doctor --report``."""
