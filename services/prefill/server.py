"""The prefill worker: runs prompts straight into slots of decode workers' shared-memory arenas, seals each slot
header and samples the first token (protos/splitgemma/v1/serving.proto, service Prefill).

One Model per worker. Calls are accepted concurrently (up to --max-prompts) and their chunks run interleaved on one
model thread (scheduler.py, --prefill-policy), so a short prompt does not wait for a long one to end; the engine
releases the GIL, so the asyncio loop keeps answering health checks, Stats and cancellations meanwhile.

A call takes its slot's writer lock when it is accepted (shm_arena.SlotLocks; waiting on the loop, by polling,
while another writer holds it) and keeps it until its seal or its stop. While the lock is held the decode worker
cannot take the slot back, so the lease's deadline is checked once, on arrival; from then on the bound is the
call's own gRPC deadline (the gateway sets one), capped by --max-prefill-seconds. Between chunks a cancelled call or
a passed deadline stops the prompt without sealing, so a half-written slot can never be admitted (Generate
verifies the seal and checksum), and the lock is let go. The prefix cache (prefix_cache.py) restores a
prompt's cached prefix into the slot in the job's first step and keeps the full blocks each chunk completes.

A lease whose arena this worker cannot map (another host: the decode worker's file is not under this --shm-dir, or
the file there is not the lease's) goes over the network instead (splitgemma/serving/kv_transport.py): the prompt
runs into a staging slot here and its K/V streams to the decode worker (Decode.PushKv at Lease.kv_address), which
takes the slot's writer lock, checks the lease stamp, and seals the slot; the rest of the call is the same.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from pathlib import Path

import grpc
import numpy as np
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from splitgemma.serving import telemetry
from splitgemma.serving.credentials import TlsFiles
from splitgemma.serving.kv_transport import (NETWORK, SHM, KvChannels, KvSender, PushRefused, StagingSlots,
                                             arena_reachable, outside, stamp_refusal)
from splitgemma.serving.grammar import Grammars, worker_grammars
from splitgemma.serving.logits import row_sampler
from splitgemma.serving.stop_tokens import model_stop_tokens
from splitgemma.serving.shm_arena import (ArenaError, ArenaMissing, InvalidLease, MappedArena, lease_digest,
                                          open_shared_arena)
from splitgemma.serving.worker import (MAX_TOP_LOGPROBS, GrpcServer, InvalidRequest, constraint_matcher,
                                       gen_ai_request_attributes,
                                       open_model, serve_until_signalled, setup_logging,
                                       start_metrics, token_message, worker_id)
from splitgemma.v1 import serving_pb2 as pb
from splitgemma.v1 import serving_pb2_grpc as pb_grpc

from .prefix_cache import PrefixCache, PrefixCacheCollector
from .scheduler import PrefillJob, Scheduler, Stopped

log = logging.getLogger("splitgemma.prefill")
SERVICE = "splitgemma-prefill"   # log records' service and OTel's service.name

# Arenas kept mapped (one per decode worker, normally); a mapping whose file is gone is dropped at once anyway.
_MAX_ARENAS = 64


# Polling for a slot's writer lock held by another writer: a first retry soon (a stale prefill that finds its
# stamp cleared lets go at once), then at most this often.
_LOCK_POLL_S = (0.002, 0.02)


class PrefillServicer(pb_grpc.PrefillServicer):
    def __init__(self, *, model, shm_dir: str, worker: str, registry: CollectorRegistry, tracer, policy: str,
                 max_prompts: int, max_seconds: float, prefix_cache: PrefixCache, grammars: Grammars,
                 stop_tokens=(), kv_token: str | None = None, kv_tls: TlsFiles | None = None):
        self.model = model
        self.kv_channels = KvChannels(kv_token, kv_tls)  # to decode workers, for leases sent over the network
        self.staging = StagingSlots(model)
        self.stop_tokens = frozenset(stop_tokens)  # what min_tokens holds off unless ignore_eos
        self.grammars = grammars
        self.prefix_cache = prefix_cache
        self.shm_dir = shm_dir
        self.worker_id = worker
        self.tracer = tracer
        self.model_name = Path(model.path).stem
        self.max_prompts = max_prompts
        self.max_seconds = max_seconds
        self.draining = False
        self.in_flight = 0  # calls being answered (the drain waits for them)
        self._arenas: dict[str, MappedArena] = {}
        # Accepted jobs that have not ended, and the slots they hold the writer lock of. Two calls for one slot in
        # this process share the arena's file description, so its OFD lock would not keep them apart: this does.
        # Added to on the loop, removed from on the model thread.
        self._jobs: set[PrefillJob] = set()
        self._slots: dict[tuple, PrefillJob] = {}
        self._jobs_lock = threading.Lock()
        layout = model.kv_layout
        scale_bytes = 8 if layout["kv_dtype"] == "int8" else 0  # an f16 cache has no per-position scales
        self._kv_layers = [(L["cap"], 2 * L["row_bytes"] + scale_bytes) for L in layout["layers"]]
        self._header_bytes = layout["header_bytes"]
        self.requests = 0
        self.prompt_tokens = 0
        self.busy_seconds = 0.0
        self.queued_seconds = 0.0
        self.transport_prompts = {SHM: 0, NETWORK: 0}
        self.wire_bytes = self.network_tokens = 0
        self.m_transport = Counter("splitgemma_prefill_kv_transport_prompts", "prompts by how their K/V reached the "
                                   "slot: shm (the mapped arena) or network (Decode.PushKv)", ["transport"],
                                   registry=registry)
        self.m_wire = Counter("splitgemma_prefill_kv_wire_bytes", "K/V bytes sent over the network transport",
                              registry=registry)
        self.m_network_tokens = Counter("splitgemma_prefill_kv_network_tokens",
                                        "prompt tokens whose K/V went over the network (wire bytes / this = bytes "
                                        "per token)", registry=registry)
        self.m_requests = Counter("splitgemma_prefill_requests", "Prefill calls by outcome", ["outcome"],
                                  registry=registry)
        self.m_tokens = Counter("splitgemma_prefill_tokens", "prompt tokens run", registry=registry)
        self.m_seconds = Histogram("splitgemma_prefill_seconds", "prompt run time (first chunk to seal)",
                                   buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 120, 300),
                                   registry=registry)
        self.m_queued = Histogram("splitgemma_prefill_queued_seconds",
                                  "time from accepting a call to its first chunk (slot lock and queue)",
                                  buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 20, 60, 120, 300),
                                  registry=registry)
        self.m_seal = Histogram("splitgemma_prefill_handoff_seal_seconds", "slot header seal (checksum) time",
                                buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1), registry=registry)
        registry.register(PrefixCacheCollector(prefix_cache))
        prompts = Gauge("splitgemma_prefill_prompts", "accepted calls: waiting (for the slot lock or their first "
                        "chunk) or running", ["state"], registry=registry)
        prompts.labels(state="waiting").set_function(lambda: self.counts()[0])
        prompts.labels(state="running").set_function(lambda: self.counts()[1])
        self.scheduler = Scheduler(policy, on_start=self._started)

    def close(self) -> None:
        self.scheduler.close()

    def counts(self) -> tuple[int, int]:
        """(waiting, running) accepted calls."""
        with self._jobs_lock:
            running = sum(j.started is not None for j in self._jobs)
            return len(self._jobs) - running, running

    def _started(self, job: PrefillJob) -> None:
        queued = job.started - job.accepted
        self.queued_seconds += queued  # only the model thread adds
        self.m_queued.observe(queued)

    # --------------------------------------------------------------------------------------------------------

    async def Stats(self, request, context):
        waiting, running = self.counts()
        stats = pb.PrefillStats(worker_id=self.worker_id, requests=self.requests, prompt_tokens=self.prompt_tokens,
                                busy_seconds=self.busy_seconds, backend=self.model.backend, model=self.model.path,
                                layout_signature=self.model.layout_signature, prefix_cache=self.prefix_cache.stats(),
                                prompts_waiting=waiting, prompts_running=running, queued_seconds=self.queued_seconds,
                                prefill_policy=self.scheduler.policy, max_prompts=self.max_prompts,
                                kv_shm_prompts=self.transport_prompts[SHM],
                                kv_network_prompts=self.transport_prompts[NETWORK], kv_wire_bytes=self.wire_bytes,
                                kv_network_tokens=self.network_tokens)
        stats.prefix_cache.block_tokens = self.model.chunk
        return stats

    async def PrefixIndex(self, request, context):
        version, keys = self.prefix_cache.route_index()
        return pb.PrefixIndexResponse(version=version, block_tokens=self.model.chunk, keys=keys)

    async def Prefill(self, request, context):
        span = self.tracer.start_span("prefill.forward", attributes={
            **gen_ai_request_attributes(self.model_name, request),
            "gen_ai.usage.input_tokens": len(request.prompt_token_ids)})
        self.in_flight += 1
        try:
            with trace.use_span(span, end_on_exit=False):
                return await self._prefill(request, context, span)
        except BaseException as e:
            code = context.code() if isinstance(e, grpc.aio.AbortError) else None
            outcome = "cancelled" if isinstance(e, asyncio.CancelledError) else \
                (code.name.lower() if isinstance(code, grpc.StatusCode) else "error")
            self.m_requests.labels(outcome=outcome).inc()
            telemetry.set_gen_ai_error(span, outcome, str(e))
            raise
        finally:
            self.in_flight -= 1
            span.end()

    async def _prefill(self, request, context, span) -> pb.PrefillResponse:
        lease = request.lease
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill worker is draining")
        try:
            tokens = self._check(request)
            stop_ids = set(request.stop_token_ids) | (set() if request.ignore_eos else self.stop_tokens)
            seed = request.sampling.seed if request.sampling.HasField("seed") else secrets.randbits(64)
            sampler = row_sampler(request.sampling, vocab_size=self.model.vocab_size, rng_state=seed,
                                  want_logprob=True, prompt_ids=tokens, stop_ids=stop_ids)
            digest = lease_digest(lease.worker_id, lease.slot, lease.generation, lease.secret)
            view = self._shm_view(lease)
        except ArenaMissing as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except (InvalidRequest, InvalidLease, ArenaError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if time.time() * 1000 > lease.deadline_unix_ms:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"the lease on slot {lease.slot} expired before the prefill started; nothing was "
                                "written")
        matcher = await constraint_matcher(self.grammars, request.sampling, context)
        transport = SHM if view is not None else NETWORK
        span.set_attribute("splitgemma.kv.transport", transport)
        if transport == NETWORK:
            return await self._prefill_network(request, context, span, tokens, sampler, matcher)
        job = self._accept(context, view, request, tokens, sampler, matcher)
        if job is None:
            await self._full(context)
        try:
            await self._lock_slot(job)
        except Stopped as e:
            self._drop(job)
            await context.abort(e.code, str(e))
        except BaseException:
            self._drop(job)  # cancelled while waiting: it holds nothing
            raise
        try:
            _check_stamp(job, digest)
            self.scheduler.submit(job)
        except Stopped as e:  # not this lease's slot, or the worker is stopping
            self._release(job)
            await context.abort(e.code, str(e))
        r = await self._outcome(job, context)
        return self._done(request, span, job, r, SHM, 0)

    async def _full(self, context) -> None:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"the prefill worker has {self.max_prompts} prompts in flight (--max-prompts); "
                            "retry later", trailing_metadata=(("retry-after-ms", "1000"),))

    async def _outcome(self, job: PrefillJob, context, sender: KvSender | None = None):
        rid, lease = job.request.request_id, job.lease
        try:
            return await job.outcome
        except asyncio.CancelledError:
            # The caller went away: the model thread, which sweeps its jobs before every turn, drops this one before
            # its next chunk; the slot stays unsealed.
            job.cancel()
            log.info("prefill cancelled by the caller", extra={"request_id": rid, "slot": lease.slot})
            raise
        except Stopped as e:
            if sender is not None and sender.broken is not None:  # the stream broke, which stopped the job
                await self._push_failed(context, lease, sender.broken)
            await context.abort(e.code, str(e))
        except (ValueError, IndexError) as e:  # the engine refused (its checks run before any slot byte changes)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prefill refused: {e}")

    async def _push_failed(self, context, lease, e: PushRefused) -> None:
        await context.abort(_push_code(e.code), f"decode worker {lease.kv_address}: {e.details}")

    async def _prefill_network(self, request, context, span, tokens, sampler, matcher) -> pb.PrefillResponse:
        """The prompt into a staging slot here, its K/V streamed to the decode worker chunk by chunk (module doc)."""
        lease = request.lease
        staging = self.staging.take()
        job = self._accept(context, staging, request, tokens, sampler, matcher, slot=0,
                           release=lambda: self._end_staged(job, staging))
        if job is None:
            self.staging.give_back(staging)
            await self._full(context)
        # A stream that breaks while the prompt runs stops it before its next chunk: nobody would take its K/V.
        sender = KvSender(self.kv_channels.stub(lease.kv_address), request.request_id, lease, len(tokens),
                          timeout=max(0.0, job.deadline - time.monotonic()), on_broken=job.cancel)
        job.sink = sender
        submitted = False
        try:
            try:
                await sender.open()  # the decode worker holds the slot's lock and checked the stamp
            except PushRefused as e:
                await self._push_failed(context, lease, e)
            try:
                self.scheduler.submit(job)
            except Stopped as e:
                await context.abort(e.code, str(e))
            submitted = True  # from here on the job's end gives the staging slot back
            r = await self._outcome(job, context, sender)
            try:
                sealed = await sender.seal(len(tokens), r.checksum)
            except PushRefused as e:
                await self._push_failed(context, lease, e)
        except BaseException:
            sender.cancel()  # the decode worker lets the slot go unsealed
            if not submitted:
                self._end_staged(job, staging)
            raise
        if sealed.checksum != r.checksum:
            await context.abort(grpc.StatusCode.DATA_LOSS, f"the decode worker sealed checksum "
                                                          f"{sealed.checksum:016x}, this worker {r.checksum:016x}")
        span.set_attribute("splitgemma.kv.wire_bytes", sender.wire_bytes)
        return self._done(request, span, job, r, NETWORK, sender.wire_bytes)

    def _end_staged(self, job: PrefillJob, staging: MappedArena) -> None:
        """A network job has ended (or never ran): its staging slot goes back, then its place in flight."""
        self.staging.give_back(staging)
        self._drop(job)

    def _done(self, request, span, job: PrefillJob, r, transport: str, wire_bytes: int) -> pb.PrefillResponse:
        rid, lease, tokens = request.request_id, request.lease, job.tokens
        n = len(tokens)
        self.transport_prompts[transport] += 1
        self.m_transport.labels(transport=transport).inc()
        if transport == NETWORK:
            self.wire_bytes += wire_bytes
            self.network_tokens += n
            self.m_wire.inc(wire_bytes)
            self.m_network_tokens.inc(n)
        self.requests += 1
        self.prompt_tokens += n
        self.busy_seconds += job.busy_seconds
        self.m_requests.labels(outcome="ok").inc()
        self.m_tokens.inc(n)
        self.m_seconds.observe(r.seconds)
        self.m_seal.observe(r.seal_seconds)
        telemetry.set_gen_ai_response(span, output_tokens=1)
        span.set_attribute("gen_ai.usage.cache_read.input_tokens", r.cached_tokens)
        span.set_attribute("splitgemma.prefill.queued_seconds", r.queued_seconds)
        log.info("prefilled", extra={"request_id": rid, "slot": lease.slot, "generation": lease.generation,
                                     "arena": lease.arena_path, "kv_transport": transport, "kv_wire_bytes": wire_bytes,
                                     "prompt_tokens": n, "cached_tokens": r.cached_tokens,
                                     "seconds": round(r.seconds, 6), "queued_seconds": round(r.queued_seconds, 6),
                                     "first_token": r.first.token})
        return pb.PrefillResponse(first_token=token_message(r.first), prompt_tokens=n, kv_checksum=r.checksum,
                                  rng_state=r.first.rng_state, prefill_seconds=r.seconds,
                                  kv_bytes_written=self._kv_bytes(n), cached_tokens=r.cached_tokens,
                                  queued_seconds=r.queued_seconds, first_chunk_step=r.first_step,
                                  last_chunk_step=r.last_step, prompt_logprobs=r.prompt_logprobs,
                                  kv_transport=transport, kv_wire_bytes=wire_bytes)

    def _accept(self, context, view: MappedArena, request, tokens: np.ndarray, sampler,
                matcher, slot: int | None = None, release=None) -> PrefillJob | None:
        """A job for the call, counted in flight; None when --max-prompts are in flight already."""
        remaining = context.time_remaining()
        if remaining is not None and remaining < self.max_seconds:
            deadline, reason = time.monotonic() + remaining, "the call's deadline"
        else:
            deadline, reason = time.monotonic() + self.max_seconds, \
                f"the worker's limit of {self.max_seconds:g} s per prompt (--max-prefill-seconds)"
        job = PrefillJob(self.model, view, request, tokens, sampler, deadline, reason,
                         prefix_cache=self.prefix_cache, release=release or (lambda: self._release(job)),
                         loop=asyncio.get_running_loop(), matcher=matcher, slot=slot)
        with self._jobs_lock:
            if len(self._jobs) >= self.max_prompts:
                return None
            self._jobs.add(job)
        return job

    async def _lock_slot(self, job: PrefillJob) -> None:
        """Take the job's slot's writer lock, polling while another writer (in this process or another) holds it,
        until the job's deadline."""
        view, slot = job.view, job.lease.slot
        key = (view.identity, slot)
        delay = _LOCK_POLL_S[0]
        while True:
            with self._jobs_lock:
                if key not in self._slots and view.locks.try_lock(slot):
                    self._slots[key] = job
                    return
            if time.monotonic() > job.deadline:
                raise Stopped(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"slot {slot}'s writer lock was still held by another writer when "
                              f"{job.deadline_reason} passed; nothing was written")
            await asyncio.sleep(min(delay, max(0.0, job.deadline - time.monotonic())))
            delay = min(2 * delay, _LOCK_POLL_S[1])

    def _release(self, job: PrefillJob) -> None:
        """The job has ended (on the model thread): its slot's writer lock goes back, then its place in flight."""
        job.view.locks.unlock(job.lease.slot)
        with self._jobs_lock:
            del self._slots[(job.view.identity, job.lease.slot)]
        self._drop(job)

    def _drop(self, job: PrefillJob) -> None:
        with self._jobs_lock:
            self._jobs.discard(job)

    def _check(self, request) -> np.ndarray:
        lease, m = request.lease, self.model
        if not request.request_id:
            raise InvalidRequest("request_id is empty")
        if lease.layout_signature != m.layout_signature:
            raise InvalidRequest(
                f"the lease is for a model with layout signature {lease.layout_signature:016x} (decode worker "
                f"{lease.worker_id!r}); this prefill worker serves {m.path} with {m.layout_signature:016x}")
        if (lease.max_context, lease.chunk, lease.slot_bytes) != (m.max_context, m.chunk, m.kv_slot_bytes):
            raise InvalidRequest(
                f"the lease's slot geometry (max_context {lease.max_context}, chunk {lease.chunk}, "
                f"{lease.slot_bytes} bytes) differs from this worker's (max_context {m.max_context}, chunk "
                f"{m.chunk}, {m.kv_slot_bytes} bytes): start both workers with the same --max-context and --chunk")
        if lease.slot >= lease.n_slots:
            raise InvalidRequest(f"slot {lease.slot} out of range (0..{lease.n_slots - 1})")
        tokens = np.asarray(request.prompt_token_ids, dtype=np.int64)
        if tokens.size == 0:
            raise InvalidRequest("prompt_token_ids is empty")
        if tokens.size > m.max_context:
            raise InvalidRequest(f"{tokens.size} prompt tokens exceed the slot context {m.max_context}")
        bad = int(tokens.max())
        if bad >= m.vocab_size:
            raise InvalidRequest(f"prompt token {bad} is outside the vocabulary (0..{m.vocab_size - 1})")
        if request.HasField("prompt_logprobs") and request.prompt_logprobs > MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"prompt_logprobs must be 0..{MAX_TOP_LOGPROBS}, got {request.prompt_logprobs}")
        return tokens

    def _shm_view(self, lease) -> MappedArena | None:
        """The mapped arena of the lease, or None when its K/V must go over the network: the lease names an address
        for that (Lease.kv_address) and its arena is not this host's to map (not under this --shm-dir, no such file
        here, or a file whose slot header does not hold the lease's generation: kv_transport's proof)."""
        if lease.kv_address and outside(lease.arena_path, self.shm_dir):
            return None
        try:
            view = self._arena(lease)
        except ArenaMissing:
            if lease.kv_address:
                return None
            raise
        if lease.kv_address and not arena_reachable(view, lease):
            return None
        return view

    def _arena(self, lease) -> MappedArena:
        """The mapping of the lease's arena, cached per path. Mappings of files that are gone or replaced
        (their decode worker stopped or restarted) are dropped first, so their memory is freed."""
        for path, view in list(self._arenas.items()):
            if not view.still_current():
                del self._arenas[path]
                log.info("dropped the mapping of a vanished arena", extra={"arena": path})
        view = self._arenas.get(lease.arena_path)
        if view is not None and (view.n_slots, view.slot_bytes) == (lease.n_slots, lease.slot_bytes):
            return view
        view = open_shared_arena(self.model, lease.arena_path, lease.n_slots, lease.slot_bytes, self.shm_dir)
        if len(self._arenas) >= _MAX_ARENAS:
            self._arenas.pop(next(iter(self._arenas)))
        self._arenas[lease.arena_path] = view
        log.info("mapped arena", extra={"arena": lease.arena_path, "slots": lease.n_slots})
        return view

    def _kv_bytes(self, n: int) -> int:
        """Bytes of K/V (codes and scales) and header this prompt left in the slot."""
        return self._header_bytes + sum(min(cap, n) * per_position for cap, per_position in self._kv_layers)


def _check_stamp(job: PrefillJob, digest: bytes) -> None:
    """Under the slot's writer lock, before anything is written: is the slot leased to the job's lease?"""
    lease = job.lease
    refusal = stamp_refusal(job.view.arena.header(lease.slot), lease.slot, lease.generation, digest)
    if refusal is not None:
        raise Stopped(*refusal)


def _push_code(code: grpc.StatusCode) -> grpc.StatusCode:
    """The Prefill status for a PushKv that failed with `code`: the decode worker's verdict on the lease as it is;
    a decode worker that cannot be reached is FAILED_PRECONDITION, as a vanished arena is on shared memory (an
    UNAVAILABLE would tell the gateway this prefill worker is down)."""
    return grpc.StatusCode.FAILED_PRECONDITION if code == grpc.StatusCode.UNAVAILABLE else code


async def serve(args) -> int:
    wid = worker_id("prefill")
    setup_logging(SERVICE, wid, args.log_level)
    tel = telemetry.setup_telemetry(SERVICE)
    model = open_model(args, max_batch=1)
    registry = CollectorRegistry()
    servicer = PrefillServicer(model=model, shm_dir=args.shm_dir, worker=wid, registry=registry, tracer=tel.tracer,
                               policy=args.prefill_policy, max_prompts=args.max_prompts,
                               max_seconds=args.max_prefill_seconds, prefix_cache=PrefixCache(args.prefix_cache_bytes),
                               grammars=worker_grammars(args.model, getattr(args, "tokenizer", None),
                                                        model.vocab_size),
                               stop_tokens=model_stop_tokens(args.model)[0], kv_token=args.service_token,
                               kv_tls=args.kv_tls)
    try:
        server = GrpcServer(args.host, args.port, [pb.DESCRIPTOR.services_by_name["Prefill"].full_name],
                            lambda srv: pb_grpc.add_PrefillServicer_to_server(servicer, srv),
                            token=args.service_token, tls=args.tls)
        start_metrics(args.metrics_port, args.host, registry)
        await server.server.start()
        await server.set_serving(True)
        log.info("prefill worker ready", extra={
            "port": server.port, "max_context": model.max_context, "chunk": model.chunk, "backend": model.backend,
            "weights": model.weights, "threads": model.threads, "model": model.path, "shm_dir": args.shm_dir,
            "prefix_cache_bytes": args.prefix_cache_bytes,
            "prefill_policy": args.prefill_policy, "max_prompts": args.max_prompts,
            "max_prefill_seconds": args.max_prefill_seconds,
            "layout_signature": f"{model.layout_signature:016x}"})
        def start_draining() -> None:
            servicer.draining = True

        await serve_until_signalled(server, lambda: servicer.in_flight, args.drain_timeout, start_draining)
    finally:
        servicer.close()
        await servicer.kv_channels.close()
        tel.shutdown()
    log.info("prefill worker stopped")
    return 0
