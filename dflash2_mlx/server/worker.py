"""The one generation thread: it loads the models, owns them, the prefix cache and every MLX call.

Requests wait in a bounded FIFO queue; up to ``max_concurrent`` of them are active at once and take
turns, one engine step each (a prefill chunk or a decode cycle), in the order
``scheduler.RoundRobin`` gives. Unless ``--batch-verify off``, every active request takes its step
in each round, and the round's verify passes run as one batched target call where
``batch_switch.BatchSwitch`` says so (``batched_verify.step_together``; outputs are the same). Each
``Job`` is answered through an asyncio queue on the event loop that submitted it: ``("start",
None)`` when the worker admits it, ``("event", GenerationEvent)`` per engine event, ``("error",
APIError)`` on failure, and ``("end", None)`` last. A job's ``cancel`` event (set on client
disconnect, timeout or shutdown) is checked by the engine between prefill chunks and between cycles.
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
from typing import Any, Callable, Iterator, Optional

from dflash2_mlx.backend.threads import mlx_thread
from dflash2_mlx.caches.token_index import SharedIndexes
from dflash2_mlx.policies.batch_switch import BatchSwitch
from dflash2_mlx.server.errors import APIError, context_overflow
from dflash2_mlx.server.metrics import Metrics
from dflash2_mlx.server.scheduler import RoundRobin
from dflash2_mlx.server.stall_trace import StallTrace, threshold_from_env

log = logging.getLogger("dflash2_mlx.server")
COPY_INDEX_BYTES = 64 * 2**20  # per API key: earlier answers copy drafts are taken from (--copy-index-mb)
GAUGE_REFRESH = 5.0  # seconds: memory and prefix-cache gauges are refreshed at idle, and this often under load


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
    client: str = ""  # who asked (a digest of the API key it presented; "" for none): its copy index
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


@dataclass
class Active:
    """A job the worker has admitted: its generation, open between steps."""

    job: Job
    events: Iterator  # the engine's generator; next() runs one step
    started: float  # perf_counter() at admission
    ttft: Optional[float] = None
    steps: int = 0  # steps taken so far (the first one opens the generation: prefix lookup, prefill)
    last_step: str = ""  # what the last step was, for the stall trace


class Worker:
    def __init__(
        self,
        model: str,
        draft_model: Optional[str],
        *,
        max_queue: int = 64,
        max_concurrent: int = 4,
        batch_verify: str = "auto",
        max_context: Optional[int] = None,
        prefix_cache_bytes: int = 2 * 2**30,
        prompt_cache_dir: Optional[Path] = None,
        prompt_cache_bytes: int = 8 * 2**30,
        metrics: Optional[Metrics] = None,
        on_fatal: Optional[Callable[[str], None]] = None,
        loader: Optional[Callable[[], tuple]] = None,
        block_size: Optional[int] = None,
        copy_drafting: bool = True,
        copy_index_bytes: int = COPY_INDEX_BYTES,
    ):
        self.model_path, self.draft_path = model, draft_model
        # copy drafts from each API key's earlier answers (caches/token_index); never shared across keys
        self.copy_drafting = copy_drafting
        self.copy_indexes = SharedIndexes(copy_index_bytes) if copy_drafting and copy_index_bytes > 0 else None
        self.block_size = block_size  # None: the break-even controller picks each cycle's
        self.max_queue = max_queue
        self.max_concurrent = max_concurrent
        self.batch_switch = BatchSwitch(batch_verify)  # batch a round's verify passes, or take turns
        self.max_context_limit = max_context
        self.prefix_cache_bytes = prefix_cache_bytes
        self.prompt_cache_dir, self.prompt_cache_bytes = prompt_cache_dir, prompt_cache_bytes
        self.metrics = metrics or Metrics()
        self.on_fatal = on_fatal
        self._loader = loader
        self.state = "loading"  # loading -> ready -> stopping; or failed
        self.error: Optional[str] = None
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._active: RoundRobin[Active] = RoundRobin(max_concurrent)  # changed under _cond
        self._clear_requested = False
        self._gauges_refreshed = 0.0  # time.monotonic() of the last _refresh_gauges
        # mlx_thread: the thread frees its MLX compile cache before it ends, or the process can
        # abort at exit after a clean shutdown (backend/threads.py says why)
        self._thread = threading.Thread(target=mlx_thread(self._run), name="dflash2-generation", daemon=True)
        # Set once loaded (read by request handlers, never mutated afterwards).
        self.target = self.drafter = self.tokenizer = None
        self.prefix_cache = None
        self.max_context: Optional[int] = None
        self.vocab_size = 0
        self.defaults: dict = {}
        self.ready = threading.Event()
        self.metrics.queue_depth = self.queue_depth
        self.metrics.active_requests = self.active_requests
        self.metrics.state = lambda: self.state
        self.metrics.copy_index_bytes = lambda: self.copy_indexes.bytes if self.copy_indexes is not None else 0
        self.stall_trace = StallTrace(threshold_from_env())  # DFLASH2_MLX_TRACE_STALLS: log slow turns

    # ---- called from the event loop -----------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def queue_depth(self) -> int:
        return len(self._queue)

    def active_requests(self) -> int:
        return len(self._active)

    def busy(self) -> bool:
        return len(self._active) > 0 or bool(self._queue)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self.state == "loading":
                raise APIError(
                    503,
                    "the model is still loading; retry in a few seconds",
                    code="model_loading",
                    headers={"Retry-After": "5"},
                )
            if self.state != "ready":
                raise APIError(503, "the server is shutting down", code="shutting_down")
            if len(self._queue) >= self.max_queue:
                raise APIError(
                    429,
                    f"the request queue is full ({self.max_queue} waiting); retry later",
                    code="queue_full",
                    headers={"Retry-After": str(max(1, min(30, len(self._queue))))},
                )
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
        """Stop taking work: waiting jobs get a 503, the active ones are cancelled (they end cleanly)."""
        with self._cond:
            if self.state in ("ready", "loading"):
                self.state = "stopping"
            waiting, self._queue = list(self._queue), deque()
            active = [a.job for a in self._active.active()]
            self._cond.notify_all()
        for job in waiting:
            job.state = "done"
            job.stop("shutdown")
            job.emit("error", APIError(503, "the server is shutting down", code="shutting_down"))
            job.emit("end")
        for job in active:
            job.stop("shutdown")

    def join(self, timeout: Optional[float] = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the worker thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._load()
        except Exception as e:  # LoadError and anything else: the server cannot serve
            from dflash2_mlx.models.loading import LoadError

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
        log.info(
            "model %s ready%s",
            self.target.name,
            f" with drafter {self.drafter.path}" if self.drafter is not None else " (no drafter)",
        )
        while True:
            work = self._next_work()
            if work is None:
                break  # stopping and drained
            if work == "clear":
                self._clear_prefix_cache()
                continue
            for job in work:
                active = self._admit(job)
                if active is not None:
                    with self._cond:
                        self._active.add(active)
                        if self.state != "ready":  # shutdown() ran while it was being admitted
                            job.stop("shutdown")
            with self._cond:  # a round: one step of every active job (off: of one, in turn)
                group = self._active.next_group(1 if self.batch_switch.mode == "off" else len(self._active))
            self.stall_trace.begin()
            uncalibrated = self._uncalibrated() if self.stall_trace.enabled else set()
            ended = self._step_group(group)
            if self.stall_trace.enabled:
                calibrated = uncalibrated - self._uncalibrated()
                self.stall_trace.end([self._describe(a, calibrated) for a in group])
            for active, done in zip(group, ended):
                with self._cond:
                    (self._active.finished if done else self._active.requeue)(active)
                    idle = not self._queue and not len(self._active)
                if idle:
                    self._release_memory()
            if time.monotonic() - self._gauges_refreshed > GAUGE_REFRESH:  # busy for long: /metrics stays current
                self._refresh_gauges()
        if self.prefix_cache is not None and self.prefix_cache.disk is not None:
            self.prefix_cache.disk.flush(timeout=10)  # snapshots still queued reach the disk

    def _next_work(self):
        """Wait for work -> the jobs to admit now (maybe none: step the active ones), "clear"
        (drop the prefix cache, when idle), or None (stopping, nothing left)."""
        with self._cond:
            while not self._queue and not len(self._active) and self.state == "ready" and not self._clear_requested:
                if not self._cond.wait(timeout=5.0):
                    self._refresh_gauges()
            idle = not self._queue and not len(self._active)
            if idle and self._clear_requested:
                self._clear_requested = False
                return "clear"
            if idle:
                return None
            room = self._active.max_active - len(self._active)
            return [self._queue.popleft() for _ in range(min(room, len(self._queue)))]

    def _load(self) -> None:
        if self._loader is not None:  # tests: inject already-built objects
            self.target, self.drafter = self._loader()
        else:
            from dflash2_mlx.models.loading import load_pair

            self.target, self.drafter = load_pair(self.model_path, self.draft_path, self.max_context_limit)
        if (
            self.drafter is not None
            and self.block_size is not None
            and self.block_size > self.drafter.config.block_size
        ):
            raise ValueError(
                f"--block-size must be at most {self.drafter.config.block_size} for this drafter, got {self.block_size}"
            )
        import mlx.core as mx

        from dflash2_mlx.caches.disk import open_disk_cache
        from dflash2_mlx.caches.prefix import PrefixCache
        from dflash2_mlx.models.generation_config import generation_defaults
        from dflash2_mlx.models.loading import freeze_loaded_objects

        self.tokenizer = self.target.tokenizer
        runner = self.target.runner
        limits = [n for n in (runner.max_context, self.max_context_limit) if n]
        self.max_context = min(limits) if limits else None
        self.vocab_size = runner.vocab_size or len(self.tokenizer)
        self.defaults = generation_defaults(self.target.path)
        # Constrained decoding needs llguidance's view of the tokenizer (seconds at a 248K
        # vocabulary): build it in the background so the first structured request rarely waits.
        from dflash2_mlx.constraints.grammar import grammar_tokenizer

        threading.Thread(
            target=grammar_tokenizer,
            args=(self.tokenizer, sorted(self.tokenizer.eos_token_ids)),
            name="grammar-tokenizer",
            daemon=True,
        ).start()
        disk = None
        if self.prompt_cache_dir is not None and self.prompt_cache_bytes > 0:
            disk = open_disk_cache(self.prompt_cache_dir, self.prompt_cache_bytes, self.target, self.drafter)
        if self.prefix_cache_bytes > 0 or disk is not None:
            self.prefix_cache = PrefixCache(max_bytes=self.prefix_cache_bytes, disk=disk)
        if self.drafter is not None and self.block_size is None:
            self._calibrate()
        freeze_loaded_objects()  # the loaded models live as long as the server
        mx.clear_cache()
        self.metrics.baseline_memory = mx.get_active_memory()
        self._refresh_gauges()

    def _calibrate(self) -> None:
        """Time the pair's greedy cycles now, while loading, and let sampled decoding start from
        those costs (its cycles refine them): the break-even controller would otherwise calibrate
        inside a request's first step, greedy or sampled, and every request beside it would wait
        seconds (the stall of issue 32: a first sampled request beside a greedy stream)."""
        from functools import partial

        from dflash2_mlx.decoding.sampling import SamplingSettings
        from dflash2_mlx.decoding.speculative import run_calibration_request
        from dflash2_mlx.policies.block_size import ensure_calibrated, profile_for

        t0 = time.perf_counter()
        runner = self.target.runner
        greedy_request = partial(run_calibration_request, runner, self.drafter, SamplingSettings())
        ensure_calibrated(runner, self.drafter, True, greedy_request)
        profile = profile_for(self.target.runner.model, self.drafter)
        if not profile.cost_table(greedy=False).calibrated:
            profile.cost_table(greedy=False).start_from(profile.cost_table(greedy=True))
        log.info("block-size controller calibrated in %.1f s", time.perf_counter() - t0)

    def _admit(self, job: Job) -> Optional[Active]:
        """Open the job's generation (nothing runs yet); None when it ended already."""
        from dataclasses import replace

        from dflash2_mlx.decoding.autoregressive import generate_autoregressive
        from dflash2_mlx.decoding.speculative import speculative_steps
        from dflash2_mlx.server.params import to_settings

        if job.cancel.is_set():
            job.state = "done"
            job.emit("end")
            return None
        job.state = "running"
        job.emit("start")
        try:
            settings = to_settings(job.params, self.tokenizer, job.cancel, job.prompt, self.block_size)
            shared = self.copy_indexes.for_key(job.client) if self.copy_indexes is not None else None
            # others step between its chunks; copies come from this client's own earlier answers
            settings = replace(settings, yield_during_prefill=True, copy_drafting=self.copy_drafting, copy_index=shared)
            runner, tok = self.target.runner, self.tokenizer
            if self.drafter is not None:
                # its verify passes are answered by _step_group: alone, or batched with the others'
                events = speculative_steps(
                    runner, self.drafter, job.prompt, settings, tok, prefix_cache=self.prefix_cache, save_at=job.save_at
                )
            else:
                events = generate_autoregressive(
                    runner, job.prompt, settings, tok, prefix_cache=self.prefix_cache, save_at=job.save_at
                )
        except Exception as e:
            self._fail(job, e)
            return None
        return Active(job, events, time.perf_counter())

    def _step_group(self, group: list[Active]) -> list[bool]:
        """One step of each job (a prefill chunk or a decode cycle), their verify passes batched
        or one each as ``batch_switch`` says (timed for it when every job ran a cycle); hands the
        events over -> per job, True when it has ended."""
        from dflash2_mlx.decoding.batched_verify import Step, step_together

        batched = self.batch_switch.batch(len(group))
        t0 = time.perf_counter()
        try:
            steps = step_together(self.target.runner, [a.events for a in group], batch=batched)
        except Exception as e:  # the (batched) target pass itself failed: every job in it ends
            steps = [Step(error=e) for _ in group]
        cycles = sum(s.event is not None and s.event.accepted is not None for s in steps)
        if cycles == len(group):
            self.batch_switch.record(len(group), batched, time.perf_counter() - t0)
        if batched and cycles > 1:
            self.metrics.batched_verify(cycles)
        return [self._handle(active, step) for active, step in zip(group, steps)]

    def _handle(self, active: Active, step) -> bool:
        """Hand a job's step (``batched_verify.Step``) over; True when the job has ended."""
        job = active.job
        active.steps += 1
        active.last_step = _step_kind(step)
        if step.error is not None:
            active.events.close()
            self._fail(job, step.error)
            return True
        event = step.event
        if event is not None:
            if active.ttft is None and event.tokens:
                active.ttft = time.perf_counter() - active.started
            if event.accepted is not None:
                self.metrics.cycle(len(event.tokens))
            if event.stats is not None:
                self.metrics.finished(event.stats, active.ttft)
            if event.tokens or event.text or event.stats is not None:  # not a pause between prefill chunks
                job.emit("event", event)
        if event is None or event.stats is not None:
            active.events.close()
            job.state = "done"
            job.emit("end")
            return True
        return False

    def _uncalibrated(self) -> set[str]:
        """The kinds of decoding ("greedy", "sampled") whose cycle costs the pair has not timed yet."""
        if self.drafter is None:
            return set()
        from dflash2_mlx.policies.block_size import profile_for

        profile = profile_for(self.target.runner.model, self.drafter)
        return {
            kind for kind, greedy in (("greedy", True), ("sampled", False)) if not profile.cost_table(greedy).calibrated
        }

    @staticmethod
    def _describe(active: Active, calibrated: set[str]) -> str:
        """One phrase for the stall trace: which request took which step."""
        what = active.last_step
        if active.steps == 1:
            what = f"its first step ({what}; prefix-cache lookup and policy set-up"
            what += f"; calibrated the pair's {' and '.join(sorted(calibrated))} cycle costs)" if calibrated else ")"
        return f"request {active.job.id} {what}"

    def _fail(self, job: Job, e: Exception) -> None:
        """End a job on an exception from the engine: the client's fault is a 400, ours a 500."""
        from dflash2_mlx.decoding.types import Cancelled, PromptTooLong

        if isinstance(e, Cancelled):
            job.emit("cancelled")
        elif isinstance(e, PromptTooLong):
            job.emit("error", context_overflow(len(job.prompt), self.target.runner.max_context))
        elif isinstance(e, ValueError):
            job.emit("error", APIError(400, str(e), code="invalid_value"))
        else:
            log.error("request %s: generation failed", job.id, exc_info=e)
            job.emit(
                "error",
                APIError(
                    500,
                    f"internal error while generating; see the server log for request id {job.id}",
                    code="internal_error",
                ),
            )
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
        self._gauges_refreshed = time.monotonic()
        with m.lock:
            m.active_memory = mx.get_active_memory()
            m.peak_memory = mx.get_peak_memory()
            if pc is not None:
                m.prefix_cache_bytes, m.prefix_cache_entries = pc.nbytes, len(pc)
                m.prefix_cache_hits, m.prefix_cache_misses = pc.hits, pc.misses
                m.prefix_cache_disk_hits, m.prefix_cache_too_large = pc.disk_hits, pc.too_large
                if pc.disk is not None:
                    m.prompt_cache_disk_bytes, m.prompt_cache_disk_entries = pc.disk.nbytes, len(pc.disk)


def _step_kind(step) -> str:
    """What a ``batched_verify.Step`` was: a decode cycle, a prefill chunk, the end or a failure."""
    if step.error is not None:
        return f"a failed step ({type(step.error).__name__})"
    event = step.event
    if event is None or event.stats is not None:
        return "its last step"
    if event.accepted is not None:
        return f"a cycle of {len(event.tokens)} tokens"
    return "a prefill chunk" if not event.tokens else f"a step of {len(event.tokens)} tokens"
