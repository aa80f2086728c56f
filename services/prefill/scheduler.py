"""The prefill worker's scheduler: many prompts in flight, one model thread running their chunks interleaved.

A worker has one Model, and a Model runs one call at a time (its scratch is shared), so prompts cannot run in
parallel; but they need not run one after the other either. Each prompt is a PrefillJob that advances one chunk
(Model.chunk positions, `prefill(..., pos0=i)`) per turn; after every turn the policy picks which job goes next:

* ``rr``   round robin by chunk: every job in flight gets one chunk per round, in arrival order;
* ``srf``  shortest remaining first: the job with the fewest positions left (ties: the earliest);
* ``fifo`` the earliest job runs to its end (one prompt at a time, as the worker did before).

A job's chunks keep their order and their boundaries (0, chunk, 2·chunk, … as a solo call makes them), so its
K/V, checksum and first token are bit-identical to a solo run whatever runs in between: rows of one pass never
see another slot. The policies' measured effect on time to first token is in docs/scheduling.md.

Between two turns the scheduler drops every job whose caller went away or whose deadline passed, without running
it again, so a stopped job lets its slot go after at most the chunk in progress; its slot stays unsealed.

A job's steps are where the prefix cache (prefix_cache.py) hooks in: `start` (once, before the first chunk: restore
a cached prefix and move `pos` past it; srf then counts only what is left) and `after_chunk` (after each chunk:
capture the blocks it completed).

A job whose K/V goes over the network (splitgemma/serving/kv_transport.py) runs into a staging slot of the worker's
own (`slot` of that `view`) and hands each chunk's positions, and the restored prefix's blocks, to its `sink` as
soon as they are computed, so the transfer runs while the next chunk computes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from splitgemma.commands.prefill import POLICIES  # the --prefill-policy choices: rr, srf, fifo
from splitgemma.serving.logits import choose
from splitgemma.serving.shm_arena import MappedArena, request_key

log = logging.getLogger("splitgemma.prefill")


class Stopped(Exception):
    """A prompt stopped before its seal: `code` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Result:
    first: object  # splitgemma.engine.Sample
    checksum: int
    cached_tokens: int  # leading positions restored from the prefix cache
    seconds: float  # first chunk to seal
    seal_seconds: float
    queued_seconds: float  # accepted to first chunk
    first_step: int
    last_step: int


class PrefillJob:
    """One prompt run into one leased slot. The caller holds the slot's writer lock when it submits the job; the
    job gives it back (`release`) when it ends, whichever way. Every step but `cancel` runs on the model thread."""

    def __init__(self, model, view: MappedArena, request, tokens: np.ndarray, sampling: dict, seed: int,
                 deadline: float, deadline_reason: str, prefix_cache, release: Callable[[], None],
                 loop: asyncio.AbstractEventLoop, matcher=None, logits=None, slot: int | None = None, sink=None):
        self.model, self.view, self.request, self.tokens = model, view, request, tokens
        self.slot = request.lease.slot if slot is None else slot  # in view.arena: the leased slot, or a staging one
        self.sink = sink  # the network transport's KvSender: .send / .send_range from the model thread
        self.matcher = matcher  # splitgemma.serving.grammar.Matcher of a constrained request: masks the first token
        self.proc = logits  # splitgemma.serving.logits.LogitsProcessor: bias, penalties, min_p, min_tokens
        self.prefix_cache = prefix_cache  # prefix_cache.PrefixCache: restore in start, capture after each chunk
        self.lease = request.lease
        self.sampling, self.seed = sampling, seed
        self.deadline, self.deadline_reason = deadline, deadline_reason  # time.monotonic()
        self.pos = 0  # the next position to run
        self.cached_tokens = 0
        self.logits = None
        self.accepted = time.monotonic()
        self.started: float | None = None
        self.first_step = self.last_step = 0
        self.busy_seconds = 0.0  # model-thread time of this job's chunks
        self._cancelled = threading.Event()
        self._release = release
        self._loop = loop
        self.outcome: asyncio.Future = loop.create_future()  # Result, or the exception that stopped the job

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.pos

    def cancel(self) -> None:
        """The caller went away (any thread): the job stops before its next chunk."""
        self._cancelled.set()

    def stop_reason(self) -> Stopped | None:
        if self._cancelled.is_set():
            return Stopped(grpc.StatusCode.CANCELLED, "the caller cancelled the prefill")
        if time.monotonic() > self.deadline:
            return Stopped(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"{self.deadline_reason} passed before the prefill of slot {self.lease.slot} finished "
                           f"({self.pos} of {len(self.tokens)} positions written); the slot was left unsealed")
        return None

    def start(self, step: int) -> None:
        """Before the first chunk (the caller checked the slot's lease stamp when it took the writer lock, which it
        still holds): restore the prompt's cached prefix into the slot and start after it."""
        parts = [] if self.sink is not None else None
        self.pos = self.cached_tokens = self.prefix_cache.restore(self.view.arena, self.slot, self.tokens, parts)
        pos = 0
        for part in parts or ():
            self.sink.send(pos, part)
            pos += len(part) // self.model.kv_layout["position_bytes"]
        self.started = time.monotonic()
        self.first_step = step

    def run_chunk(self, step: int) -> None:
        n = min(self.model.chunk, self.remaining)
        t0 = time.perf_counter()
        self.logits = self.model.prefill(self.view.arena, self.slot, self.tokens[self.pos:self.pos + n],
                                         pos0=self.pos)
        if self.sink is not None:
            self.sink.send_range(self.view.arena, self.slot, self.pos, self.pos + n)
        self.busy_seconds += time.perf_counter() - t0
        self.after_chunk(self.pos, n, step)

    def after_chunk(self, pos0: int, n: int, step: int) -> None:
        """Positions pos0 … pos0+n-1 are in the slot: keep the blocks they complete while the rings still hold them."""
        self.prefix_cache.capture(self.view.arena, self.slot, self.tokens, pos0, n)
        self.pos = pos0 + n
        self.last_step = step

    def finish(self) -> Result:
        """Seal the slot header and sample the first token from the last chunk's logits."""
        t1 = time.perf_counter()
        self.view.arena.seal(self.slot, request_key(self.request.request_id), self.lease.generation)
        t2 = time.perf_counter()
        if self.matcher is not None:
            self.matcher.mask()
        first = choose(self.logits, allowed=self.matcher.allowed() if self.matcher is not None else None,
                       proc=self.proc, argmax_only=False, rng_state=self.seed, sampling=self.sampling)
        return Result(first, self.view.arena.header(self.slot)["checksum"], self.cached_tokens,
                      time.monotonic() - self.started,
                      t2 - t1, self.started - self.accepted, self.first_step, self.last_step)

    def end(self, outcome: Result | BaseException) -> None:
        """Give the slot's writer lock back, then hand the outcome to the caller's event loop."""
        self._release()
        self._loop.call_soon_threadsafe(self._deliver, outcome)

    def _deliver(self, outcome: Result | BaseException) -> None:
        if self.outcome.done():  # the caller's await was cancelled: nobody waits for the outcome
            return
        if isinstance(outcome, BaseException):
            self.outcome.set_exception(outcome)
        else:
            self.outcome.set_result(outcome)


class Scheduler:
    """The model thread and the jobs in flight on it."""

    def __init__(self, policy: str, on_start: Callable[[PrefillJob], None]):
        """on_start(job) runs on the model thread once the job has passed its start step (for metrics)."""
        if policy not in POLICIES:
            raise ValueError(f"unknown prefill policy {policy!r}: choose one of {', '.join(POLICIES)}")
        self.policy = policy
        self._on_start = on_start
        self.steps = 0  # chunks run since start
        self._jobs: list[PrefillJob] = []  # in arrival order; rr rotates it
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="prefill-model", daemon=True)
        self._thread.start()

    def submit(self, job: PrefillJob) -> None:
        with self._cv:
            if self._closed:
                raise Stopped(grpc.StatusCode.UNAVAILABLE, "the prefill worker is stopping")
            self._jobs.append(job)
            self._cv.notify()

    def close(self) -> None:
        """Stop after the chunk in progress; the jobs still in flight end UNAVAILABLE."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()

    def _pick(self) -> PrefillJob:
        if self.policy == "srf":
            return min(self._jobs, key=lambda j: j.remaining)  # min keeps the first of equals: the earliest
        return self._jobs[0]

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if self._closed:
                    jobs, self._jobs = self._jobs, []
                    for job in jobs:
                        job.end(Stopped(grpc.StatusCode.UNAVAILABLE, "the prefill worker is stopping"))
                    return
                for job in list(self._jobs):
                    stop = job.stop_reason()
                    if stop is not None:
                        self._jobs.remove(job)
                        job.end(stop)
                if not self._jobs:
                    continue
                job = self._pick()
            done = self._turn(job)  # only this thread removes jobs, so `job` is still in the list
            with self._cv:
                if done or self.policy == "rr":
                    self._jobs.remove(job)
                if not done and self.policy == "rr":
                    self._jobs.append(job)  # to the back of the round

    def _turn(self, job: PrefillJob) -> bool:
        """One chunk of `job` (its start first, its seal after the last). True when the job has ended."""
        try:
            if job.started is None:
                job.start(self.steps)
                self._on_start(job)
            job.run_chunk(self.steps)
            self.steps += 1
            if job.remaining:
                return False
            outcome = job.finish()
        except Stopped as e:
            outcome = e
        except Exception as e:  # the engine refused (ValueError, IndexError) or failed: the caller maps it
            log.debug("prefill job failed", exc_info=True, extra={"request_id": job.request.request_id})
            outcome = e
        job.end(outcome)
        return True
