"""Continuous batching: one thread decodes every running sequence together, one Model.decode per step.

Sequences join (after their handoff is verified) and leave (finished, cancelled) between steps. Each row is
sampled with its own parameters and random state, so a sequence's tokens do not depend on what it was batched
with (the engine's batched decode equals the single one, row by row). Events go to each stream's asyncio queue
through one call_soon_threadsafe per step.

Everything this thread does besides Model.decode (admitting, sampling, stop checks, detokenizing, building events,
handing them over) delays the next step, so it is timed per step (DecodeMetrics.host) and kept small: the rows of a
step are sampled in one native call without the GIL (with prompt-lookup drafts, one more call per draft position),
shared out over the model's threads, which sit idle between steps (splitgemma.engine.sample_rows, each row with its own
RowSampler: parameters, logits processing, history, random state; docs/sampling.md), and a greedy row that reports
no logprobs is one argmax over its logits row there.

A constrained row (structured outputs, splitgemma/serving/grammar.py) is sampled among the ids its constraint
admits (its llguidance bitmask, read natively); the masks of a step's constrained rows are computed on a helper
thread while Model.decode runs, or, with forced tokens on, before the step (a token the constraint forces is taken
without the model, and a run of them is fed as one multi-token run). Prompt-lookup drafts are verified in the same
step (speculation.py, docs/speculation.md); either way every stream gets the tokens plain decoding gives it.
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
from splitgemma.serving.grammar import compute_masks, forced_sample
from splitgemma.serving.worker import token_message
from splitgemma.v1 import serving_pb2 as pb

from .speculation import MAX_DRAFT, LookupState, NgramIndex, SpeculationConfig, StepCosts, choose_drafts

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
    prompt_ids: tuple = ()  # the prompt's ids when the gateway sent them (prompt lookup drafts from them)
    prediction_ids: tuple = ()  # a predicted output's ids (prompt lookup drafts from them first)
    # state, written by the batch thread only (except cancelled, set by the stream handler or Release)
    generated: int = 0
    # Tokens taken but not yet fed to the model, in order (one after a plain step; a forced run after that); the
    # first sits at `position`.
    pending: list = None
    lookup: LookupState | None = None
    finish_reason: int = 0
    cancelled: bool = False

    def __post_init__(self):
        self.pending = []

    @property
    def position(self) -> int:
        """Where pending[0] is fed: the positions before it hold the K/V of the prompt and of every token fed."""
        return self.prompt_tokens + self.generated - len(self.pending)

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
            self.pending.append(s.token)
            if self.lookup is not None:
                self.lookup.index.append(s.token)
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
    forced_tokens: int = 0  # tokens the constraint forced, taken without their logits
    drafted: int = 0  # prompt-lookup draft tokens verified
    accepted: int = 0  # of those, the ones taken


class BatchLoop:
    def __init__(self, model, arena, table, loop: asyncio.AbstractEventLoop, metrics,
                 speculation: SpeculationConfig = SpeculationConfig()):
        self.model = model
        self.spec = speculation
        self.costs = StepCosts()  # Model.decode time by logits rows: what a draft costs here
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
        # Model.decode writes each step's logits here, grown as needed: a fresh [32, V] array each step is past
        # glibc's mmap threshold, so it would be mapped, zero-faulted and unmapped anew every step. Read only until
        # the step's tokens are sampled.
        self._logits: np.ndarray | None = None
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
                # The new streams' first tokens (drawn by the prefill worker) go out now, not behind this
                # iteration's step: that step is a whole decode step of time to first token (~0.1 s at B=32).
                self._finish(out)
                out = []
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
        if self.spec.lookup_k and seq.prompt_ids:
            # A row's token is a function of its logits and of its sampler's state (history and random state: one
            # draw per sampled token), so a draft verified row after row, each row sampled only once the one before
            # was taken, yields plain decoding's tokens, greedy or sampled.
            seq.lookup = LookupState(NgramIndex(seq.prompt_ids, seq.prediction_ids))
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
        if self.spec.forced:
            self._take_forced(out)
            self._running = [s for s in self._running if not s.done]
            if not self._running:
                return
        batch = self._running
        masks = None
        if not self.spec.forced:
            # The constrained rows' masks are computed on llguidance's threads while Model.decode runs (both
            # without the GIL); rows without a constraint never wait for them beyond this step's own decode.
            constrained = [s.matcher for s in batch if s.matcher is not None]
            masks = self._masks.submit(self._compute_masks, constrained) if constrained else None
        drafts = self._drafts(batch)
        t0 = time.perf_counter()
        try:
            logits = self._decode(batch, drafts)
        except ValueError:
            # A row the engine refuses (e.g. its slot header was overwritten behind our back). The engine checks
            # every row before it writes anything, so run the rows one by one: only the bad ones end.
            batch, drafts, logits = self._rows_alone(batch, drafts, out)
            if not batch:
                self._running = []
                return
        dt = time.perf_counter() - t0
        if masks is not None:
            masks.result()
        self._engine_seconds = dt
        self.stats.decode_seconds += dt
        n = len(batch)
        generated = sum(s.generated for s in batch)
        self._verify(batch, drafts, logits, out)
        # A draft's cost is its rows in Model.decode and its verification (the draft rows' sampling).
        self.costs.observe(len(batch) + sum(map(len, drafts)), time.perf_counter() - t0)
        generated = sum(s.generated for s in batch) - generated
        self.stats.steps += 1
        self.stats.tokens += generated
        self.stats.max_batch_seen = max(self.stats.max_batch_seen, n)
        self.metrics.step(dt, n, generated)
        self._running = [s for s in batch if not s.done]

    def _sample(self, batch: list[Sequence], logits, rows=None) -> list:
        """The rows' tokens (a Sample, or the error message of a row that failed), in one native call on the model's
        threads; logits: the [rows, V] array (Model.decode's, or _rows_alone's stack); rows: the row of each
        sequence in it (default: row i for batch[i])."""
        return sample_rows(logits, [s.sampler for s in batch],
                           [s.matcher.bits if s.matcher is not None else None for s in batch], model=self.model,
                           rows=rows)

    def _decode(self, batch: list[Sequence], drafts: list[list[int]]):
        """One Model.decode over every sequence's run: its pending tokens (logits for the last one only), then its
        draft (logits for each). Returns the [rows, V] logits: 1 + len(draft) per sequence, in batch order."""
        slots, toks, pos, want = [], [], [], []
        for seq, draft in zip(batch, drafts):
            run = seq.pending + draft
            slots += [seq.slot] * len(run)
            toks += run
            pos += range(seq.position, seq.position + len(run))
            want += [False] * (len(seq.pending) - 1) + [True] * (1 + len(draft))
        rows = sum(want)
        if self._logits is None or len(self._logits) < rows:
            self._logits = np.empty((rows, self.model.vocab_size), np.float32)
        return self.model.decode(self.arena, slots, toks, pos, logits=want, out=self._logits)

    def _drafts(self, batch: list[Sequence]) -> list[list[int]]:
        """Each sequence's prompt-lookup draft for this step ([] for none)."""
        cfg = self.spec
        if not cfg.lookup_k or 0 < cfg.lookup_max_batch < len(batch):
            return [[] for _ in batch]
        chunk, ctx = self.model.chunk, self.model.max_context
        drafts = []
        for seq in batch:
            room = 0
            if seq.lookup is not None:
                # The run stays within a chunk and the context; a step takes at most len(draft) + 1 tokens, so no
                # draft past max_tokens.
                room = min(chunk - len(seq.pending), ctx - seq.position - len(seq.pending))
                if seq.max_tokens:
                    room = min(room, seq.max_tokens - seq.generated - 1)
            k = min(cfg.lookup_k, room)
            drafts.append(seq.lookup.index.draft(k, min(MAX_DRAFT, room)) if k > 0 else [])
        if cfg.lookup_policy == "adaptive" and any(drafts):
            ks = choose_drafts([s.lookup.p if d else 0.0 for s, d in zip(batch, drafts)], list(map(len, drafts)),
                               self.costs, len(batch))
            drafts = [d[:k] for d, k in zip(drafts, ks)]
        return drafts

    def _verify(self, batch: list[Sequence], drafts: list[list[int]], logits, out: list) -> None:
        """Take each sequence's tokens from its rows (1 + len(draft) of them in logits, in batch order): row j's
        choice is taken; while it equals draft[j] (fed already, so row j + 1 is its true continuation) the sequence
        goes on to row j + 1. The first choice that differs (or the one after a whole draft) becomes its next pending
        token; the K/V of its rejected draft positions is dropped. Row j of every sequence still going is sampled in
        one call: each row has its own sampler, so the call's other rows change nothing in it."""
        n = len(batch)
        first_row, r = [], 0
        for d in drafts:
            first_row.append(r)
            r += 1 + len(d)
        fed_end = [s.position + len(s.pending) + len(d) for s, d in zip(batch, drafts)]
        taken = [0] * n
        for seq in batch:
            seq.pending = []
        going, j = list(range(n)), 0
        samples = self._sample(batch, logits, rows=first_row)
        while going:
            on = []
            for i, s in zip(going, samples):
                seq, draft = batch[i], drafts[i]
                if not self._accept_row(seq, s, n, out) or seq.done:
                    continue
                if j == len(draft) or seq.pending[-1] != draft[j]:
                    continue
                seq.pending.pop()  # fed as draft[j]
                taken[i] += 1
                on.append(i)
            going, j = on, j + 1
            if going:
                # A draft row is sampled only now, after its sampler observed the token before it, with the random
                # state plain decoding has at that position (one draw per sampled row; the rows past the first
                # mismatch are never sampled, so their draws are not spent).
                for i in going:
                    if batch[i].matcher is not None:
                        batch[i].matcher.mask()  # the state after the previous row's token
                samples = self._sample([batch[i] for i in going], logits, rows=[first_row[i] + j for i in going])
        for i, (seq, draft) in enumerate(zip(batch, drafts)):
            if not draft:
                continue
            seq.lookup.drafted += len(draft)
            seq.lookup.accepted += taken[i]
            seq.lookup.rejections += taken[i] < len(draft)
            self.stats.drafted += len(draft)
            self.stats.accepted += taken[i]
            self.metrics.lookup(len(draft), taken[i], self.stats.accepted / self.stats.drafted)
            if not seq.done and seq.position < fed_end[i]:
                self.arena.truncate(seq.slot, seq.position)

    def _take_forced(self, out: list) -> None:
        """Compute the masks of the constrained rows that need one, and take every token a mask forces (then
        the next mask, and so on) before the step: the step feeds the run at once, without those tokens' logits."""
        todo = [s for s in self._running if s.matcher is not None and not s.done]
        chunk = self.model.chunk
        while todo:
            need = [s.matcher for s in todo if not s.matcher.has_mask]
            if need:
                self._compute_masks(need)
            again = []
            for seq in todo:
                tok = seq.matcher.forced()
                if tok is None or len(seq.pending) >= chunk:
                    continue
                self._accept_row(seq, forced_sample(tok, seq.sampler), len(self._running), out)
                self.stats.forced_tokens += 1
                self.stats.tokens += 1
                self.metrics.forced(1)
                if not seq.done:
                    again.append(seq)
            todo = again

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

    def _rows_alone(self, batch: list[Sequence], drafts: list[list[int]], out: list):
        good, kept, rows = [], [], []
        for seq, draft in zip(batch, drafts):
            try:
                rows.extend(self._decode([seq], [draft]))
                good.append(seq)
                kept.append(draft)
            except ValueError as e:
                log.error("decode refused a sequence", extra={"request_id": seq.request_id, "slot": seq.slot,
                                                               "reason": str(e)})
                seq.finish_reason = pb.FINISH_REASON_ERROR
                out.append((seq, StreamError("INTERNAL", f"decode failed for this sequence: {e}")))
        return good, kept, (np.stack(rows) if rows else rows)

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
