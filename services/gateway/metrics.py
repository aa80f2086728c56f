"""The gateway's Prometheus metrics (/metrics). Names follow vLLM's where one exists, under splitgemma_gateway_."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from splitgemma.serving.telemetry import TPOT_BUCKETS, TTFT_BUCKETS

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class GatewayMetrics:
    """One registry per gateway app (tests start several apps in one process)."""

    def __init__(self):
        disable_created_metrics()  # the *_created series: clutter no dashboard reads (for the whole process)
        r = self.registry = CollectorRegistry()
        p = "splitgemma_gateway_"
        self.requests = Counter(p + "requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Request arrival to the first generated token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.inter_token = Histogram(p + "inter_token_latency_seconds", "Time between two streamed token events",
                                     buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Request arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_latency = Histogram(p + "prefill_latency_seconds",
                                         "Prefill RPC duration (prompt compute + KV handoff into the leased slot)",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge(p + "requests_running", "Requests being generated", registry=r)
        self.waiting = Gauge(p + "requests_waiting",
                             "Requests waiting for admission: a decode slot (queued at a decode worker)", registry=r)
        self.rejections = Counter(p + "rejections", "Requests refused before generation, by reason",
                                  ["reason"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens admitted", registry=r)
        self.cached_prompt_tokens = Counter(p + "prompt_tokens_cached",
                                            "Prompt tokens whose K/V a prefill worker's prefix cache supplied",
                                            registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.kv_slots_total = Gauge(p + "kv_slots_total", "KV slots of a decode worker (from its Stats)",
                                    ["worker"], registry=r)
        self.kv_slots_in_use = Gauge(p + "kv_slots_in_use",
                                     "KV slots not free on a decode worker (leased, running or quarantined)",
                                     ["worker"], registry=r)
        self.prompt_jobs = Gauge(p + "prompt_jobs", "Requests being parsed, rendered or tokenized (running or "
                                 "waiting for a thread), by lane (services/gateway/offload.py)", ["lane"], registry=r)
        self.prompt_jobs_abandoned = Counter(p + "prompt_jobs_abandoned",
                                             "Prompt jobs dropped unfinished because their client went away",
                                             registry=r)
        self.worker_up = Gauge(p + "worker_up", "1 while a worker answers its health check SERVING",
                               ["kind", "worker"], registry=r)

    def take_decode_stats(self, worker) -> None:
        s = worker.stats
        self.kv_slots_total.labels(worker=worker.address).set(s.slots_total)
        self.kv_slots_in_use.labels(worker=worker.address).set(s.slots_leased + s.slots_running + s.slots_quarantined)
