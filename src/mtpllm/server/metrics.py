"""Prometheus metrics (`GET /metrics`), one registry per server.

Requests by endpoint and status, prompt and generated tokens, time to first token and the latency
of each further token, the queue and the slots, and speculative decoding's counters per method
(fed from the statistics each finished generation carries; per member too for a chain of methods).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the route)

# seconds: from a few milliseconds (a tiny model, a cached prompt) to minutes (a long prompt on a CPU)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# seconds between two tokens: accepted draft tokens arrive together (~0), a plain step is 5-500 ms
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self, total_slots: int = 1):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("mtpllm_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.request_seconds = Histogram("mtpllm_request_duration_seconds", "HTTP request duration, to the "
                                         "last byte of the response", ["endpoint"], buckets=DURATION_BUCKETS,
                                         registry=r)
        self.prompt_tokens = Counter("mtpllm_prompt_tokens", "prompt tokens of the generations", registry=r)
        self.prompt_tokens_cached = Counter("mtpllm_prompt_tokens_cached", "prompt tokens reused from the "
                                            "cache instead of evaluated", registry=r)
        self.generated_tokens = Counter("mtpllm_generated_tokens", "tokens generated", registry=r)
        self.generations = Counter("mtpllm_generations", "generations by how they ended "
                                   "(stop, length, context, cancelled, error)", ["finish"], registry=r)
        self.ttft = Histogram("mtpllm_time_to_first_token_seconds", "from the request's arrival to its first "
                              "generated token", buckets=TTFT_BUCKETS, registry=r)
        self.token_latency = Histogram("mtpllm_time_per_output_token_seconds", "time between consecutive "
                                       "generated tokens of a request", buckets=TOKEN_BUCKETS, registry=r)
        self.queue_depth = Gauge("mtpllm_requests_waiting", "generation requests waiting for a slot", registry=r)
        self.slots_busy = Gauge("mtpllm_slots_busy", "slots generating", registry=r)
        self.slots_total = Gauge("mtpllm_slots_total", "slots (sequences generated at once)", registry=r)
        self.slots_total.set(total_slots)
        self.spec_drafts = Counter("mtpllm_spec_drafts", "verification steps that checked drafted tokens",
                                   ["method"], registry=r)
        self.spec_draft_tokens = Counter("mtpllm_spec_draft_tokens", "drafted tokens", ["method"], registry=r)
        self.spec_accepted_tokens = Counter("mtpllm_spec_accepted_tokens", "drafted tokens the target accepted",
                                            ["method"], registry=r)
        self.spec_drafted_per_pos = Counter("mtpllm_spec_drafted_tokens_per_position", "drafted tokens by their "
                                            "position in the draft (0 = first)", ["method", "position"], registry=r)
        self.spec_member_drafts = Counter("mtpllm_spec_member_drafts", "verification steps per member of a chain "
                                          "of methods (the one that drafted)", ["method", "member"], registry=r)
        self.spec_member_draft_tokens = Counter("mtpllm_spec_member_draft_tokens", "drafted tokens per member of "
                                                "a chain of methods", ["method", "member"], registry=r)
        self.spec_member_accepted_tokens = Counter("mtpllm_spec_member_accepted_tokens", "accepted tokens per "
                                                   "member of a chain of methods", ["method", "member"], registry=r)
        self.spec_accepted_per_pos = Counter("mtpllm_spec_accepted_tokens_per_position", "accepted tokens by "
                                             "their position in the draft", ["method", "position"], registry=r)

    def record_generation(self, prompt_n: int, cached_n: int, generated_n: int, finish: str, stats,
                          method: str | None) -> None:
        self.prompt_tokens.inc(prompt_n)
        self.prompt_tokens_cached.inc(cached_n)
        self.generated_tokens.inc(generated_n)
        self.generations.labels(finish).inc()
        if stats is None or method is None:
            return
        self.spec_drafts.labels(method).inc(stats.num_drafts)
        self.spec_draft_tokens.labels(method).inc(stats.num_draft_tokens)
        self.spec_accepted_tokens.labels(method).inc(stats.num_accepted_tokens)
        for i, n in enumerate(stats.drafted_per_pos):
            self.spec_drafted_per_pos.labels(method, str(i)).inc(n)
        for i, n in enumerate(stats.accepted_per_pos):
            self.spec_accepted_per_pos.labels(method, str(i)).inc(n)
        for member, (drafts, drafted, accepted) in stats.members.items():
            self.spec_member_drafts.labels(method, member).inc(drafts)
            self.spec_member_draft_tokens.labels(method, member).inc(drafted)
            self.spec_member_accepted_tokens.labels(method, member).inc(accepted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
