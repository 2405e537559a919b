"""Caches: the target's (KV trim, Gated DeltaNet rollback), the drafter's context K/V, and prompt-prefix
snapshots (``snapshot``, one entry) in memory (``prefix``) and on disk (``disk``)."""
