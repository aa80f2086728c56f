"""Continuous batching: one thread decodes every running sequence together, one Model.decode per step.

Sequences join (after their handoff is verified) and leave (finished, cancelled) between steps. Each row is
sampled with its own parameters and random state, so a sequence's tokens do not depend on what it was batched
with (the engine's batched decode equals the single one, row by row). Events go to each stream's asyncio queue
through one call_soon_threadsafe per step.

Everything this thread does besides Model.decode (admitting, sampling, stop checks, detokenizing, building events,
handing them over) delays the next step, so it is timed per step (DecodeMetrics.host) and kept small: the rows of a
step are sampled in one native call without the GIL (splitgemma.engine.sample_rows, each row with its own
RowSampler: parameters, logits processing, history, random state; docs/sampling.md), and a greedy row that reports
no logprobs is one argmax over its logits row there.

A constrained row (structured outputs, splitgemma/serving/grammar.py) is sampled among the ids its constraint
admits (its llguidance bitmask, read natively); the masks of a step's constrained rows are computed on a helper
thread while Model.decode runs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from splitgemma.engine import sample_rows
from splitgemma.serving.detokenize import TextStream
from splitgemma.serving.grammar import compute_masks
from splitgemma.serving.worker import token_message
from splitgemma.v1 import serving_pb2 as pb

log = logging.getLogger("splitgemma.decode.batch")


class StreamError(Exception):
    """Handed to a stream instead of an event: the RPC ends with this gRPC status code name and message."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(eq=False)
class Sequence:
    request_id: str
    slot: int
    prompt_tokens: int
    first: object  # splitgemma.engine.Sample: the token the prefill worker drew
    sampler: object  # splitgemma.engine.RowSampler: parameters, history and random state (serving/logits.py)
    max_tokens: int  # 0 = until the context is full
    max_context: int
    stop_ids: frozenset
    text: TextStream | None
    token_name: object  # id -> display string for stop_reason
    queue: asyncio.Queue
    matcher: object = None  # splitgemma.serving.grammar.Matcher of a constrained sequence
    # state, written by the batch thread only (except cancelled, set by the stream handler or Release)
    generated: int = 0
    last_token: int = 0
    position: int = 0
    finish_reason: int = 0
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def done(self) -> bool:
        return self.finish_reason != 0

    def accept(self, s, batch_size: int) -> pb.GenerateEvent:
        """Take the next token (a Sample), decide whether the sequence ends, and build its event."""
        self.generated += 1
        tok = token_message(s)
        ev = pb.GenerateEvent(completion_tokens=self.generated, batch_size=batch_size)
        if self.matcher is not None:
            self.matcher.advance(s.token)
        self.sampler.observe(s.token)
        if s.token in self.stop_ids:
            # The stop token is sent (it was generated and counts) but its own text never is.
            self.finish_reason = pb.FINISH_REASON_STOP
            ev.stop_reason = self.token_name(s.token)
            ev.stop_token_id = s.token
            if self.text is not None:
                tok.text = self.text.flush()
        else:
            if self.text is not None:
                tok.text, matched = self.text.push(s.token)
                if matched is not None:
                    self.finish_reason = pb.FINISH_REASON_STOP
                    ev.stop_reason = matched
            if not self.finish_reason and self.matcher is not None and self.matcher.complete:
                # Nothing but a stop token may follow (or the model's stop token was taken under ignore_eos).
                self.finish_reason = pb.FINISH_REASON_STOP
                ev.stop_reason = "constraint complete"
                if self.text is not None:
                    tok.text += self.text.flush()
            if not self.finish_reason:
                # Feeding this token back would write position prompt_tokens + generated - 1.
                if (self.max_tokens and self.generated >= self.max_tokens) or \
                        self.prompt_tokens + self.generated - 1 >= self.max_context:
                    self.finish_reason = pb.FINISH_REASON_LENGTH
                    if self.text is not None:
                        tok.text += self.text.flush()
        ev.tokens.append(tok)
        ev.finish_reason = self.finish_reason
        if not self.finish_reason:
            self.last_token = s.token
            self.position = self.prompt_tokens + self.generated - 1
        return ev

    def end(self, reason: int) -> pb.GenerateEvent:
        self.finish_reason = reason
        return pb.GenerateEvent(completion_tokens=self.generated, finish_reason=reason)


@dataclass
class BatchStats:
    steps: int = 0
    tokens: int = 0
    max_batch_seen: int = 0
    decode_seconds: float = 0.0  # in Model.decode
    host_seconds: float = 0.0  # the loop's own work in iterations that stepped


class BatchLoop:
    def __init__(self, model, arena, table, loop: asyncio.AbstractEventLoop, metrics):
        self.model = model
        self.arena = arena
        self.table = table
        self.loop = loop
        self.metrics = metrics
        self.stats = BatchStats()
        self._cond = threading.Condition()
        self._pending: list[Sequence] = []
        self._running: list[Sequence] = []
        self._stopping = False
        self._engine_seconds: float | None = None  # Model.decode's time in the current iteration, if it stepped
        self._thread = threading.Thread(target=self._run, name="decode-batch", daemon=True)
        self._masks = ThreadPoolExecutor(1, thread_name_prefix="decode-masks")

    def start(self) -> None:
        self._thread.start()

    def admit(self, seq: Sequence) -> None:
        with self._cond:
            if self._stopping:
                raise StreamError("UNAVAILABLE", "the decode worker is shutting down")
            self._pending.append(seq)
            self._cond.notify()

    def cancel(self, seq: Sequence) -> None:
        seq.cancel()
        with self._cond:
            self._cond.notify()

    def stop(self) -> None:
        """End every stream still running (UNAVAILABLE) and stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()
        self._masks.shutdown()

    # ------------------------------------------------------------------------------------------------------
    # the loop thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._pending or self._running or self._stopping):
                    self._cond.wait()
                if self._stopping:
                    left = self._pending + self._running
                    self._pending, self._running = [], []
                    stopping = True
                else:
                    new, self._pending = self._pending, []
                    stopping = False
            t0 = time.perf_counter()
            self._engine_seconds = None
            out: list[tuple[Sequence, object]] = []
            if stopping:
                for seq in left:
                    seq.finish_reason = pb.FINISH_REASON_ERROR
                    out.append((seq, StreamError("UNAVAILABLE", "the decode worker is shutting down")))
                self._finish(out)
                return
            try:
                for seq in new:
                    self._start(seq, out)
                self._drop_cancelled(out)
                if self._running:
                    self._step(out)
            except Exception as e:
                # Never let this thread die with streams waiting on it: whatever failed outside one row's own
                # work (a decode step) ends the sequences of this iteration with the error; the worker goes on.
                held = list(dict.fromkeys(new + self._running))
                log.exception("decode iteration failed", extra={"request_ids": [q.request_id for q in held]})
                for seq in held:
                    if not seq.done:
                        seq.finish_reason = pb.FINISH_REASON_ERROR
                        out.append((seq, StreamError("INTERNAL", f"decode failed: {e}")))
                self._running = []
            self._finish(out)
            if self._engine_seconds is not None:
                host = time.perf_counter() - t0 - self._engine_seconds
                self.stats.host_seconds += host
                self.metrics.host(host)

    def _start(self, seq: Sequence, out: list) -> None:
        if seq.cancelled:
            out.append((seq, seq.end(pb.FINISH_REASON_CANCELLED)))
            return
        if self._accept_row(seq, seq.first, len(self._running) + 1, out) and not seq.done:
            self._running.append(seq)

    def _drop_cancelled(self, out: list) -> None:
        keep = []
        for seq in self._running:
            if seq.cancelled:
                out.append((seq, seq.end(pb.FINISH_REASON_CANCELLED)))
            else:
                keep.append(seq)
        self._running = keep

    def _step(self, out: list) -> None:
        batch = self._running
        # The constrained rows' masks are computed on llguidance's threads while Model.decode runs (both without
        # the GIL); rows without a constraint never wait for them beyond this step's own decode.
        constrained = [s.matcher for s in batch if s.matcher is not None]
        masks = self._masks.submit(self._compute_masks, constrained) if constrained else None
        t0 = time.perf_counter()
        try:
            logits = self.model.decode(self.arena, [s.slot for s in batch], [s.last_token for s in batch],
                                       [s.position for s in batch])
        except ValueError:
            # A row the engine refuses (e.g. its slot header was overwritten behind our back). The engine checks
            # every row before it writes anything, so run the rows one by one: only the bad ones end.
            batch, logits = self._rows_alone(batch, out)
            if not batch:
                self._running = []
                return
        dt = time.perf_counter() - t0
        if masks is not None:
            masks.result()
        self._engine_seconds = dt
        self.stats.decode_seconds += dt
        n = len(batch)
        self.stats.steps += 1
        self.stats.tokens += n
        self.stats.max_batch_seen = max(self.stats.max_batch_seen, n)
        self.metrics.step(dt, n)
        for seq, s in zip(batch, self._sample(batch, logits)):
            self._accept_row(seq, s, n, out)
        self._running = [s for s in batch if not s.done]

    @staticmethod
    def _sample(batch: list[Sequence], logits) -> list:
        """The rows' tokens (a Sample, or the error message of a row that failed), in one native call."""
        rows = logits if isinstance(logits, np.ndarray) else np.stack(logits)
        return sample_rows(rows, [s.sampler for s in batch],
                           [s.matcher.bits if s.matcher is not None else None for s in batch])

    def _accept_row(self, seq: Sequence, s, batch_size: int, out: list) -> bool:
        """Take the row's token (a Sample, or the error message of its sampling) and queue its event. A row whose
        sampling or detokenizing fails ends alone with the error: in a wide batch, one bad row must not take the
        other streams with it. False when it failed."""
        try:
            if isinstance(s, str):
                raise ValueError(s)
            out.append((seq, seq.accept(s, batch_size=batch_size)))
            return True
        except Exception as e:
            log.exception("a sequence failed in its decode step", extra={"request_id": seq.request_id,
                                                                          "slot": seq.slot})
            seq.finish_reason = pb.FINISH_REASON_ERROR
            out.append((seq, StreamError("INTERNAL", f"decode failed for this sequence: {e}")))
            return False

    def _compute_masks(self, matchers: list) -> None:
        t0 = time.perf_counter()
        compute_masks(matchers)
        self.metrics.mask(time.perf_counter() - t0, len(matchers))

    def _rows_alone(self, batch: list[Sequence], out: list):
        good, rows = [], []
        for seq in batch:
            try:
                rows.append(self.model.decode(self.arena, [seq.slot], [seq.last_token], [seq.position])[0])
                good.append(seq)
            except ValueError as e:
                log.error("decode refused a sequence", extra={"request_id": seq.request_id, "slot": seq.slot,
                                                               "reason": str(e)})
                seq.finish_reason = pb.FINISH_REASON_ERROR
                out.append((seq, StreamError("INTERNAL", f"decode failed for this sequence: {e}")))
        return good, rows

    def _finish(self, out: list) -> None:
        """Free the slots of ended sequences, then hand every event to its stream."""
        if not out:
            return
        for seq, _ in out:
            if seq.done:
                self.table.finish(seq.slot)
        try:
            self.loop.call_soon_threadsafe(_deliver, out)
        except RuntimeError:  # the event loop is closed: the process is exiting
            pass


def _deliver(out: list) -> None:
    for seq, item in out:
        seq.queue.put_nowait(item)
