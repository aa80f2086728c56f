"""Admission: the decode worker's queue of Reserve calls waiting for a KV slot (docs/scheduling.md, "Admission").

The queue lives here, in the worker that owns the slots, rather than in a gateway: several gateways in front of one
decode worker then share one order of arrival, and a slot that frees is handed on the spot, without a round trip.

* First come, first served within a priority. A Reserve that finds no free slot, or finds others already waiting,
  joins the queue behind every waiter of its priority or a lower value (lower is first: vLLM's priority; all 0
  unless the gateway runs --scheduling-policy priority); a slot that frees goes to the head. A newcomer takes a
  free slot at once only when no one is waiting, so it never jumps the queue (a slot may be free for an instant
  while its hand-over to the head is still on its way here); one of a lower priority value than every waiter goes
  to the head, and is served as the head is.
* A group (ReserveGroup: the choices of one request, n > 1 or several prompts) is granted all its slots at once or
  waits, at its place in the queue, until as many are free. Granting them one by one would let two groups each
  hold part of what they need and wait for the rest until both time out; and a group's first lease would have to
  outlive the queue waits of the others. The head of the queue is served strictly: a single Reserve behind a
  waiting group waits too, so a group is never starved by the singles that keep arriving.
* Bounded: with `max_queue` callers waiting, the next one is refused at once (QueueFull), unless it outranks the
  last waiter, which is then refused in its place; a caller that waited `timeout_s` is refused then
  (QueueTimeout). Both carry a retry-after computed from what is draining: how often a
  slot has freed lately (DrainEstimate) times how many callers would be served first.
* A caller that goes away (its call is cancelled) leaves the queue at once; the callers behind it move up.
* Draining: every waiter is refused (Draining) and no one else is queued.

The SlotTable (services/decode/slots.py) stays the only owner of slot state: this queue asks it for a slot
(SlotTable.reserve) and is told by it when one frees (on_free, from any thread: the batch thread frees finished
sequences' slots), and hops onto the event loop, where all of the queue's state lives.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .slots import Slot, SlotTable

# The drain estimate (DrainEstimate): the weight of the newest interval between two frees in their moving mean, and
# the longest interval that counts (a longer one is a lull with nobody to serve, not a measure of the drain).
INTERVAL_WEIGHT = 0.25
IDLE_GAP_S = 60.0
# Retry-After has whole seconds, so a hint under 1 s could only be rounded up to 1 by the gateway anyway.
RETRY_MIN_S, RETRY_MAX_S = 1.0, 3600.0
_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)


class Refused(Exception):
    """A Reserve the queue will not serve; `retry_after` in seconds."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class QueueFull(Refused):
    pass


class QueueTimeout(Refused):
    pass


class Draining(Exception):
    pass


class DrainEstimate:
    """How often a slot frees: an exponentially weighted mean of the intervals between consecutive frees (the newest
    weighs INTERVAL_WEIGHT), so a few fast frees are enough to say that slots free fast, however slow the worker was
    a minute ago. An interval longer than IDLE_GAP_S spans a lull, not a drain, and does not count. The interval
    still open counts once it is longer than the mean, so a worker that stopped draining gives longer hints as time
    goes on. Nothing measured (fewer than two frees close together): no estimate."""

    def __init__(self):
        self._last: float | None = None
        self._mean: float | None = None

    def note(self, now: float) -> None:
        if self._last is not None and now - self._last <= IDLE_GAP_S:
            gap = now - self._last
            self._mean = gap if self._mean is None else INTERVAL_WEIGHT * gap + (1 - INTERVAL_WEIGHT) * self._mean
        self._last = now

    def interval(self, now: float) -> float | None:
        """Seconds between two frees, as observed; None before any interval was measured."""
        if self._mean is None:
            return None
        return max(self._mean, now - self._last)

    def per_second(self, now: float) -> float:
        interval = self.interval(now)
        return 0.0 if interval is None else 1 / max(interval, 1e-3)

    def retry_after(self, position: int, now: float, unmeasured: float) -> float:
        """Seconds until `position` more slots have freed at the observed pace (`unmeasured` without an estimate),
        within RETRY_MIN_S … RETRY_MAX_S."""
        interval = self.interval(now)
        guess = unmeasured if interval is None else position * interval
        return min(max(guess, RETRY_MIN_S), RETRY_MAX_S)


@dataclass(eq=False)
class _Waiter:
    members: list[tuple[str, int]]  # (request_id, max_tokens) of each slot wanted
    lease_s: float
    future: asyncio.Future
    since: float  # monotonic
    priority: int = 0
    timer: asyncio.TimerHandle | None = None


class Admission:
    def __init__(self, table: SlotTable, loop: asyncio.AbstractEventLoop, registry: CollectorRegistry, *,
                 max_queue: int, timeout_s: float):
        self.table = table
        self.loop = loop
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        self.rate = DrainEstimate()
        self.draining = False
        self._queue: deque[_Waiter] = deque()
        self.queued_total = self.refused_full = self.refused_timeout = self.cancelled = 0
        Gauge("splitgemma_decode_queue_depth", "Reserve calls waiting for a KV slot",
              registry=registry).set_function(lambda: len(self._queue))
        self._wait = Histogram("splitgemma_decode_queue_wait_seconds",
                               "how long a Reserve waited in the queue, by outcome (granted, timeout, cancelled, "
                               "draining, displaced by a higher priority); Reserves served at once are not counted",
                               ["outcome"],
                               buckets=_WAIT_BUCKETS, registry=registry)
        self._refused = Counter("splitgemma_decode_reserve_refused", "Reserve calls refused by the queue",
                                ["reason"], registry=registry)
        # Every series exists from the start (at 0), so a rate over it is defined before the first event.
        for outcome in ("granted", "timeout", "cancelled", "draining", "displaced"):
            self._wait.labels(outcome=outcome)
        for reason in ("queue_full", "timeout"):
            self._refused.labels(reason=reason)

    @property
    def depth(self) -> int:
        return len(self._queue)

    def slot_freed(self) -> None:
        """SlotTable's on_free: any thread, with the table's lock held, so only schedule."""
        self.loop.call_soon_threadsafe(self._on_free)

    async def reserve(self, members: list[tuple[str, int]], lease_s: float,
                      priority: int = 0) -> tuple[list[Slot], float]:
        """A slot for each (request_id, max_tokens) member, all at once (copies of their leases), and the seconds
        waited for them, queued by `priority` (lower first). The caller checks that the table has that many slots.
        Raises QueueFull, QueueTimeout, Draining; cancelling the caller's task takes it out of the queue (or gives
        back slots granted at that instant)."""
        if not 0 < len(members) <= self.table.n_slots:
            raise ValueError(f"{len(members)} slots wanted of a table of {self.table.n_slots}")
        if self.draining:
            raise Draining()
        if not self._queue:
            slots = self.table.reserve(members, lease_s, time.time())
            if slots is not None:
                return slots, 0.0
        if len(self._queue) >= self.max_queue and self._queue and self._queue[-1].priority > priority:
            # A full queue takes a caller that outranks its last waiter: that one is refused in its place, as it
            # would have been had it come now.
            self._displace(self._queue.pop())
        elif len(self._queue) >= self.max_queue:
            self.refused_full += 1
            self._refused.labels(reason="queue_full").inc()
            ahead = len(self._queue)
            # Nothing measured yet (fewer than two frees close together since the start): come back soon; the refusal
            # is cheap and the next one carries a measured hint. (Guessing the queue timeout sent clients away for that long while
            # slots freed in a fraction of a second.)
            raise QueueFull(f"no free KV slot and the queue is full ({ahead} waiting, --max-queue "
                            f"{self.max_queue})", self.rate.retry_after(ahead + 1, time.monotonic(), RETRY_MIN_S))
        w = _Waiter(members, lease_s, self.loop.create_future(), time.monotonic(), priority)
        w.timer = self.loop.call_later(self.timeout_s, self._time_out, w)
        # Behind every waiter of the same or a lower priority value: the queue stays sorted, arrival order within.
        at = next((i for i, other in enumerate(self._queue) if other.priority > priority), len(self._queue))
        self._queue.insert(at, w)
        self.queued_total += 1
        self._grant()  # a slot may have freed with its notice still on its way here
        try:
            slots = await w.future
        except asyncio.CancelledError:
            if w.future.done() and not w.future.cancelled() and w.future.exception() is None:
                # Granted in the same instant the caller went away: the slots go back (and on to the next).
                for s in w.future.result():
                    self.table.release(s.index, s.generation, s.request_id, s.secret)
            elif w in self._queue:
                self._queue.remove(w)
                w.timer.cancel()
            self.cancelled += 1
            self._wait.labels(outcome="cancelled").observe(time.monotonic() - w.since)
            raise
        except QueueTimeout:
            self._wait.labels(outcome="timeout").observe(time.monotonic() - w.since)
            raise
        except QueueFull:
            self._wait.labels(outcome="displaced").observe(time.monotonic() - w.since)
            raise
        except Draining:
            self._wait.labels(outcome="draining").observe(time.monotonic() - w.since)
            raise
        waited = time.monotonic() - w.since
        self._wait.labels(outcome="granted").observe(waited)
        return slots, waited

    def drain(self) -> None:
        """Stop queueing: every waiter is answered Draining."""
        self.draining = True
        while self._queue:
            w = self._queue.popleft()
            w.timer.cancel()
            if not w.future.done():
                w.future.set_exception(Draining())

    # -- on the event loop ---------------------------------------------------------------------------------------

    def _on_free(self) -> None:
        self.rate.note(time.monotonic())
        self._grant()

    def _grant(self) -> None:
        """Free slots to the head of the queue, in order, as long as the head's wants are free."""
        while self._queue:
            w = self._queue[0]
            if w.future.done():
                # Its caller was cancelled in this same instant and has yet to take itself out: skip it.
                self._queue.popleft()
                w.timer.cancel()
                continue
            slots = self.table.reserve(w.members, w.lease_s, time.time())
            if slots is None:
                return
            self._queue.popleft()
            w.timer.cancel()
            w.future.set_result(slots)

    def _displace(self, w: _Waiter) -> None:
        w.timer.cancel()
        self.refused_full += 1
        self._refused.labels(reason="queue_full").inc()
        if not w.future.done():
            w.future.set_exception(QueueFull(
                f"no free KV slot and the queue is full ({len(self._queue) + 1} waiting, --max-queue "
                f"{self.max_queue}): a request of a higher priority took this one's place",
                self.rate.retry_after(len(self._queue) + 1, time.monotonic(), RETRY_MIN_S)))

    def _time_out(self, w: _Waiter) -> None:
        if w.future.done():  # cancelled in this same instant: its caller takes it out
            return
        position = self._queue.index(w) + 1
        self._queue.remove(w)
        self.refused_timeout += 1
        self._refused.labels(reason="timeout").inc()
        w.future.set_exception(QueueTimeout(
            f"no KV slot freed for this request within the queue timeout of {self.timeout_s:g} s (it was "
            f"number {position} in the queue)",
            # Nothing measured: the whole queue timeout brought no slot, so at least that long.
            self.rate.retry_after(position, time.monotonic(), self.timeout_s)))
