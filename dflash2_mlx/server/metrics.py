"""Server metrics in the Prometheus text format (no client library: a few counters and histograms).

Updated from the event-loop thread (requests) and the worker thread (tokens, memory); one lock.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Callable, Optional, Sequence

PREFIX = "dflash2_mlx"


class Histogram:
    def __init__(self, buckets: Sequence[float]):
        self.buckets = list(buckets)
        self.counts = [0] * len(self.buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
        self.total += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{_fmt(b)}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.total}')
        out.append(f"{name}_sum {_fmt(self.sum)}")
        out.append(f"{name}_count {self.total}")
        return out


def _fmt(v: float) -> str:
    if isinstance(v, int) or float(v).is_integer():
        return str(int(v))
    return repr(float(v))


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.started = time.time()
        self.requests = defaultdict(int)  # (route, status) -> count
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generation_tokens = 0
        self.generations = defaultdict(int)  # finish_reason -> count
        self.verify_steps = 0
        self.cycle_tokens = 0
        self.drafted_tokens = 0
        self.accepted_tokens = 0
        self.tokens_by_mode = defaultdict(int)  # the block-size policy's speculative / plain / probe tokens
        self.block_size_cycles = defaultdict(int)  # block size (1: plain step) -> cycles
        self.decode_seconds = 0.0
        self.last_decode_tps = 0.0
        self.in_flight = 0
        self.batched_verify_calls = 0  # target calls that ran several requests' verify passes
        self.batched_verify_passes = 0  # the verify passes they ran
        # Tokens a verify cycle emitted (the acceptance length of that cycle): 1..block size.
        self.cycle_hist = Histogram(list(range(1, 17)))
        self.ttft_hist = Histogram([0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120])
        self.decode_tps_hist = Histogram([1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000])
        self.active_memory = 0
        self.peak_memory = 0
        self.baseline_memory = 0
        self.prefix_cache_bytes = 0
        self.prefix_cache_entries = 0
        self.prefix_cache_hits = 0
        self.prefix_cache_misses = 0
        self.prefix_cache_disk_hits = 0
        self.prefix_cache_too_large = 0
        self.prompt_cache_disk_bytes = 0
        self.prompt_cache_disk_entries = 0
        self.queue_depth: Callable[[], int] = lambda: 0
        self.active_requests: Callable[[], int] = lambda: 0
        self.state: Callable[[], str] = lambda: "loading"
        self.copy_index_bytes: Callable[[], int] = lambda: 0
        # draft source ("dflash", "copy") -> {"cycles", "drafted", "accepted"}
        self.by_source = defaultdict(lambda: defaultdict(int))

    def request(self, route: str, status: int) -> None:
        with self.lock:
            self.requests[(route, status)] += 1

    def cycle(self, emitted: int) -> None:
        with self.lock:
            self.cycle_hist.observe(emitted)

    def batched_verify(self, passes: int) -> None:
        with self.lock:
            self.batched_verify_calls += 1
            self.batched_verify_passes += passes

    def finished(self, stats, ttft: Optional[float]) -> None:
        with self.lock:
            self.prompt_tokens += stats.prompt_tokens
            self.cached_tokens += getattr(stats, "cached_tokens", 0) or 0
            self.generation_tokens += stats.generation_tokens
            self.generations[stats.finish_reason or "unknown"] += 1
            self.verify_steps += stats.verify_steps
            self.cycle_tokens += getattr(stats, "cycle_tokens", 0)
            self.drafted_tokens += stats.drafted_tokens
            self.accepted_tokens += stats.accepted_tokens
            self.decode_seconds += stats.decode_seconds
            controller = getattr(stats, "controller", None) or {}
            for mode, n in controller.get("tokens_by_mode", {}).items():
                self.tokens_by_mode[mode] += n
            for source, counts in (getattr(stats, "by_source", None) or {}).items():
                for what, n in counts.items():
                    self.by_source[source][what] += n
            for size, n in controller.get("block_sizes", {}).items():
                self.block_size_cycles[int(size)] += n
            if stats.generation_tokens > 1 and stats.decode_tps > 0:
                self.last_decode_tps = stats.decode_tps
                self.decode_tps_hist.observe(stats.decode_tps)
            if ttft is not None:
                self.ttft_hist.observe(ttft)

    def render(self) -> str:
        p = PREFIX
        with self.lock:
            lines = [
                f"# HELP {p}_up 1 when the model is loaded and serving.",
                f"# TYPE {p}_up gauge",
                f"{p}_up {int(self.state() == 'ready')}",
                f"# HELP {p}_requests_total HTTP requests by route and status code.",
                f"# TYPE {p}_requests_total counter",
            ]
            for (route, status), n in sorted(self.requests.items()):
                lines.append(f'{p}_requests_total{{route="{route}",status="{status}"}} {n}')
            lines += [
                f"# HELP {p}_generations_total Finished generations by finish reason.",
                f"# TYPE {p}_generations_total counter",
            ]
            for reason, n in sorted(self.generations.items()):
                lines.append(f'{p}_generations_total{{finish_reason="{reason}"}} {n}')
            lines += [
                f"# HELP {p}_tokens_by_mode_total Generated tokens by decoding mode (speculative cycles, "
                "the controller's plain steps, its probes).",
                f"# TYPE {p}_tokens_by_mode_total counter",
            ]
            for mode, n in sorted(self.tokens_by_mode.items()):
                lines.append(f'{p}_tokens_by_mode_total{{mode="{mode}"}} {n}')
            lines += [
                f"# HELP {p}_block_size_cycles_total Decode cycles by block size (1: a plain step).",
                f"# TYPE {p}_block_size_cycles_total counter",
            ]
            for size, n in sorted(self.block_size_cycles.items()):
                lines.append(f'{p}_block_size_cycles_total{{block_size="{size}"}} {n}')
            for what, help_text in (
                ("cycles", "Verify cycles by draft source (dflash: the drafter's blocks, copy: the context's)."),
                ("drafted", "Drafted tokens by draft source."),
                ("accepted", "Drafted tokens accepted by the target, by draft source."),
            ):
                name = f"{p}_{what}_by_source_total"
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
                for source, counts in sorted(self.by_source.items()):
                    lines.append(f'{p}_{what}_by_source_total{{source="{source}"}} {counts[what]}')
            scalars = [
                ("prompt_tokens_total", "counter", "Prompt tokens of finished generations.", self.prompt_tokens),
                (
                    "prompt_cached_tokens_total",
                    "counter",
                    "Prompt tokens restored from the prefix cache.",
                    self.cached_tokens,
                ),
                ("generation_tokens_total", "counter", "Generated tokens.", self.generation_tokens),
                ("verify_steps_total", "counter", "Speculative verify cycles.", self.verify_steps),
                ("cycle_tokens_total", "counter", "Tokens emitted by verify cycles.", self.cycle_tokens),
                ("draft_tokens_total", "counter", "Drafted tokens.", self.drafted_tokens),
                (
                    "batched_verify_calls_total",
                    "counter",
                    "Target calls that ran several requests' verify passes at once.",
                    self.batched_verify_calls,
                ),
                (
                    "batched_verify_passes_total",
                    "counter",
                    "Verify passes run inside batched target calls.",
                    self.batched_verify_passes,
                ),
                ("accepted_tokens_total", "counter", "Drafted tokens accepted by the target.", self.accepted_tokens),
                ("decode_seconds_total", "counter", "Time spent decoding (first to last token).", self.decode_seconds),
                (
                    "acceptance_length",
                    "gauge",
                    "Cycle tokens / verify cycles over all requests.",
                    self.cycle_tokens / self.verify_steps if self.verify_steps else 1.0,
                ),
                (
                    "decode_tokens_per_second",
                    "gauge",
                    "Decode speed of the last finished generation.",
                    self.last_decode_tps,
                ),
                ("queue_depth", "gauge", "Requests waiting for the generation worker.", self.queue_depth()),
                (
                    "copy_index_bytes",
                    "gauge",
                    "Estimated memory of the per-key indexes of earlier answers copy drafts come from.",
                    self.copy_index_bytes(),
                ),
                (
                    "active_requests",
                    "gauge",
                    "Requests decoding (interleaved, up to --max-concurrent).",
                    self.active_requests(),
                ),
                ("requests_in_flight", "gauge", "Requests being answered (queued or generating).", self.in_flight),
                (
                    "active_memory_bytes",
                    "gauge",
                    "MLX active memory, measured by the worker when idle.",
                    self.active_memory,
                ),
                (
                    "baseline_memory_bytes",
                    "gauge",
                    "MLX active memory right after the models loaded.",
                    self.baseline_memory,
                ),
                ("peak_memory_bytes", "gauge", "MLX peak memory.", self.peak_memory),
                (
                    "prefix_cache_bytes",
                    "gauge",
                    "Bytes held by prompt-prefix cache snapshots.",
                    self.prefix_cache_bytes,
                ),
                ("prefix_cache_entries", "gauge", "Prompt-prefix cache snapshots.", self.prefix_cache_entries),
                ("prefix_cache_hits_total", "counter", "Prompts that reused a cached prefix.", self.prefix_cache_hits),
                (
                    "prefix_cache_misses_total",
                    "counter",
                    "Prompts that found no cached prefix.",
                    self.prefix_cache_misses,
                ),
                (
                    "prefix_cache_disk_hits_total",
                    "counter",
                    "Cached prefixes read back from the prompt cache directory.",
                    self.prefix_cache_disk_hits,
                ),
                (
                    "prefix_cache_too_large_total",
                    "counter",
                    "Snapshots larger than the in-memory budget (on disk only, if any).",
                    self.prefix_cache_too_large,
                ),
                (
                    "prompt_cache_disk_bytes",
                    "gauge",
                    "Bytes in the prompt cache directory (all processes).",
                    self.prompt_cache_disk_bytes,
                ),
                (
                    "prompt_cache_disk_entries",
                    "gauge",
                    "Snapshots of this model pair in the prompt cache directory.",
                    self.prompt_cache_disk_entries,
                ),
                ("uptime_seconds", "gauge", "Seconds since the server started.", time.time() - self.started),
            ]
            for name, kind, help_, value in scalars:
                lines += [f"# HELP {p}_{name} {help_}", f"# TYPE {p}_{name} {kind}", f"{p}_{name} {_fmt(value)}"]
            for name, help_, hist in [
                ("cycle_acceptance_length", "Tokens emitted per verify cycle.", self.cycle_hist),
                ("time_to_first_token_seconds", "Time from dequeue to the first generated token.", self.ttft_hist),
                ("decode_tokens_per_second_hist", "Decode speed per generation.", self.decode_tps_hist),
            ]:
                lines += [f"# HELP {p}_{name} {help_}", f"# TYPE {p}_{name} histogram"] + hist.lines(f"{p}_{name}")
        return "\n".join(lines) + "\n"


def parse(text: str) -> dict[str, float]:
    """The unlabelled samples of a metrics page (for scripts and tests): name -> value."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out
