"""The gateway's view of its prefill and decode workers: channels, health, load, and which one to use next.

A monitor task asks every worker for its grpc.health.v1 status and its Stats each `interval` seconds. A worker is
usable while it answers SERVING and its Stats (which, unlike health, needs the service credential); a call that
fails with UNAVAILABLE marks it unusable at once, so a dead worker drops out of routing (and /ready) without
waiting for the next probe.

Routing: the decode worker with the most free slots (from its last Stats, minus the reservations this gateway
made since), else the one with the shortest Reserve queue (the larger of its last Stats' count and this gateway's
Reserve calls open there now); the prefill worker by prefix-cache affinity and load (routing.py): where the prompt's
prefix is cached (each worker's PrefixIndex, fetched by the monitor when its cache changed), else by rendezvous
hashing of its first block, else the fewest calls in flight from this gateway.

Geometry: a decode worker's slot context comes from its Stats (DecodeStats.max_context, read by the health probe
before the worker counts as up) and from the leases it grants; it is forgotten when its worker id changes, i.e. it
restarted. Requests are checked against it before any reservation, and against the lease they get when a worker's
context is not known yet.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitgemma.serving import credentials, telemetry
from splitgemma.v1 import serving_pb2 as pb
from splitgemma.v1 import serving_pb2_grpc as pbg

from . import routing

log = logging.getLogger("splitgemma.gateway")

_CHANNEL_OPTIONS = [
    # Find a restarted worker quickly instead of after grpc's default backoff (up to 2 minutes).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 64 << 20),
]
_SERVICE = {"prefill": "splitgemma.v1.Prefill", "decode": "splitgemma.v1.Decode"}


@dataclass(eq=False)
class Worker:
    kind: str                       # "prefill" | "decode"
    address: str
    channel: grpc.aio.Channel
    stub: object
    health: health_pb2_grpc.HealthStub
    healthy: bool = False
    status: str = "unknown"         # the last probe's result, for /ready
    in_flight: int = 0              # calls from this gateway
    stats: pb.DecodeStats | None = None
    # decode: when (monotonic) each lease this gateway took was granted, for those the last Stats may not count yet
    grants: deque = field(default_factory=deque)
    reserving: int = 0              # decode: Reserve calls from this gateway open now (most of them queued)
    worker_id: str = ""
    max_context: int = 0            # decode: slot context from a lease (0 = not known yet)
    # prefill: the routing keys of the blocks its prefix cache holds (PrefixIndex at prefix_version, plus the
    # blocks of prompts run there since), and whether its cache is on at all (PrefixCacheStats.budget_bytes)
    prefixes: set = field(default_factory=set)
    prefix_version: int = -1
    caches: bool = False

    @property
    def free_slots(self) -> int:
        if self.stats is None:
            return 0
        # Beyond the last Stats: the leases granted since, and the Reserve calls open now (each takes a slot if
        # one is free). Without them, requests arriving together all see the same free slots and go to one worker.
        used = self.stats.slots_leased + self.stats.slots_running + self.stats.slots_quarantined + \
            len(self.grants) + self.reserving
        return max(0, self.stats.slots_total - used)

    @property
    def queued(self) -> int:
        """Reserve calls waiting at this worker, as far as this gateway can tell."""
        return max(self.stats.admission.queued if self.stats is not None else 0, self.reserving)

    @property
    def queue_timeout(self) -> float:
        """Seconds a Reserve may wait in this worker's queue (from its Stats; 0 before the first)."""
        return self.stats.admission.queue_timeout_ms / 1000 if self.stats is not None else 0.0

    def describe(self) -> dict:
        out = {"address": self.address, "healthy": self.healthy, "status": self.status,
               "in_flight": self.in_flight}
        if self.worker_id:
            out["worker_id"] = self.worker_id
        if self.kind == "prefill":
            out["prefix_blocks"] = len(self.prefixes)  # blocks of its prefix cache this gateway routes by
        if self.kind == "decode" and self.stats is not None:
            out.update(slots_total=self.stats.slots_total, slots_leased=self.stats.slots_leased,
                       slots_running=self.stats.slots_running, queued=self.stats.admission.queued,
                       max_context=self.max_context or None)
        return out


class WorkerPool:
    def __init__(self, prefill: list[str], decode: list[str], *, interval: float = 0.5, probe_timeout: float = 1.0,
                 on_stats=None, service_token: str | None = None, tls: credentials.TlsFiles | None = None):
        if not prefill or not decode:
            raise ValueError("the gateway needs at least one prefill and one decode worker address")
        self.interval = interval
        self.probe_timeout = probe_timeout
        self.on_stats = on_stats          # callback(worker) after each decode Stats (metrics)
        self._addresses = {"prefill": prefill, "decode": decode}
        self._token = service_token
        self._tls = tls
        self.prefill: list[Worker] = []
        self.decode: list[Worker] = []
        self._rr = itertools.count()
        self._monitor: asyncio.Task | None = None

    async def start(self) -> None:
        """Open the channels (inside the serving event loop) and start the monitor."""
        interceptors = [*telemetry.grpc_client_interceptors(), *credentials.client_interceptors(self._token)]
        tls = self._tls.channel_credentials() if self._tls is not None and self._tls.enabled else None
        for kind, addresses in self._addresses.items():
            for address in addresses:
                if tls is None:
                    channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS, interceptors=interceptors)
                else:
                    channel = grpc.aio.secure_channel(address, tls, options=_CHANNEL_OPTIONS,
                                                      interceptors=interceptors)
                stub = pbg.PrefillStub(channel) if kind == "prefill" else pbg.DecodeStub(channel)
                getattr(self, kind).append(Worker(kind, address, channel, stub, health_pb2_grpc.HealthStub(channel)))
        self._monitor = asyncio.create_task(self._monitor_loop(), name="worker-monitor")

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
        for w in self.prefill + self.decode:
            await w.channel.close(grace=None)

    @property
    def ready(self) -> bool:
        return any(w.healthy for w in self.prefill) and any(w.healthy for w in self.decode)

    def describe(self) -> dict:
        return {"prefill": [w.describe() for w in self.prefill], "decode": [w.describe() for w in self.decode]}

    # -- health --------------------------------------------------------------------------------------------------

    async def _monitor_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(w) for w in self.prefill + self.decode))
            await asyncio.sleep(self.interval)

    async def _probe(self, w: Worker) -> None:
        try:
            resp = await w.health.Check(health_pb2.HealthCheckRequest(service=_SERVICE[w.kind]),
                                        timeout=self.probe_timeout)
            serving = resp.status == health_pb2.HealthCheckResponse.SERVING
            w.status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
            if serving:
                # Health answers without the service token; Stats needs it, so a worker that refuses this
                # gateway's credential shows as down in /ready (UNAUTHENTICATED) instead of failing every request.
                sent = time.monotonic()
                stats = await w.stub.Stats(pb.StatsRequest(), timeout=self.probe_timeout)
                if w.kind == "decode":
                    self._take_stats(w, stats, sent)
                else:
                    await self._take_prefix_index(w, stats)
        except grpc.aio.AioRpcError as e:
            serving = False
            w.status = f"{e.code().name}: {e.details()}"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a probe must never kill the monitor
            serving = False
            w.status = f"probe failed: {type(e).__name__}: {e}"
        if serving != w.healthy:
            log.info("worker %s", "up" if serving else "down",
                     extra={"worker": w.address, "kind": w.kind, "status": w.status})
        w.healthy = serving

    def _take_stats(self, w: Worker, stats: pb.DecodeStats, sent: float) -> None:
        """Stats asked for at `sent` (monotonic): it counts every lease granted before then, not necessarily those
        granted while it was on its way."""
        if stats.worker_id != w.worker_id:
            if w.worker_id:  # restarted: its context may have changed
                w.max_context = 0
            w.worker_id = stats.worker_id
        if stats.max_context:
            w.max_context = stats.max_context
        w.stats = stats
        while w.grants and w.grants[0] < sent:
            w.grants.popleft()
        if self.on_stats is not None:
            self.on_stats(w)

    async def _take_prefix_index(self, w: Worker, stats: pb.PrefillStats) -> None:
        """A prefill worker's cached blocks, fetched again only when its cache changed (or it restarted)."""
        if stats.worker_id != w.worker_id:
            w.worker_id, w.prefix_version = stats.worker_id, -1
        w.caches = stats.prefix_cache.budget_bytes > 0
        if stats.prefix_cache.version == w.prefix_version:
            return
        try:
            index = await w.stub.PrefixIndex(pb.PrefixIndexRequest(), timeout=self.probe_timeout)
        except grpc.aio.AioRpcError as e:
            # Routing hints, not health: the worker stays in rotation with the blocks known so far; the next probe
            # asks again (its version still differs).
            log.info("prefix index not read", extra={"worker": w.address, "error": e.code().name})
            return
        w.prefixes, w.prefix_version = set(index.keys), index.version

    def ran_prompt(self, w: Worker, keys: list[int]) -> None:
        """A prompt with routing keys `keys` was prefilled on w: its full blocks are in w's cache now (until the next
        PrefixIndex says otherwise)."""
        if w.caches:
            w.prefixes.update(keys)

    def mark_failed(self, w: Worker, error: grpc.aio.AioRpcError) -> None:
        """A call to w failed; UNAVAILABLE means the process is gone or unreachable: stop routing to it now."""
        if error.code() == grpc.StatusCode.UNAVAILABLE and w.healthy:
            w.healthy = False
            w.status = f"UNAVAILABLE: {error.details()}"
            log.warning("worker unreachable", extra={"worker": w.address, "kind": w.kind})

    # -- routing -------------------------------------------------------------------------------------------------

    def decode_candidates(self) -> list[Worker]:
        """Healthy decode workers, most free slots first, then the shortest queue."""
        healthy = [w for w in self.decode if w.healthy]
        return sorted(healthy, key=lambda w: (-w.free_slots, w.queued, w.in_flight))

    def pick_prefill(self, exclude: set[Worker] = frozenset(), keys: list[int] = ()) -> tuple[Worker | None, str]:
        """(the healthy prefill worker for a prompt with routing keys `keys`, why: routing.pick), (None, "") when
        none is left."""
        healthy = [w for w in self.prefill if w.healthy and w not in exclude]
        if not healthy:
            return None, ""
        return routing.pick(healthy, list(keys), next(self._rr))

    def known_context(self) -> int:
        """The smallest slot context among healthy decode workers that told us theirs (0 = none known)."""
        contexts = [w.max_context for w in self.decode if w.healthy and w.max_context]
        return min(contexts) if contexts else 0
