"""Prometheus metrics, in a registry owned by the app (no module-level state)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.stats import StepRecord

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, queue_depth: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
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
        self.running = Gauge("specserve_running_requests", "Requests on the engine now (0 or 1)", registry=r)
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
