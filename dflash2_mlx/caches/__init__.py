"""Caches: the target's (KV trim, Gated DeltaNet rollback), the drafter's context K/V, and prompt-prefix
snapshots in memory (``prefix``) and on disk (``disk``)."""
