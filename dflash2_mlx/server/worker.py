"""The one generation thread: it loads the models, owns them, the prefix cache and every MLX call.

Requests wait in a bounded FIFO queue. Each ``Job`` is answered through an asyncio queue on the
event loop that submitted it: ``("start", None)`` when the worker picks it up, ``("event",
GenerationEvent)`` per engine event, ``("error", APIError)`` on failure, and ``("end", None)``
last. A job's ``cancel`` event (set on client disconnect, timeout or shutdown) is checked by the
engine between prefill chunks and between cycles.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from .errors import APIError
from .metrics import Metrics

log = logging.getLogger("dflash2_mlx.server")


@dataclass
class Job:
    id: str
    prompt: list[int]
    params: Any  # params.GenParams: turned into GenerationSettings on the worker thread
    save_at: list[int]
    loop: asyncio.AbstractEventLoop
    deadline: float  # time.monotonic() after which the request is cut short
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    state: str = "queued"  # queued -> running -> done
    why_cancelled: Optional[str] = None  # "client", "timeout" or "shutdown"
    submitted: float = field(default_factory=time.monotonic)

    def emit(self, kind: str, payload: Any = None) -> None:
        """Hand an item to the request's coroutine (called from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is gone (server shut down): nobody is listening
            self.cancel.set()

    def stop(self, why: str) -> None:
        if self.why_cancelled is None:
            self.why_cancelled = why
        self.cancel.set()


class Worker:
    def __init__(
        self,
        model: str,
        draft_model: Optional[str],
        *,
        max_queue: int = 64,
        max_context: Optional[int] = None,
        prefix_cache_bytes: int = 2 * 2**30,
        metrics: Optional[Metrics] = None,
        on_fatal: Optional[Callable[[str], None]] = None,
        loader: Optional[Callable[[], tuple]] = None,
    ):
        self.model_path, self.draft_path = model, draft_model
        self.max_queue = max_queue
        self.max_context_limit = max_context
        self.prefix_cache_bytes = prefix_cache_bytes
        self.metrics = metrics or Metrics()
        self.on_fatal = on_fatal
        self._loader = loader
        self.state = "loading"  # loading -> ready -> stopping; or failed
        self.error: Optional[str] = None
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._current: Optional[Job] = None
        self._clear_requested = False
        self._thread = threading.Thread(target=self._run, name="dflash2-generation", daemon=True)
        # Set once loaded (read by request handlers, never mutated afterwards).
        self.target = self.drafter = self.tokenizer = None
        self.prefix_cache = None
        self.max_context: Optional[int] = None
        self.vocab_size = 0
        self.defaults: dict = {}
        self.ready = threading.Event()
        self.metrics.queue_depth = self.queue_depth
        self.metrics.state = lambda: self.state

    # ---- called from the event loop -----------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def queue_depth(self) -> int:
        return len(self._queue)

    def busy(self) -> bool:
        return self._current is not None or bool(self._queue)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self.state == "loading":
                raise APIError(503, "the model is still loading; retry in a few seconds", code="model_loading",
                               headers={"Retry-After": "5"})
            if self.state != "ready":
                raise APIError(503, "the server is shutting down", code="shutting_down")
            if len(self._queue) >= self.max_queue:
                raise APIError(429, f"the request queue is full ({self.max_queue} waiting); retry later",
                               code="queue_full", headers={"Retry-After": str(max(1, min(30, len(self._queue))))})
            self._queue.append(job)
            self._cond.notify()

    def withdraw(self, job: Job) -> bool:
        """Remove a job that has not started; True if it was still waiting."""
        with self._cond:
            try:
                self._queue.remove(job)
            except ValueError:
                return False
            job.state = "done"
            return True

    def request_clear_cache(self) -> None:
        """Drop the prefix cache and return freed memory (e.g. on SIGUSR1); done when idle."""
        with self._cond:
            self._clear_requested = True
            self._cond.notify()

    def shutdown(self) -> None:
        """Stop taking work: waiting jobs get a 503, the running one is cancelled (it ends cleanly)."""
        with self._cond:
            if self.state in ("ready", "loading"):
                self.state = "stopping"
            waiting, self._queue = list(self._queue), deque()
            current = self._current
            self._cond.notify_all()
        for job in waiting:
            job.state = "done"
            job.stop("shutdown")
            job.emit("error", APIError(503, "the server is shutting down", code="shutting_down"))
            job.emit("end")
        if current is not None:
            current.stop("shutdown")

    def join(self, timeout: Optional[float] = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the worker thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._load()
        except Exception as e:  # LoadError and anything else: the server cannot serve
            from dflash2_mlx.loading import LoadError

            self.error = str(e) if isinstance(e, LoadError) else f"{type(e).__name__}: {e}"
            if not isinstance(e, LoadError):
                log.exception("loading failed")
            self.state = "failed"
            if self.on_fatal:
                self.on_fatal(self.error)
            return
        with self._cond:
            if self.state == "loading":
                self.state = "ready"
        self.ready.set()
        log.info("model %s ready%s", self.target.name,
                 f" with drafter {self.drafter.path}" if self.drafter is not None else " (no drafter)")
        while True:
            with self._cond:
                while not self._queue and self.state == "ready" and not self._clear_requested:
                    if not self._cond.wait(timeout=5.0):
                        self._refresh_gauges()
                if self._clear_requested and not self._queue:
                    self._clear_requested = False
                    clear = True
                else:
                    clear = False
                if not clear and not self._queue:
                    return  # stopping and drained
                job = None if clear else self._queue.popleft()
                self._current = job
            if clear:
                self._clear_prefix_cache()
                continue
            try:
                self._serve(job)
            finally:
                with self._cond:
                    self._current = None
                    idle = not self._queue
                if idle:
                    self._release_memory()

    def _load(self) -> None:
        if self._loader is not None:  # tests: inject already-built objects
            self.target, self.drafter = self._loader()
        else:
            from dflash2_mlx.loading import load_drafter, load_target, validate_pair

            self.target = load_target(self.model_path)
            if self.draft_path is not None:
                self.drafter = load_drafter(self.draft_path)
                validate_pair(self.target.runner, self.drafter.config, self.target.name)
        import mlx.core as mx

        from dflash2_mlx.loading import freeze_loaded_objects
        from dflash2_mlx.prefix_cache import PrefixCache

        self.tokenizer = self.target.tokenizer
        runner = self.target.runner
        limits = [n for n in (runner.max_context, self.max_context_limit) if n]
        self.max_context = min(limits) if limits else None
        self.vocab_size = runner.vocab_size or len(self.tokenizer)
        self.defaults = _generation_defaults(self.target.path)
        if self.prefix_cache_bytes > 0:
            self.prefix_cache = PrefixCache(max_bytes=self.prefix_cache_bytes)
        freeze_loaded_objects()  # the loaded models live as long as the server
        mx.clear_cache()
        self.metrics.baseline_memory = mx.get_active_memory()
        self._refresh_gauges()

    def _serve(self, job: Job) -> None:
        from dflash2_mlx.engine import Cancelled, PromptTooLong, generate_autoregressive, generate_speculative

        from .params import to_settings

        if job.cancel.is_set():
            job.state = "done"
            job.emit("end")
            return
        job.state = "running"
        job.emit("start")
        t0 = time.perf_counter()
        ttft = None
        try:
            settings = to_settings(job.params, self.tokenizer, job.cancel, len(job.prompt))
            runner, tok = self.target.runner, self.tokenizer
            if self.drafter is not None:
                events = generate_speculative(runner, self.drafter, job.prompt, settings, tok,
                                              prefix_cache=self.prefix_cache, save_at=job.save_at)
            else:
                events = generate_autoregressive(runner, job.prompt, settings, tok,
                                                 prefix_cache=self.prefix_cache, save_at=job.save_at)
            for event in events:
                if ttft is None and event.tokens:
                    ttft = time.perf_counter() - t0
                if event.accepted is not None:
                    self.metrics.cycle(len(event.tokens))
                if event.stats is not None:
                    self.metrics.finished(event.stats, ttft)
                job.emit("event", event)
        except Cancelled:
            job.emit("cancelled")
        except PromptTooLong as e:
            job.emit("error", APIError(400, str(e), code="context_length_exceeded", param="messages"))
        except ValueError as e:
            job.emit("error", APIError(400, str(e), code="invalid_value"))
        except Exception:
            log.exception("request %s: generation failed", job.id)
            job.emit("error", APIError(500, f"internal error while generating; see the server log for request id {job.id}",
                                       code="internal_error"))
        finally:
            job.state = "done"
            job.emit("end")

    def _release_memory(self) -> None:
        import mlx.core as mx

        gc.collect()
        mx.clear_cache()
        self._refresh_gauges()

    def _clear_prefix_cache(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        log.info("prefix cache cleared")
        self._release_memory()

    def _refresh_gauges(self) -> None:
        import mlx.core as mx

        m, pc = self.metrics, self.prefix_cache
        with m.lock:
            m.active_memory = mx.get_active_memory()
            m.peak_memory = mx.get_peak_memory()
            if pc is not None:
                m.prefix_cache_bytes, m.prefix_cache_entries = pc.nbytes, len(pc)
                m.prefix_cache_hits, m.prefix_cache_misses = pc.hits, pc.misses


def _generation_defaults(path: Path) -> dict:
    """Defaults from the model's generation_config.json: sampling (temperature, top_p, top_k,
    min_p) and the answer length (max_new_tokens: the server's max_tokens when a request and
    --default-max-tokens give none)."""
    import json

    try:
        cfg = json.loads((Path(path) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(cfg, dict):
        return {}
    out = {}
    limit = cfg.get("max_new_tokens")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        out["max_new_tokens"] = limit
    if cfg.get("do_sample") is False:
        return out
    for key in ("temperature", "top_p", "top_k", "min_p"):
        value = cfg.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = value
    return out
