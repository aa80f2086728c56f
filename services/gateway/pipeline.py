"""One generation through the workers: Decode.Reserve → Prefill.Prefill(lease) → Decode.Generate(lease) stream.

A request with n choices (or several prompts) runs one pipeline per choice. Admission is all or nothing: the
choices reserve their slots together on one decode worker (Decode.ReserveGroup, which grants them all at once,
waiting in the worker's queue if it must: docs/scheduling.md), and if that is refused the request is answered 429
(queue full) or 503 (waited too long) before any compute is spent. Every RPC has a deadline (Reserve's covers the worker's queue
timeout); the Generate stream has an idle deadline between events, so a stalled worker turns into an error instead
of a hang. Whatever ends a pipeline (an error, the client going away, cancellation), its lease is released or its
Generate call cancelled, which frees the slot.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field

import grpc
from splitgemma.serving.prefix_keys import cacheable_keys
from splitgemma.v1 import serving_pb2 as pb

from .protocol import ApiError
from .workers import Worker, WorkerPool

log = logging.getLogger("splitgemma.gateway")

FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@dataclass
class Timeouts:
    reserve: float = 5.0            # the Reserve RPC, beyond the decode worker's queue timeout
    # A whole prompt, its wait in the prefill worker's queue included: the worker holds the slot (and the decode
    # worker keeps its lease) while the call lasts, and stops the prompt, unsealed, when this deadline or its own
    # --max-prefill-seconds (default 600 s) passes. A hang guard: the client going away cancels the call sooner.
    prefill: float = 1800.0
    first_event: float = 30.0       # Generate: admission into the batch (checks the slot header) to the first event
    idle: float = 60.0              # Generate: between two events
    release: float = 2.0


@dataclass
class ChoiceSpec:
    """What one choice asks for; max_tokens None = the rest of the context, or default_max_tokens if that is less
    (chat without max_tokens: the gateway's --default-max-tokens)."""

    index: int
    prompt_ids: list[int]
    max_tokens: int | None
    sampling: pb.SamplingParams
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_param: str = "prompt"    # the request field the prompt came from, for error messages
    default_max_tokens: int | None = None
    prompt_logprobs: int | None = None  # the prompt's logprobs with the top n per position (None: not asked for)
    priority: int = 0                   # lower first, in the decode worker's queue and the prefill worker's order
    prediction_ids: list[int] = field(default_factory=list)  # a predicted output's (the decode worker drafts from it)
    # max_tokens bounds the answer and the context may end it sooner, instead of a prompt + max_tokens beyond the
    # context being a 400 (Anthropic's Messages API: stop_reason model_context_window_exceeded)
    fit_context: bool = False

    def token_budget(self, context: int) -> int:
        """max_tokens for a slot of `context` positions (checked by check_context first)."""
        rest = context - len(self.prompt_ids)
        if self.max_tokens is not None:
            return min(self.max_tokens, rest) if self.fit_context else self.max_tokens
        return rest if self.default_max_tokens is None else min(rest, self.default_max_tokens)


class ClientGone(Exception):
    """The HTTP client disconnected; the pipeline was cancelled."""


def context_error(prompt_tokens: int, max_tokens: int | None, context: int, param: str) -> ApiError:
    where = param if param in ("messages", "input") else "prompt"
    if max_tokens is None:
        message = (f"This model's maximum context length is {context} tokens. However, your {where} has "
                   f"{prompt_tokens} tokens, which leaves no room for a completion. Please reduce the length of "
                   f"the {where}.")
    else:
        message = (f"This model's maximum context length is {context} tokens. However, you requested "
                   f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {where}, {max_tokens} in the "
                   f"completion). Please reduce the length of the {where} or completion.")
    return ApiError(400, message, param=param, code="context_length_exceeded")


def check_context(spec: ChoiceSpec, context: int) -> None:
    """Raise 400 context_length_exceeded unless prompt + max_tokens fits in `context` (0 = not known)."""
    if not context:
        return
    n = len(spec.prompt_ids)
    if spec.max_tokens is None or spec.fit_context:
        if n >= context:
            raise context_error(n, None, context, spec.prompt_param)
    elif n + spec.max_tokens > context:
        raise context_error(n, spec.max_tokens, context, spec.prompt_param)


# How long an abandoned Reserve may take to answer before it is taken for queued and cancelled (a grant comes back
# within a round trip: milliseconds).
RESERVE_GRACE = 1.0


_RETRY_RE = re.compile(r"retry-after(-ms)?[=: ]+([0-9]+(?:\.[0-9]+)?)", re.I)


def _retry_after(e: grpc.aio.AioRpcError, default: float = 1.0) -> float:
    """Seconds to wait, from the worker's "retry-after-ms" trailer or a "retry-after[-ms]=N" in its message."""
    for key, value in e.trailing_metadata() or ():
        if key == "retry-after-ms" and value.isdigit():
            return int(value) / 1000
    m = _RETRY_RE.search(e.details() or "")
    if m is None:
        return default
    return float(m.group(2)) / (1000 if m.group(1) else 1)


@dataclass(eq=False)
class Run:
    """The state of one choice's pipeline."""

    spec: ChoiceSpec
    request_id: str                  # the API request's id + "-{choice index}"
    response_id: str = ""            # the API request's id (the body's), for the workers' spans
    operation: str = ""              # gen_ai.operation.name, for the workers' spans
    decode: Worker | None = None
    lease: pb.Lease | None = None
    prefill_result: pb.PrefillResponse | None = None
    max_tokens: int = 0              # resolved (spec.max_tokens or the rest of the context)
    finished: bool = False           # Generate ended (the slot is the decode worker's to free)
    released: bool = False


class Pipelines:
    def __init__(self, pool: WorkerPool, timeouts: Timeouts, metrics):
        self.pool = pool
        self.timeouts = timeouts
        self.metrics = metrics
        self._background: set[asyncio.Task] = set()

    # -- admission -----------------------------------------------------------------------------------------------

    async def admit(self, request_id: str, specs: list[ChoiceSpec], operation: str = "") -> list[Run]:
        """Reserve a slot for every choice, or none (ApiError 400/429/503)."""
        context = self.pool.known_context()
        for spec in specs:
            check_context(spec, context)
        runs = [Run(spec, f"{request_id}-{spec.index}", request_id, operation) for spec in specs]
        try:
            await self._reserve(runs)
        except BaseException:
            self.release_all(runs)
            raise
        return runs

    async def _reserve(self, runs: list[Run]) -> None:
        """Lease a slot for every choice on one decode worker, all at once, waiting in its queue if it must."""
        candidates = self.pool.decode_candidates()
        if not candidates:
            self.metrics.rejections.labels(reason="no_decode_worker").inc()
            raise ApiError(503, "no decode worker is available", retry_after=1.0)
        # A group larger than a worker's slots could only wait out its queue timeout there.
        fitting = [w for w in candidates if w.stats is None or w.stats.slots_total >= len(runs)]
        if not fitting:
            most = max(w.stats.slots_total for w in candidates)
            raise ApiError(400, f"the request asks for {len(runs)} choices (prompts × n) but a decode worker has at "
                           f"most {most} slots", param="n", code="invalid_value")
        full_hint = None
        unavailable = 0
        for w in fitting:
            members = []
            for run in runs:
                spec = run.spec
                if w.max_context:
                    check_context(spec, w.max_context)
                    want = spec.token_budget(w.max_context)
                else:
                    want = 1  # this worker's context is not known before its first lease, which is checked below
                members.append(pb.ReserveRequest(request_id=run.request_id, prompt_tokens=len(spec.prompt_ids),
                                                 max_tokens=want, priority=spec.priority))
            w.reserving += 1
            try:
                # Cancelled when the client goes away: the decode worker takes the call out of its queue.
                timeout = w.queue_timeout + self.timeouts.reserve
                call = w.stub.Reserve(members[0], timeout=timeout) if len(members) == 1 else \
                    w.stub.ReserveGroup(pb.ReserveGroupRequest(members=members, priority=runs[0].spec.priority),
                                        timeout=timeout)
                # Awaited through a shield: a cancellation (the client went away) must not cut the call off just
                # as its grant arrives, or the lease would be lost (_abandon_reserve).
                reply_task = asyncio.ensure_future(call)
                try:
                    reply = await asyncio.shield(reply_task)
                except asyncio.CancelledError:
                    self._abandon_reserve(w, call, reply_task, runs)
                    raise
                leases = [reply] if len(members) == 1 else list(reply.leases)
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    # This worker's queue is full; another's may not be.
                    full_hint = _retry_after(e) if full_hint is None else min(full_hint, _retry_after(e))
                    continue
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    # Waited the whole queue timeout (the worker says so, with its hint) or our own deadline
                    # passed; queueing again elsewhere would double the wait.
                    self.metrics.rejections.labels(reason="queue_timeout").inc()
                    raise ApiError(503, f"no decode slot became free in time: {e.details()}",
                                   retry_after=_retry_after(e), code="queue_timeout") from None
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    details = e.details() or "the decode worker rejected the request"
                    raise ApiError(400, details, param="n" if "group" in details else runs[0].spec.prompt_param,
                                   code="context_length_exceeded" if "context" in details else None)
                self.pool.mark_failed(w, e)
                unavailable += 1
                continue
            finally:
                w.reserving -= 1
            w.grants.extend([time.monotonic()] * len(leases))
            for run, lease in zip(runs, leases):
                # A prefill worker that cannot map the arena (another host) sends the K/V here over the network,
                # unless the decode worker advertised another address for that.
                lease.kv_address = lease.kv_address or w.address
                run.decode, run.lease = w, lease
            max_context = leases[0].max_context
            if max_context and max_context != w.max_context:
                w.max_context = max_context
            for run in runs:  # an ApiError here: admit releases every lease
                check_context(run.spec, max_context)
                run.max_tokens = run.spec.token_budget(max_context)
            return
        if full_hint is not None:
            self.metrics.rejections.labels(reason="queue_full").inc()
            raise ApiError(429, "all decode slots are busy and the queue for them is full; retry later",
                           retry_after=full_hint, code="queue_full")
        self.metrics.rejections.labels(reason="decode_unavailable").inc()
        raise ApiError(503, f"no decode worker answered ({unavailable} unavailable)", retry_after=1.0)

    # -- prefill -------------------------------------------------------------------------------------------------

    async def prefill(self, run: Run) -> None:
        """Prefill into the leased slot; on any failure (or cancellation) the lease is released.

        A worker that is UNAVAILABLE (gone, or not accepting calls) or RESOURCE_EXHAUSTED (its --max-prompts in
        flight) has not written into the slot, so the prefill is tried again on another healthy prefill worker, once
        per worker."""
        tried: set[Worker] = set()
        keys = cacheable_keys(run.spec.prompt_ids, run.lease.chunk)
        try:
            while True:
                w, why = self.pool.pick_prefill(exclude=tried, keys=keys)
                if w is None:
                    self.metrics.rejections.labels(reason="no_prefill_worker").inc()
                    raise ApiError(503, "no prefill worker is available", retry_after=1.0)
                tried.add(w)
                w.in_flight += 1
                t0 = time.perf_counter()
                try:
                    run.prefill_result = await w.stub.Prefill(
                        pb.PrefillRequest(request_id=run.request_id, prompt_token_ids=run.spec.prompt_ids,
                                          lease=run.lease, sampling=run.spec.sampling,
                                          stop_token_ids=run.spec.stop_token_ids, ignore_eos=run.spec.ignore_eos,
                                          response_id=run.response_id, operation=run.operation,
                                          prompt_logprobs=run.spec.prompt_logprobs, priority=run.spec.priority),
                        timeout=self.timeouts.prefill)
                except grpc.aio.AioRpcError as e:
                    self.pool.mark_failed(w, e)
                    retry = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
                    if retry and self.pool.pick_prefill(exclude=tried)[0] is not None:
                        log.warning("prefill worker unavailable or full; trying another",
                                    extra={"request_id": run.request_id, "worker": w.address,
                                           "error": e.code().name})
                        continue
                    raise _prefill_error(e) from None
                finally:
                    w.in_flight -= 1
                self.metrics.prefill_latency.observe(time.perf_counter() - t0)
                self.metrics.prefill_routes.labels(reason=why).inc()
                self.metrics.kv_transport.labels(transport=run.prefill_result.kv_transport or "shm").inc()
                self.pool.ran_prompt(w, keys)
                return
        except BaseException:
            self.release(run)
            raise

    async def prefill_all(self, runs: list[Run]) -> None:
        """Prefill every choice concurrently. When one fails the others are cancelled, and waited for, before the
        error goes up: each then releases its own lease, after its Prefill call has ended."""
        tasks = [asyncio.ensure_future(self.prefill(r)) for r in runs]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    # -- generate ------------------------------------------------------------------------------------------------

    async def generate(self, run: Run):
        """Yield the GenerateEvents of one choice until its finish; raises ApiError on a worker failure. Closing
        the generator early (client gone) cancels the call, which frees the slot in the decode worker."""
        spec, w = run.spec, run.decode
        request = pb.GenerateRequest(
            request_id=run.request_id, lease=run.lease, prompt_tokens=len(spec.prompt_ids),
            first_token=run.prefill_result.first_token, sampling=spec.sampling, max_tokens=run.max_tokens,
            stop_token_ids=spec.stop_token_ids, stop=spec.stop, ignore_eos=spec.ignore_eos,
            rng_state=run.prefill_result.rng_state, include_special_tokens=not spec.skip_special_tokens,
            include_stop_str_in_output=spec.include_stop_str_in_output,
            # the decode worker reads the prompt's ids for repetition_penalty and for prompt lookup
            prompt_token_ids=spec.prompt_ids, prediction_token_ids=spec.prediction_ids,
            response_id=run.response_id, operation=run.operation)
        w.in_flight += 1
        reader = _StreamReader(w.stub.Generate(request))
        timeout = self.timeouts.first_event
        try:
            while True:
                try:
                    event = await reader.read(timeout)
                except asyncio.TimeoutError:
                    raise ApiError(504, f"the decode worker {w.address} sent nothing for {timeout:.0f} s") from None
                except grpc.aio.AioRpcError as e:
                    self.pool.mark_failed(w, e)
                    raise _generate_error(e, w) from None
                if event is grpc.aio.EOF:
                    raise ApiError(502, f"the decode worker {w.address} ended the stream without a finish reason")
                timeout = self.timeouts.idle
                if event.finish_reason == pb.FINISH_REASON_ERROR:
                    raise ApiError(502, f"the decode worker failed this sequence: {event.stop_reason or 'error'}")
                if event.finish_reason == pb.FINISH_REASON_CANCELLED:
                    raise ApiError(503, "the decode worker cancelled this sequence", retry_after=1.0)
                if event.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    run.finished = True
                yield event
                if run.finished:
                    # Read the stream to its end so the call (and its client span) completes.
                    await reader.read(self.timeouts.release)
                    return
        finally:
            w.in_flight -= 1
            # Cancelled, failed or finished: make sure the worker drops the sequence (frees the slot) and that a read
            # still in flight ends.
            reader.close()

    # -- cleanup -------------------------------------------------------------------------------------------------

    def release(self, run: Run) -> None:
        """Give the lease back in the background: it must happen even when the caller is being cancelled."""
        if run.lease is None or run.released or run.finished:
            return
        run.released = True
        task = asyncio.get_running_loop().create_task(self._release(run))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def release_all(self, runs: list[Run]) -> None:
        for run in runs:
            self.release(run)

    def _abandon_reserve(self, w: Worker, call, reply_task: asyncio.Task, runs: list[Run]) -> None:
        """The caller was cancelled (its client went away) while its Reserve was in flight. A grant on its way
        arrives within a round trip, and its leases, which nobody would claim or give back before they expire, are
        released; a call still unanswered after RESERVE_GRACE waits in the worker's queue and is cancelled, which
        takes it out. (Cancelling at once would lose a grant already on the wire: the client interceptors then drop
        the reply.)"""

        async def settle():
            done, _ = await asyncio.wait((reply_task,), timeout=RESERVE_GRACE)
            if not done:
                call.cancel()
            try:
                reply = await reply_task
            except (asyncio.CancelledError, grpc.aio.AioRpcError):
                return  # refused, or cancelled while queued: nothing was granted
            leases = [reply] if isinstance(reply, pb.Lease) else list(reply.leases)
            for run, lease in zip(runs, leases):
                run.decode, run.lease = w, lease
                self.release(run)

        task = asyncio.get_running_loop().create_task(settle())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, run: Run) -> None:
        try:
            await run.decode.stub.Release(pb.ReleaseRequest(request_id=run.request_id, lease=run.lease),
                                          timeout=self.timeouts.release)
        except grpc.aio.AioRpcError as e:
            # The lease expires on its own; the worker may also be gone.
            log.info("release failed", extra={"request_id": run.request_id, "error": e.code().name})

    async def drain(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


class _StreamReader:
    """Reads a grpc.aio response stream without ever cancelling a read in flight.

    grpc.aio leaks native memory when the task awaiting a read is cancelled while the read is under way: the batch's
    op array and the message Core then receives into it are never freed (grpc/grpc#43360, about 1 KB per stream a
    client drops mid-way, without bound). So each read runs in a task of its own that the reader's caller only waits
    for; a timeout or the caller's own cancellation leaves it running, and close() cancels the call instead, which
    makes Core complete the read, and so free it, the normal way."""

    def __init__(self, call):
        self.call = call
        self._pending: asyncio.Future | None = None

    async def read(self, timeout: float):
        """The next message or grpc.aio.EOF; asyncio.TimeoutError after `timeout` s (the read stays pending)."""
        if self._pending is None:
            self._pending = asyncio.ensure_future(self.call.read())
        done, _ = await asyncio.wait((self._pending,), timeout=timeout)
        if not done:
            raise asyncio.TimeoutError
        task, self._pending = self._pending, None
        return task.result()

    def close(self) -> None:
        self.call.cancel()  # a no-op when the call has ended
        if self._pending is not None:
            # Its outcome (the cancellation) is of no interest; retrieving it keeps asyncio from logging it.
            self._pending.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._pending = None


def _prefill_error(e: grpc.aio.AioRpcError) -> ApiError:
    code, details = e.code(), e.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ApiError(400, f"the prefill worker rejected the prompt: {details}")
    if code == grpc.StatusCode.UNAVAILABLE:
        return ApiError(503, f"the prefill worker is unavailable: {details}", retry_after=1.0)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ApiError(429, f"the prefill worker is overloaded: {details}", retry_after=_retry_after(e))
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(504, "the prefill did not finish in time")
    return ApiError(502, f"prefill failed ({code.name}): {details}")


def _generate_error(e: grpc.aio.AioRpcError, w: Worker) -> ApiError:
    code, details = e.code(), e.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        return ApiError(503, f"the decode worker {w.address} is unavailable: {details}", retry_after=1.0)
    if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
        return ApiError(502, f"the KV handoff was refused by the decode worker ({code.name}): {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(504, f"the decode worker's lease or deadline expired: {details}")
    return ApiError(502, f"generation failed ({code.name}): {details}")

