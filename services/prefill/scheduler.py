"""The prefill worker's scheduler: many prompts in flight, one model thread running their chunks interleaved.

A worker has one Model, and a Model runs one call at a time (its scratch is shared), so prompts cannot run in
parallel; but they need not run one after the other either. Each prompt is a PrefillJob that advances one chunk
(Model.chunk positions, `prefill(..., pos0=i)`) per turn; after every turn the policy picks which job goes next:

* ``rr``   round robin by chunk: every job in flight gets one chunk per round, in arrival order;
* ``srf``  shortest remaining first: the job with the fewest positions left (ties: the earliest);
* ``fifo`` the earliest job runs to its end (one prompt at a time, as the worker did before).

Jobs of the lowest priority value in flight go first (PrefillRequest.priority, vLLM's; all 0 unless the gateway runs
--scheduling-policy priority): the policy orders the jobs of that priority, and the others wait.

A job's chunks keep their order and their boundaries (0, chunk, 2·chunk, … as a solo call makes them), so its
K/V, checksum and first token are bit-identical to a solo run whatever runs in between: rows of one pass never
see another slot. The policies' measured effect on time to first token is in docs/scheduling.md.

Between two turns the scheduler drops every job whose caller went away or whose deadline passed, without running
it again, so a stopped job lets its slot go after at most the chunk in progress; its slot stays unsealed.

A job's steps are where the prefix cache (prefix_cache.py) hooks in: `start` (once, before the first chunk: restore
a cached prefix and move `pos` past it; srf then counts only what is left) and `after_chunk` (after each chunk:
capture the blocks it completed).

A job that asks for prompt logprobs (PrefillRequest.prompt_logprobs) runs its prompt whole (a restored prefix would
have no logits) with the logits of every position (Model.prefill all_logits: every row through every layer, the LM
head on every row). Each chunk's [chunk, vocabulary] logits are reduced to its positions' logprobs at once and let
go, so what it holds is one chunk's (E2B at chunk 256: 256 x 262,144 floats, 256 MiB), whatever the prompt's
length. The passes keep the chunk boundaries of a run without logprobs: a weights policy that picks int4 or int8 by
the rows of a pass (auto:M) then writes the same K/V, and the completion is the same.

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
from splitgemma.engine import prompt_logprobs, sample_rows
from splitgemma.serving.shm_arena import MappedArena, request_key
from splitgemma.v1 import serving_pb2 as pb

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
    prompt_logprobs: list  # pb.PromptLogprob of positions 1 … T-1, when asked for


class PrefillJob:
    """One prompt run into one leased slot. The caller holds the slot's writer lock when it submits the job; the
    job gives it back (`release`) when it ends, whichever way. Every step but `cancel` runs on the model thread."""

    def __init__(self, model, view: MappedArena, request, tokens: np.ndarray, sampler,
                 deadline: float, deadline_reason: str, prefix_cache, release: Callable[[], None],
                 loop: asyncio.AbstractEventLoop, matcher=None, slot: int | None = None, sink=None):
        self.model, self.view, self.request, self.tokens = model, view, request, tokens
        self.slot = request.lease.slot if slot is None else slot  # in view.arena: the leased slot, or a staging one
        self.sink = sink  # the network transport's KvSender: .send / .send_range from the model thread
        self.matcher = matcher  # splitgemma.serving.grammar.Matcher of a constrained request: masks the first token
        self.sampler = sampler  # splitgemma.engine.RowSampler (splitgemma.serving.logits.row_sampler), seeded
        self.prefix_cache = prefix_cache  # prefix_cache.PrefixCache: restore in start, capture after each chunk
        self.lease = request.lease
        self.deadline, self.deadline_reason = deadline, deadline_reason  # time.monotonic()
        self.pos = 0  # the next position to run
        self.cached_tokens = 0
        self.logits = None
        # Prompt logprobs: the top n per position (None: not asked for), and the scored passes' arrays.
        self.top_n = request.prompt_logprobs if request.HasField("prompt_logprobs") else None
        self._scored: list[tuple] = []
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
        still holds): restore the prompt's cached prefix into the slot and start after it (not for prompt logprobs,
        which need every position's logits). A network job sends the restored blocks on as they are."""
        if self.top_n is None:
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
        if self.top_n is None:
            self.logits = self.model.prefill(self.view.arena, self.slot, self.tokens[self.pos:self.pos + n],
                                             pos0=self.pos)
        else:
            rows = self.model.prefill(self.view.arena, self.slot, self.tokens[self.pos:self.pos + n],
                                      pos0=self.pos, all_logits=True)
            # Row i predicts position pos + i + 1: the prompt's token there, while there is one.
            k = min(n, len(self.tokens) - 1 - self.pos)
            if k > 0:
                self._scored.append(prompt_logprobs(rows[:k], self.tokens[self.pos + 1:self.pos + 1 + k], self.top_n))
            self.logits = rows[-1]
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
        # The decode worker's call for its rows, on this one row
        first = sample_rows(self.logits[None, :], [self.sampler],
                            [self.matcher.bits if self.matcher is not None else None])[0]
        if isinstance(first, str):
            raise ValueError(f"sampling the first token failed: {first}")
        return Result(first, self.view.arena.header(self.slot)["checksum"], self.cached_tokens,
                      time.monotonic() - self.started,
                      t2 - t1, self.started - self.accepted, self.first_step, self.last_step,
                      self._prompt_logprobs())

    def _prompt_logprobs(self) -> list:
        out, pos = [], 1
        for lp, rank, top_ids, top_lp in self._scored:
            for i in range(len(lp)):
                out.append(pb.PromptLogprob(
                    token_id=int(self.tokens[pos]), logprob=lp[i], rank=rank[i],
                    top_logprobs=[pb.TopLogprob(token_id=t, logprob=v) for t, v in zip(top_ids[i].tolist(),
                                                                                       top_lp[i].tolist())]))
                pos += 1
        return out

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
        first = min(j.request.priority for j in self._jobs)
        jobs = [j for j in self._jobs if j.request.priority == first]
        if self.policy == "srf":
            return min(jobs, key=lambda j: j.remaining)  # min keeps the first of equals: the earliest
        return jobs[0]

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
