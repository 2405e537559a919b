"""Threads other than the main one that run MLX work must release MLX's per-thread state themselves.

Since MLX 0.32 every thread has its own default streams and its own ``mx.compile`` cache, kept in
C++ ``thread_local`` storage. A compiled function's cache entry holds Python objects, so when the
thread ends, the cache's destructor takes the GIL to release them. That destructor runs after the
thread's Python function has returned, so ``Thread.join()`` can return before it does. If the
main thread is already finalising the interpreter by then, taking the GIL ends the thread with
``pthread_exit``, whose unwinding through the ``noexcept`` destructor calls ``std::terminate``:
the process aborts with "terminate called without an active exception" (exit code 134) after a
clean shutdown. MLX clears the main thread's cache at exit itself, but not other threads' (see
ml-explore/mlx#4373: "call ``mx.clear_streams()`` in each worker thread").
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

T = TypeVar("T")


def release_thread_mlx_state() -> None:
    """Drop the calling thread's MLX streams and ``mx.compile`` cache, while it can still hold the
    GIL safely. Call it last on a thread that ran MLX work (not on the main thread)."""
    import mlx.core as mx

    mx.clear_streams()


def mlx_thread(target: Callable[..., T]) -> Callable[..., T]:
    """``target`` as a thread body that releases the thread's MLX state when it returns or raises,
    so the thread's end cannot abort the process at interpreter exit (see the module docstring)."""

    @functools.wraps(target)
    def run(*args, **kwargs) -> T:
        try:
            return target(*args, **kwargs)
        finally:
            release_thread_mlx_state()

    return run
