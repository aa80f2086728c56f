"""The gateway's Prometheus metrics (/metrics). Names follow vLLM's where one exists, under splitgemma_gateway_;
beside them, the same series under vLLM's own names with its model_name label (VllmNames), where a dashboard made
for vLLM looks: vllm:num_requests_running/waiting, vllm:kv_cache_usage_perc (the fraction of the decode workers'
KV slots not free: a slot holds one sequence's whole context, so this is vLLM's block fraction at slot grain),
vllm:request_success_total{finished_reason} (per choice), vllm:request_queue_time_seconds (the wait for a decode
slot), vllm:prefix_cache_queries/hits_total (prompt tokens admitted / supplied by a prefill worker's prefix cache),
vllm:prompt_tokens/generation_tokens_total, vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds and
vllm:e2e_request_latency_seconds."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.metrics_core import Metric

from splitgemma.serving.telemetry import TPOT_BUCKETS, TTFT_BUCKETS

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class GatewayMetrics:
    """One registry per gateway app (tests start several apps in one process)."""

    def __init__(self, model_name: str = ""):
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
        self.prefill_routes = Counter(p + "prefill_routes", "Prefills by why their prefill worker was chosen: "
                                      "prefix (it holds the prompt's prefix), rendezvous (the first block's owner) or "
                                      "load (services/gateway/routing.py)", ["reason"], registry=r)
        self.kv_transport = Counter(p + "kv_transport", "Prefills by how the K/V reached the decode worker: shm or "
                                    "network (Decode.PushKv)", ["transport"], registry=r)
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
        self.success = Counter(p + "request_success", "Choices finished, by finish reason", ["finished_reason"],
                               registry=r)
        self.queue_time = Histogram(p + "request_queue_time_seconds",
                                    "Time a request waited for its decode slots (admission)",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage", "Fraction of the healthy decode workers' KV slots not free "
                              "(0 to 1)", registry=r)
        self.kept = Gauge(p + "kept", "What the gateway keeps for the Responses, Conversations, Files and Batch APIs: "
                          "stored responses, conversations, background responses running (in its memory), files "
                          "and batches (in its files folder)", ["kind"], registry=r)
        r.register(VllmNames(model_name, [
            (self.in_flight, "vllm:num_requests_running"), (self.waiting, "vllm:num_requests_waiting"),
            (self.kv_usage, "vllm:kv_cache_usage_perc"), (self.success, "vllm:request_success"),
            (self.queue_time, "vllm:request_queue_time_seconds"), (self.prompt_tokens, "vllm:prefix_cache_queries"),
            (self.cached_prompt_tokens, "vllm:prefix_cache_hits"), (self.prompt_tokens, "vllm:prompt_tokens"),
            (self.generation_tokens, "vllm:generation_tokens"), (self.ttft, "vllm:time_to_first_token_seconds"),
            (self.inter_token, "vllm:inter_token_latency_seconds"), (self.e2e, "vllm:e2e_request_latency_seconds")]))

    def take_decode_stats(self, worker) -> None:
        s = worker.stats
        self.kv_slots_total.labels(worker=worker.address).set(s.slots_total)
        self.kv_slots_in_use.labels(worker=worker.address).set(s.slots_leased + s.slots_running + s.slots_quarantined)

    def take_kv_usage(self, decode_workers) -> None:
        """kv_cache_usage over the decode workers healthy now (at scrape time: one that stopped answering drops
        out)."""
        stats = [w.stats for w in decode_workers if w.healthy and w.stats is not None]
        total = sum(s.slots_total for s in stats)
        used = sum(s.slots_leased + s.slots_running + s.slots_quarantined for s in stats)
        self.kv_usage.set(used / total if total else 0.0)


class VllmNames:
    """A collector that shows existing metrics again under vLLM's names, with a model_name label: one set of
    numbers, two spellings (nothing is counted twice)."""

    def __init__(self, model_name: str, aliases: list[tuple[object, str]]):
        self.model_name = model_name
        self.aliases = aliases

    def collect(self):
        for metric, name in self.aliases:
            for family in metric.collect():
                out = Metric(name, family.documentation, family.type)
                for sample in family.samples:
                    out.add_sample(name + sample.name[len(family.name):],
                                   {**sample.labels, "model_name": self.model_name}, sample.value,
                                   sample.timestamp, sample.exemplar)
                yield out
