"""Kernels: the reference specification (``reference``), launch plans and the Metal sources (``plans``,
``metal/``), the per-dtype self-check (``selfcheck``) and the dispatch callers use (``dispatch``)."""
