"""The decode worker: owns the shared-memory KV arena and its slot leases, verifies each prefill handoff and
decodes every running sequence in one continuous batch (protos/splitgemma/v1/serving.proto, service Decode).

Threads: the gRPC server runs on one asyncio loop; the batch loop runs on its own thread (services/decode/batch.py)
and the engine releases the GIL while it computes, so the loop keeps answering (health, Reserve, Stats) during a
step.

K/V arrives in the arena from a prefill worker that maps it (shared memory) or, from one on another host, over
Decode.PushKv (splitgemma/serving/kv_transport.py: KvReceiver writes it into the leased slot under the same lock,
stamp and seal rules); Generate verifies the slot the same way whichever way it came.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path

import grpc
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from splitgemma.services.decode import capacity
from splitgemma.services.decode.admission import Admission, Draining, QueueFull, QueueTimeout
from splitgemma.services.decode.batch import BatchLoop, Sequence, StreamError
from splitgemma.services.decode.speculation import SpeculationConfig
from splitgemma.services.decode.slots import Claim, ForgedLease, SlotTable
from splitgemma.engine import Sample
from splitgemma.serving import telemetry
from splitgemma.serving.detokenize import TextStream
from splitgemma.serving.grammar import Grammars
from splitgemma.serving.kv_transport import KvReceiver
from splitgemma.serving.shm_arena import LEASE_SECRET_BYTES, ShmArena, request_key
from splitgemma.serving.logits import row_sampler
from splitgemma.serving.stop_tokens import model_stop_tokens
from splitgemma.serving.tokenizer import find_tokenizer
from splitgemma.serving.worker import (GrpcServer, InvalidRequest, constraint_matcher, gen_ai_request_attributes,
                                       open_model, serve_until_signalled, setup_logging,
                                       start_metrics, worker_id)
from splitgemma.v1 import serving_pb2 as pb
from splitgemma.v1 import serving_pb2_grpc as pb_grpc

log = logging.getLogger("splitgemma.decode")
SERVICE = "splitgemma-decode"   # log records' service and OTel's service.name

_FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                 pb.FINISH_REASON_CANCELLED: "cancelled", pb.FINISH_REASON_ERROR: "error"}


class DecodeMetrics:
    def __init__(self, registry: CollectorRegistry, table: SlotTable):
        self.requests = Counter("splitgemma_decode_requests", "Generate calls by outcome", ["outcome"],
                                registry=registry)
        self.tokens = Counter("splitgemma_decode_tokens", "tokens generated (first tokens included)",
                              registry=registry)
        self.batch = Histogram("splitgemma_decode_batch_size", "sequences per decode step",
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=registry)
        self.step_seconds = Histogram("splitgemma_decode_step_seconds", "Model.decode time per step",
                                      buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2),
                                      registry=registry)
        self.host_seconds = Histogram("splitgemma_decode_host_seconds",
                                      "the batch loop's own time per step, besides Model.decode (admitting, "
                                      "sampling, stop checks, detokenizing, events)",
                                      buckets=(1e-5, 3e-5, 1e-4, 3e-4, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1),
                                      registry=registry)
        self.verify_seconds = Histogram("splitgemma_decode_handoff_verify_seconds",
                                        "slot header + checksum verification per admitted handoff",
                                        buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1),
                                        registry=registry)
        self.mask_seconds = Histogram("splitgemma_decode_grammar_mask_seconds",
                                      "time per step to compute the token masks of its constrained rows (structured "
                                      "outputs), concurrent with Model.decode",
                                      buckets=(1e-5, 3e-5, 1e-4, 3e-4, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1),
                                      registry=registry)
        self.constrained_rows = Counter("splitgemma_decode_grammar_rows",
                                        "constrained rows masked (one per constrained sequence per step)",
                                        registry=registry)
        self.leases_expired = Counter("splitgemma_decode_leases_expired", "leases revoked unclaimed",
                                      registry=registry)
        self.forced_tokens = Counter("splitgemma_decode_forced_tokens",
                                     "tokens a constraint forced, taken without computing their logits",
                                     registry=registry)
        self.lookup_drafted = Counter("splitgemma_decode_lookup_drafted_tokens",
                                      "prompt-lookup draft tokens verified", registry=registry)
        self.lookup_accepted = Counter("splitgemma_decode_lookup_accepted_tokens",
                                       "prompt-lookup draft tokens the model's own choice confirmed",
                                       registry=registry)
        self.lookup_acceptance = Gauge("splitgemma_decode_lookup_acceptance_rate",
                                       "accepted / drafted prompt-lookup tokens since start", registry=registry)
        self.kv_pushes = Counter("splitgemma_decode_kv_pushes", "network KV streams (Decode.PushKv) by outcome: "
                                 "sealed, or the status that ended them", ["outcome"], registry=registry)
        self.kv_push_bytes = Counter("splitgemma_decode_kv_push_bytes", "K/V bytes written from network KV streams",
                                     registry=registry)
        slots = Gauge("splitgemma_decode_slots", "KV slots by state", ["state"], registry=registry)
        for state in ("free", "leased", "running", "quarantine"):
            slots.labels(state=state).set_function(lambda st=state: table.counts()[st])

    def mask(self, seconds: float, rows: int) -> None:
        self.mask_seconds.observe(seconds)
        self.constrained_rows.inc(rows)

    def host(self, seconds: float) -> None:
        self.host_seconds.observe(seconds)

    def step(self, seconds: float, batch: int, tokens: int) -> None:
        self.step_seconds.observe(seconds)
        self.batch.observe(batch)
        self.tokens.inc(tokens)

    def forced(self, tokens: int) -> None:
        self.forced_tokens.inc(tokens)
        self.tokens.inc(tokens)

    def lookup(self, drafted: int, accepted: int, rate: float) -> None:
        self.lookup_drafted.inc(drafted)
        self.lookup_accepted.inc(accepted)
        self.lookup_acceptance.set(rate)


class DecodeServicer(pb_grpc.DecodeServicer):
    def __init__(self, *, model, arena: ShmArena, table: SlotTable, admission: Admission, batch: BatchLoop,
                 metrics: DecodeMetrics, worker: str, tokenizer, stop_tokens, lease_ms: int, max_lease_ms: int,
                 tracer, kv_cache_bytes: int | None, grammars: Grammars, kv_address: str = "",
                 push_idle_timeout: float = 60.0):
        self.model = model
        self.kv_address = kv_address  # Lease.kv_address: where prefill workers of other hosts push K/V (or "")
        self.kv = KvReceiver(arena, model, worker, idle_timeout=push_idle_timeout, on_done=self._pushed)
        self.grammars = grammars
        self.shm = arena
        self.table = table
        self.admission = admission
        self.batch = batch
        self.metrics = metrics
        self.worker_id = worker
        self.tokenizer = tokenizer
        self.stop_tokens = frozenset(stop_tokens)
        self.lease_ms = lease_ms
        self.max_lease_ms = max_lease_ms
        self.tracer = tracer
        self.kv_cache_bytes = kv_cache_bytes
        self.model_name = Path(model.path).stem
        self.draining = False
        self.admissions_refused = 0
        self.streams = 0  # Generate calls in progress

    # --------------------------------------------------------------------------------------------------------

    async def Reserve(self, request, context):
        (s,) = await self._reserve([request], request.lease_ms, request.priority, context)
        return self._lease(s)

    async def ReserveGroup(self, request, context):
        if not request.members:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the group has no members")
        if len(request.members) > self.table.n_slots:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the group wants {len(request.members)} slots; this worker has {self.table.n_slots}")
        if len({m.request_id for m in request.members}) < len(request.members):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the members' request ids are not distinct")
        slots = await self._reserve(request.members, request.lease_ms, request.priority, context)
        return pb.LeaseGroup(leases=[self._lease(s) for s in slots])

    async def _reserve(self, members, lease_ms: int, priority: int, context) -> list:
        """Leases for every member (ReserveRequests) at once, waiting in the admission queue (at `priority`'s place)
        if need be."""
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the decode worker is draining")
        ctx = self.model.max_context
        for m in members:
            if not m.request_id:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
            if m.prompt_tokens < 1:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_tokens must be at least 1")
            if m.prompt_tokens + m.max_tokens > ctx:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"prompt_tokens {m.prompt_tokens} + max_tokens {m.max_tokens} exceeds the slot "
                                    f"context {ctx}")
        # Clamped, not refused: its deadline_unix_ms tells the caller what was granted; no caller holds a slot
        # unclaimed for longer than this.
        lease_ms = min(lease_ms or self.lease_ms, self.max_lease_ms)
        rid = members[0].request_id
        try:
            slots, waited = await self.admission.reserve([(m.request_id, m.max_tokens) for m in members],
                                                         lease_ms / 1000, priority)
        except (QueueFull, QueueTimeout) as e:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(e, QueueFull) else \
                grpc.StatusCode.DEADLINE_EXCEEDED
            retry_ms = max(1, round(e.retry_after * 1000))
            counts = self.table.counts()
            log.info("reserve refused", extra={"request_id": rid, "slots": len(members), "reason": code.name,
                                               "retry_after_ms": retry_ms})
            await context.abort(code, f"{e} ({counts['leased']} leased, {counts['running']} running, "
                                      f"{counts['quarantine']} quarantined of {self.table.n_slots} slots); "
                                      f"retry-after-ms={retry_ms}",
                                trailing_metadata=(("retry-after-ms", str(retry_ms)),))
        except Draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the decode worker is draining")
        for s in slots:
            log.info("reserved", extra={"request_id": s.request_id, "slot": s.index, "generation": s.generation,
                                        "queued_seconds": round(waited, 4)})
        return slots

    def _lease(self, s) -> pb.Lease:
        return pb.Lease(worker_id=self.worker_id, arena_path=self.shm.path, slot=s.index, generation=s.generation,
                        deadline_unix_ms=int(s.deadline * 1000), layout_signature=self.model.layout_signature,
                        n_slots=self.shm.n_slots, slot_bytes=self.shm.slot_bytes,
                        max_context=self.model.max_context, chunk=self.model.chunk, secret=s.secret,
                        kv_address=self.kv_address)

    async def _check_secret(self, lease, context) -> None:
        if len(lease.secret) != LEASE_SECRET_BYTES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the lease's secret must be {LEASE_SECRET_BYTES} bytes, got {len(lease.secret)} (a "
                                "lease from Reserve carries one; forward it unchanged)")

    async def _forged(self, lease, context) -> None:
        self.admissions_refused += 1
        self.metrics.requests.labels(outcome="refused").inc()
        log.warning("forged lease refused", extra={"slot": lease.slot, "generation": lease.generation})
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"the secret presented is not the secret of the lease on slot {lease.slot}; the lease "
                            "was left alone")

    async def Release(self, request, context):
        lease = request.lease
        await self._check_secret(lease, context)
        if lease.worker_id != self.worker_id or lease.slot >= self.table.n_slots:
            return pb.ReleaseResponse(released=False)
        try:
            released = self.table.release(lease.slot, lease.generation, request.request_id, lease.secret)
        except ForgedLease:
            await self._forged(lease, context)
        log.info("release", extra={"request_id": request.request_id, "slot": lease.slot, "released": released})
        return pb.ReleaseResponse(released=released)

    async def Stats(self, request, context):
        c = self.table.counts()
        st = self.batch.stats
        a = self.admission
        admission = pb.AdmissionStats(queued=a.depth, max_queue=a.max_queue,
                                      queue_timeout_ms=round(a.timeout_s * 1000), lease_ms=self.lease_ms,
                                      max_lease_ms=self.max_lease_ms,
                                      queued_total=a.queued_total, refused_queue_full=a.refused_full,
                                      refused_timeout=a.refused_timeout, cancelled=a.cancelled,
                                      slots_freed_per_second=a.rate.per_second(time.monotonic()),
                                      leases_extended=self.table.leases_extended)
        return pb.DecodeStats(worker_id=self.worker_id, slots_total=self.table.n_slots, slots_leased=c["leased"],
                              slots_running=c["running"], slots_quarantined=c["quarantine"], steps=st.steps,
                              tokens_generated=st.tokens, max_batch_seen=st.max_batch_seen,
                              leases_expired=self.table.leases_expired,
                              admissions_refused=self.admissions_refused, backend=self.model.backend,
                              model=self.model.path, layout_signature=self.model.layout_signature,
                              max_context=self.model.max_context, slot_bytes=self.shm.slot_bytes,
                              kv_cache_bytes=self.kv_cache_bytes or 0, decode_seconds=st.decode_seconds,
                              host_seconds=st.host_seconds, admission=admission,
                              forced_tokens=st.forced_tokens, lookup_drafted=st.drafted,
                              lookup_accepted=st.accepted,
                              lookup_acceptance=st.accepted / st.drafted if st.drafted else 0.0,
                              kv_pushes_sealed=self.kv.stats.sealed, kv_pushes_refused=self.kv.stats.refused,
                              kv_pushes_open=self.kv.stats.open, kv_push_bytes=self.kv.stats.bytes)

    # --------------------------------------------------------------------------------------------------------

    def PushKv(self, request_iterator, context):
        return self._push(request_iterator, context)

    async def _push(self, request_iterator, context):
        with self.tracer.start_as_current_span("decode.kv_push", attributes={"splitgemma.kv.transport": "network"}):
            async for reply in self.kv.push(request_iterator, context):
                yield reply

    def _pushed(self, outcome: str, n_bytes: int) -> None:
        self.metrics.kv_pushes.labels(outcome=outcome).inc()
        self.metrics.kv_push_bytes.inc(n_bytes)
        trace.get_current_span().set_attributes({"splitgemma.kv.outcome": outcome,
                                                 "splitgemma.kv.wire_bytes": n_bytes})

    # --------------------------------------------------------------------------------------------------------

    async def Generate(self, request, context):
        rid = request.request_id
        span = self.tracer.start_span("decode.generate", attributes={
            **gen_ai_request_attributes(self.model_name, request, request.max_tokens),
            "gen_ai.usage.input_tokens": request.prompt_tokens})
        seq = None
        self.streams += 1
        try:
            with trace.use_span(span, end_on_exit=False):
                seq = await self._admit(request, context)
            while True:
                item = await seq.queue.get()
                if isinstance(item, StreamError):
                    telemetry.set_gen_ai_error(span, item.code, str(item))
                    self.metrics.requests.labels(outcome="error").inc()
                    await context.abort(getattr(grpc.StatusCode, item.code), str(item))
                yield item
                if item.finish_reason:
                    name = _FINISH_NAMES[item.finish_reason]
                    self.metrics.requests.labels(outcome=name).inc()
                    telemetry.set_gen_ai_response(span, finish_reasons=[name], output_tokens=item.completion_tokens)
                    log.info("generate finished", extra={"request_id": rid, "slot": seq.slot, "finish": name,
                                                         "completion_tokens": item.completion_tokens})
                    return
        finally:
            if seq is not None and not seq.done:
                # The caller went away (cancelled the stream): the sequence leaves the batch at the next step.
                self.batch.cancel(seq)
                self.metrics.requests.labels(outcome="cancelled").inc()
                log.info("generate cancelled by the caller", extra={"request_id": rid, "slot": seq.slot})
            self.streams -= 1
            span.end()

    async def _admit(self, request, context) -> Sequence:
        rid, lease = request.request_id, request.lease
        with self.tracer.start_as_current_span("decode.admit", attributes={"gen_ai.response.id": rid}) as span:
            if self.draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the decode worker is draining")
            if lease.worker_id != self.worker_id or lease.arena_path != self.shm.path:
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"the lease is for worker {lease.worker_id!r} ({lease.arena_path}); this is "
                                    f"{self.worker_id!r} ({self.shm.path})")
            if lease.slot >= self.table.n_slots:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"slot {lease.slot} out of range (0..{self.table.n_slots - 1})")
            await self._check_secret(lease, context)
            verdict, slot = self.table.claim(lease.slot, lease.generation, rid, lease.secret, time.time())
            if verdict is Claim.FORGED:
                await self._forged(lease, context)
            if verdict is Claim.UNKNOWN:
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"no live lease on slot {lease.slot} with generation {lease.generation} for "
                                    f"request {rid!r} (released, finished or never issued)")
            if verdict is Claim.EXPIRED:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"the lease on slot {lease.slot} (generation {lease.generation}) expired")
            if verdict is Claim.MISMATCH:
                self.admissions_refused += 1
                self.metrics.requests.labels(outcome="refused").inc()
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"slot {lease.slot} is held by another lease (the presented generation "
                                    f"{lease.generation} / request id do not match it): stale or forged lease")
            try:
                seq = await self._build(request, slot, context)
            except BaseException:
                self.table.refuse(lease.slot)
                raise
            span.set_attribute("splitgemma.slot", lease.slot)
        self.table.attach(lease.slot, seq)
        try:
            self.batch.admit(seq)
        except StreamError as e:
            self.table.refuse(lease.slot)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        log.info("admitted", extra={"request_id": rid, "slot": lease.slot, "prompt_tokens": request.prompt_tokens})
        return seq

    async def _build(self, request, slot, context) -> Sequence:
        rid, lease = request.request_id, request.lease
        try:
            if request.first_token.token_id >= self.model.vocab_size:
                raise InvalidRequest(f"first_token {request.first_token.token_id} is outside the vocabulary "
                                     f"(0..{self.model.vocab_size - 1})")
            if request.stop and self.tokenizer is None:
                raise InvalidRequest("stop strings need a tokenizer; this decode worker runs without one "
                                     "(start it with --tokenizer)")
            stop_ids = set(request.stop_token_ids)
            if not request.ignore_eos:
                stop_ids |= self.stop_tokens
            sampler = row_sampler(request.sampling, vocab_size=self.model.vocab_size, rng_state=request.rng_state,
                                  want_logprob=request.sampling.logprobs, prompt_ids=request.prompt_token_ids,
                                  stop_ids=stop_ids)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        matcher = await constraint_matcher(self.grammars, request.sampling, context)
        try:
            # Off the event loop: the checksum reads every live K/V row (milliseconds for a long E2B prompt).
            seconds = await asyncio.to_thread(self._verify, lease.slot, request_key(rid), lease.generation)
            n = self.shm.arena.n_tokens(lease.slot)
            if n != request.prompt_tokens:
                raise ValueError(f"slot {lease.slot}: the header holds {n} positions, the request says "
                                 f"prompt_tokens {request.prompt_tokens}")
        except ValueError as e:
            self.admissions_refused += 1
            self.metrics.requests.labels(outcome="refused").inc()
            log.warning("handoff refused", extra={"request_id": rid, "slot": lease.slot, "reason": str(e)})
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"KV handoff refused: {e}")
        self.metrics.verify_seconds.observe(seconds)
        first = request.first_token
        return Sequence(
            request_id=rid, slot=lease.slot, prompt_tokens=request.prompt_tokens,
            first=Sample(first.token_id, request.rng_state, first.logprob,
                         [(t.token_id, t.logprob) for t in first.top_logprobs]),
            sampler=sampler, max_tokens=request.max_tokens or slot.max_tokens,
            max_context=self.model.max_context, stop_ids=frozenset(stop_ids),
            text=(TextStream(self.tokenizer, request.stop, skip_special_tokens=not request.include_special_tokens,
                             include_stop=request.include_stop_str_in_output)
                  if self.tokenizer is not None else None),
            token_name=self._token_name, queue=asyncio.Queue(), matcher=matcher,
            prompt_ids=tuple(request.prompt_token_ids), prediction_ids=tuple(request.prediction_token_ids))

    def _verify(self, slot: int, key: int, generation: int) -> float:
        t0 = time.perf_counter()
        self.shm.arena.verify(slot, key, generation)
        return time.perf_counter() - t0

    def _token_name(self, token_id: int) -> str:
        name = self.tokenizer.id_to_token(token_id) if self.tokenizer is not None else None
        return name if name is not None else str(token_id)


# ---------------------------------------------------------------------------------------------------------------


async def _sweep_leases(table: SlotTable, metrics: DecodeMetrics, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        for s in table.tick(time.time()):
            metrics.leases_expired.inc()
            log.info("lease expired", extra={"request_id": s.request_id, "slot": s.index,
                                             "generation": s.generation})


def _load_tokenizer(args):
    from splitgemma.serving.tokenizer import TokenizerNotFound, load_tokenizer
    try:
        return load_tokenizer(args.model, args.tokenizer)
    except TokenizerNotFound as e:
        if args.tokenizer is not None:
            raise
        log.warning("running without a tokenizer: token texts stay empty and stop strings are refused",
                    extra={"reason": str(e)})
        return None


async def serve(args) -> int:
    wid = args.worker_id or worker_id("decode")
    setup_logging(SERVICE, wid, args.log_level)
    tel = telemetry.setup_telemetry(SERVICE)
    loop = asyncio.get_running_loop()
    model = open_model(args, max_batch=args.max_batch)
    tokenizer = _load_tokenizer(args)
    tokenizer_path = find_tokenizer(args.model, args.tokenizer) if tokenizer is not None else None
    stop_tokens, stop_source = model_stop_tokens(args.model)
    cap = capacity.plan(model.kv_slot_bytes, slots=args.slots, kv_cache_bytes=args.kv_cache_bytes,
                        folder=args.shm_dir, model_path=args.model)
    # For the person starting it (the JSON "decode worker ready" line carries the same figures as fields).
    print(f"splitgemma decode: {cap.describe()}", file=sys.stderr, flush=True)
    shm = ShmArena.create(model, cap.slots, wid, args.shm_dir)
    task = None
    try:
        registry = CollectorRegistry()
        table = SlotTable(cap.slots, stamp=shm.stamp_lease, revoke=shm.revoke, writing=shm.writing)
        admission = Admission(table, loop, registry, max_queue=args.max_queue, timeout_s=args.queue_timeout)
        table.on_free = admission.slot_freed
        metrics = DecodeMetrics(registry, table)
        batch = BatchLoop(model, shm.arena, table, loop, metrics,
                          SpeculationConfig(forced=args.forced_tokens == "on", lookup_k=args.lookup_k,
                                            lookup_max_batch=args.lookup_max_batch,
                                            lookup_policy=args.lookup_policy))
        servicer = DecodeServicer(model=model, arena=shm, table=table, admission=admission, batch=batch,
                                  metrics=metrics, worker=wid,
                                  tokenizer=tokenizer, stop_tokens=stop_tokens, lease_ms=args.lease_ms,
                                  max_lease_ms=args.max_lease_ms,
                                  tracer=tel.tracer, kv_cache_bytes=cap.budget,
                                  grammars=Grammars(tokenizer_path, stop_tokens, model.vocab_size),
                                  kv_address=args.advertise_address or "",
                                  push_idle_timeout=args.max_lease_ms / 1000)
        server = GrpcServer(args.host, args.port, [pb.DESCRIPTOR.services_by_name["Decode"].full_name],
                            lambda srv: pb_grpc.add_DecodeServicer_to_server(servicer, srv),
                            token=args.service_token, tls=args.tls)
        start_metrics(args.metrics_port, args.host, registry)
        await server.server.start()
        batch.start()
        # Leases expire on time within a quarter of their length; quarantined slots are retried often (a revoke is
        # one fcntl call), so a slot comes back within ~50 ms of its last writer letting go.
        task = asyncio.create_task(_sweep_leases(table, metrics, min(0.05, max(0.01, args.lease_ms / 4000))))
        await server.set_serving(True)
        log.info("decode worker ready", extra={
            "port": server.port, "arena": shm.path, "slots": cap.slots, "slot_bytes": shm.slot_bytes,
            "arena_bytes": shm.size, "kv_cache_bytes": cap.budget, "slots_from": cap.rule,
            "rows_per_pass": model.max_rows,
            "max_context": model.max_context, "chunk": model.chunk, "backend": model.backend,
            "weights": model.weights, "threads": model.threads, "model": model.path,
            "layout_signature": f"{model.layout_signature:016x}", "stop_tokens": list(stop_tokens),
            "stop_tokens_from": stop_source, "tokenizer": tokenizer is not None})

        def start_draining() -> None:
            servicer.draining = True
            admission.drain()  # queued Reserves are answered UNAVAILABLE now, not left to time out

        # Running streams finish (bounded) before the batch loop stops.
        await serve_until_signalled(server, lambda: servicer.streams, args.drain_timeout, start_draining,
                                    before_stop=batch.stop)
    finally:
        if task is not None:
            task.cancel()
        shm.close()
        tel.shutdown()
    log.info("decode worker stopped")
    return 0
