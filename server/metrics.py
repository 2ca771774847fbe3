"""Prometheus metrics, in a registry owned by the app (no module-level state)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from engine.cpu.memory import peak_resident_bytes
from engine.stats import StepRecord

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


MEMORY_HELP = {
    "slots_in_use": "Sequence slots a request runs in now",
    "slots_allocated": "Sequence slots whose KV caches are allocated",
    "store_bytes": "Bytes the host-memory prefix store holds",
    "store_hits": "Requests that restored a prefix from the store",
    "store_restored_tokens": "Prompt tokens restored from the store instead of computed",
}


class Metrics:
    def __init__(self, queue_depth: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, open fds (Linux)
        self.peak_memory = Gauge(
            "specserve_peak_resident_memory_bytes", "The most this process has held resident (VmHWM)", registry=r
        )
        self.peak_memory.set_function(peak_resident_bytes)
        self.requests = Counter("specserve_requests", "Finished requests", ["endpoint", "finish_reason"], registry=r)
        self.errors = Counter("specserve_request_errors", "Requests answered with an error", ["status"], registry=r)
        self.prompt_tokens = Counter("specserve_prompt_tokens", "Prompt tokens processed", registry=r)
        self.cached_prompt_tokens = Counter(
            "specserve_cached_prompt_tokens", "Prompt tokens reused from the KV cache", registry=r
        )
        self.generation_tokens = Counter("specserve_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "specserve_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "specserve_inter_token_latency_seconds",
            "Time per output token, spread over each step's tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "specserve_e2e_request_latency_seconds", "Request latency", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_depth = Gauge("specserve_queue_depth", "Requests waiting for the engine", registry=r)
        self.queue_depth.set_function(queue_depth)
        self.running = Gauge("specserve_running_requests", "Requests in a sequence slot, taking turns", registry=r)
        self.queue_wait = Histogram(
            "specserve_queue_wait_seconds", "From arrival to a sequence slot", buckets=LATENCY_BUCKETS, registry=r
        )
        memory = ["slots_in_use", "slots_allocated", "store_bytes", "store_hits", "store_restored_tokens"]
        self.memory = {name: Gauge(f"specserve_{name}", MEMORY_HELP[name], registry=r) for name in memory}
        self.abort_latency = Histogram(
            "specserve_abort_latency_seconds",
            "From a client leaving (or a timeout) to the engine letting its request go",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        by = ["drafter"]
        self.num_drafts = Counter("specserve_spec_decode_num_drafts", "Steps that drafted", by, registry=r)
        self.num_draft_tokens = Counter(
            "specserve_spec_decode_num_draft_tokens", "Draft tokens proposed", by, registry=r
        )
        self.num_accepted_tokens = Counter(
            "specserve_spec_decode_num_accepted_tokens", "Draft tokens accepted", by, registry=r
        )
        self.accepted_per_pos = Counter(
            "specserve_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by draft position",
            ["drafter", "position"],
            registry=r,
        )
        self.draft_time = Histogram(
            "specserve_spec_decode_draft_seconds", "Drafting time per step", by, buckets=LATENCY_BUCKETS, registry=r
        )
        self.verify_time = Histogram(
            "specserve_spec_decode_verify_seconds", "Verify time per step", by, buckets=LATENCY_BUCKETS, registry=r
        )

    def watch_memory(self, stats: Callable[[], dict[str, int]]) -> None:
        """Read the engine's slot and store figures at every scrape."""
        for name, gauge in self.memory.items():
            gauge.set_function(lambda name=name: stats().get(name, 0))

    def observe_step(self, drafter: str | None, record: StepRecord) -> None:
        """``drafter``: the request's. Under auto the label also names the drafter it chose, e.g. auto/suffix."""
        drafter = f"auto/{record.drafter}" if drafter == "auto" else (drafter or "none")
        self.verify_time.labels(drafter).observe(record.verify_seconds)
        if record.num_drafted == 0:
            return
        self.num_drafts.labels(drafter).inc()
        self.num_draft_tokens.labels(drafter).inc(record.num_drafted)
        self.num_accepted_tokens.labels(drafter).inc(record.num_accepted)
        self.draft_time.labels(drafter).observe(record.draft_seconds)
        for position in range(record.num_accepted):
            self.accepted_per_pos.labels(drafter=drafter, position=str(position)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
