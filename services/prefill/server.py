"""The prefill worker: runs a prompt straight into a slot of a decode worker's shared-memory arena, seals the slot
header and samples the first token (protos/splitgemma/v1/serving.proto, service Prefill).

One Model per worker; its calls run one at a time on a single worker thread (the engine releases the GIL), so
the asyncio loop keeps answering health checks and cancellations while a prompt runs. The prompt is run chunk by
chunk (Model.chunk positions per call, the same passes one call would make): between chunks the worker notices a
cancelled call or a lease past its deadline and stops without sealing, so a half-written slot can never be
admitted (Generate verifies the seal and checksum). It writes a slot only under the slot's writer lock and only if
the slot's lease stamp is its lease (shm_arena.SlotLocks), so the decode worker never hands a slot to a new owner
while a stale prefill can still write it. The prefix cache (prefix_cache.py) restores a prompt's cached prefix
into the slot before the first chunk and keeps the full blocks each chunk completes.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Histogram

from splitgemma.engine import sample
from splitgemma.serving import telemetry
from splitgemma.serving.shm_arena import ArenaError, ArenaMissing, MappedArena, open_shared_arena, request_key
from splitgemma.serving.worker import (GrpcServer, InvalidRequest, gen_ai_request_attributes, open_model,
                                       sampling_kwargs, serve_until_signalled, setup_logging, start_metrics,
                                       token_message, worker_id)
from splitgemma.v1 import serving_pb2 as pb
from splitgemma.v1 import serving_pb2_grpc as pb_grpc

from .prefix_cache import PrefixCache, PrefixCacheCollector

log = logging.getLogger("splitgemma.prefill")

# Arenas kept mapped (one per decode worker, normally); a mapping whose file is gone is dropped at once anyway.
_MAX_ARENAS = 64


class _Stopped(Exception):
    """The prompt run stopped between chunks: `code` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class _Result:
    first: object  # splitgemma.engine.Sample
    checksum: int
    cached_tokens: int
    seconds: float
    seal_seconds: float


class PrefillServicer(pb_grpc.PrefillServicer):
    def __init__(self, *, model, shm_dir: str, worker: str, registry: CollectorRegistry, tracer,
                 prefix_cache: PrefixCache):
        self.model = model
        self.prefix_cache = prefix_cache
        self.shm_dir = shm_dir
        self.worker_id = worker
        self.tracer = tracer
        self.model_name = Path(model.path).stem
        self.draining = False
        self.in_flight = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill-model")
        self._arenas: dict[str, MappedArena] = {}
        layout = model.kv_layout
        scale_bytes = 8 if layout["kv_dtype"] == "int8" else 0  # an f16 cache has no per-position scales
        self._kv_layers = [(L["cap"], 2 * L["row_bytes"] + scale_bytes) for L in layout["layers"]]
        self.requests = 0
        self.prompt_tokens = 0
        self.busy_seconds = 0.0
        self.m_requests = Counter("splitgemma_prefill_requests", "Prefill calls by outcome", ["outcome"],
                                  registry=registry)
        self.m_tokens = Counter("splitgemma_prefill_tokens", "prompt tokens run", registry=registry)
        self.m_seconds = Histogram("splitgemma_prefill_seconds", "prompt run time (all chunks)",
                                   buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60),
                                   registry=registry)
        self.m_seal = Histogram("splitgemma_prefill_handoff_seal_seconds", "slot header seal (checksum) time",
                                buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1), registry=registry)
        registry.register(PrefixCacheCollector(prefix_cache))

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    # --------------------------------------------------------------------------------------------------------

    async def Stats(self, request, context):
        stats = pb.PrefillStats(worker_id=self.worker_id, requests=self.requests, prompt_tokens=self.prompt_tokens,
                                busy_seconds=self.busy_seconds, backend=self.model.backend, model=self.model.path,
                                layout_signature=self.model.layout_signature, prefix_cache=self.prefix_cache.stats())
        stats.prefix_cache.block_tokens = self.model.chunk
        return stats

    async def Prefill(self, request, context):
        rid = request.request_id
        span = self.tracer.start_span("prefill.forward", attributes={
            **gen_ai_request_attributes(self.model_name, rid, request.sampling),
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
        rid, lease = request.request_id, request.lease
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill worker is draining")
        try:
            sampling = sampling_kwargs(request.sampling)
            tokens = self._check(request)
            view = self._arena(lease)
        except ArenaMissing as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except (InvalidRequest, ArenaError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        seed = request.sampling.seed if request.sampling.HasField("seed") else secrets.randbits(64)
        cancel = threading.Event()
        loop = asyncio.get_running_loop()
        try:
            r = await loop.run_in_executor(self._executor, self._run, view, request, tokens, sampling, seed, cancel)
        except asyncio.CancelledError:
            cancel.set()  # the caller went away: stop at the next chunk, leave the slot unsealed
            log.info("prefill cancelled by the caller", extra={"request_id": rid, "slot": lease.slot})
            raise
        except _Stopped as e:
            await context.abort(e.code, str(e))
        except (ValueError, IndexError) as e:  # the engine refused (its checks run before any slot byte changes)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prefill refused: {e}")
        n = len(tokens)
        self.requests += 1
        self.prompt_tokens += n
        self.busy_seconds += r.seconds
        self.m_requests.labels(outcome="ok").inc()
        self.m_tokens.inc(n)
        self.m_seconds.observe(r.seconds)
        self.m_seal.observe(r.seal_seconds)
        telemetry.set_gen_ai_response(span, output_tokens=1)
        span.set_attribute("gen_ai.usage.cache_read.input_tokens", r.cached_tokens)
        log.info("prefilled", extra={"request_id": rid, "slot": lease.slot, "generation": lease.generation,
                                     "arena": lease.arena_path, "prompt_tokens": n, "cached_tokens": r.cached_tokens,
                                     "seconds": round(r.seconds, 6), "first_token": r.first.token})
        return pb.PrefillResponse(first_token=token_message(r.first), prompt_tokens=n, kv_checksum=r.checksum,
                                  rng_state=r.first.rng_state, prefill_seconds=r.seconds,
                                  kv_bytes_written=self._kv_bytes(n), cached_tokens=r.cached_tokens)

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
        return tokens

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

    def _run(self, view: MappedArena, request, tokens: np.ndarray, sampling: dict, seed: int,
             cancel: threading.Event) -> _Result:
        """The prompt run, on the model thread."""
        lease = request.lease
        deadline = lease.deadline_unix_ms / 1000

        def check() -> None:
            if cancel.is_set():
                raise _Stopped(grpc.StatusCode.CANCELLED, "the caller cancelled the prefill")
            if time.time() > deadline:
                raise _Stopped(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"the lease on slot {lease.slot} expired before the prefill finished; the slot was "
                               "left unsealed")

        t0 = time.perf_counter()
        chunk = self.model.chunk
        logits = None
        # The slot's writer lock, held for the whole run: the decode worker cannot take the slot back while we write
        # (shm_arena.SlotLocks). Under it, the lease stamp says whether the slot is still ours.
        with view.locks.held(lease.slot):
            check()  # an expired lease says so (its stamp is cleared too)
            if view.arena.header(lease.slot)["generation"] != lease.generation:
                raise _Stopped(grpc.StatusCode.FAILED_PRECONDITION,
                               f"slot {lease.slot} is not leased to generation {lease.generation} (the lease was "
                               "revoked: released or expired, or was never issued); nothing was written")
            cached = self.prefix_cache.restore(view.arena, lease.slot, tokens)
            for i in range(cached, len(tokens), chunk):
                check()
                logits = self.model.prefill(view.arena, lease.slot, tokens[i:i + chunk], pos0=i)
                self.prefix_cache.capture(view.arena, lease.slot, tokens, i, len(tokens[i:i + chunk]))
            check()
            t1 = time.perf_counter()
            view.arena.seal(lease.slot, request_key(request.request_id), lease.generation)
            t2 = time.perf_counter()
        first = sample(logits, rng_state=seed, **sampling)
        return _Result(first, view.arena.header(lease.slot)["checksum"], cached, t2 - t0, t2 - t1)

    def _kv_bytes(self, n: int) -> int:
        """Bytes of K/V (codes and scales) and header this prompt left in the slot."""
        return 64 + sum(min(cap, n) * per_position for cap, per_position in self._kv_layers)


async def serve(args) -> int:
    wid = worker_id("prefill")
    setup_logging("prefill", wid, args.log_level)
    tel = telemetry.setup_telemetry("splitgemma-prefill")
    model = open_model(args, max_batch=1)
    registry = CollectorRegistry()
    servicer = PrefillServicer(model=model, shm_dir=args.shm_dir, worker=wid, registry=registry, tracer=tel.tracer,
                               prefix_cache=PrefixCache(args.prefix_cache_bytes))
    try:
        server = GrpcServer(args.host, args.port, [pb.DESCRIPTOR.services_by_name["Prefill"].full_name],
                            lambda srv: pb_grpc.add_PrefillServicer_to_server(servicer, srv))
        start_metrics(args.metrics_port, args.host, registry)
        await server.server.start()
        await server.set_serving(True)
        log.info("prefill worker ready", extra={
            "port": server.port, "max_context": model.max_context, "chunk": model.chunk, "backend": model.backend,
            "weights": model.weights, "threads": model.threads, "model": model.path, "shm_dir": args.shm_dir,
            "prefix_cache_bytes": args.prefix_cache_bytes,
            "layout_signature": f"{model.layout_signature:016x}"})
        def start_draining() -> None:
            servicer.draining = True

        await serve_until_signalled(server, lambda: servicer.in_flight, args.drain_seconds, start_draining)
    finally:
        servicer.close()
        tel.shutdown()
    log.info("prefill worker stopped")
    return 0
