"""A request's CPU work off the event loop: parsing a large body, rendering the chat template, tokenizing.

Two lanes of `threads` threads each. The light lane takes what is cheap by its size (a body of at most LIGHT_BYTES,
a chat of at most LIGHT_MESSAGES messages: milliseconds); the heavy lane the rest, and it admits at most
`threads + queue` jobs: one more is answered 503 at once. So a flood of expensive prompts is refused instead of
queued without bound, and it never waits in front of ordinary requests, which have their own lane. (The light lane's
own bound, LIGHT_QUEUE, only caps memory: its jobs are small by construction.)

A job whose caller is cancelled (the client went away) before it starts never runs; one already running is told
through the threading.Event it is given, which the chat template checks between pieces of its output. Tokenizing a
prompt cannot be interrupted; its size is bounded instead (ChatLimits.max_rendered_chars).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from splitgemma.serving.chat_template import RenderCancelled

from .protocol import ApiError

T = TypeVar("T")

LIGHT_BYTES = 64 << 10
LIGHT_MESSAGES = 64
LIGHT_QUEUE = 256


class _Lane:
    def __init__(self, name: str, threads: int, capacity: int, gauge):
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix=f"prompt-{name}")
        self.capacity = capacity
        self.gauge = gauge
        self._lock = threading.Lock()
        self._jobs = 0          # admitted and not finished (waiting or running)

    def admit(self) -> bool:
        with self._lock:
            if self._jobs >= self.capacity:
                return False
            self._jobs += 1
        self.gauge.inc()
        return True

    def finished(self, _future=None) -> None:
        with self._lock:
            self._jobs -= 1
        self.gauge.dec()


class Offload:
    def __init__(self, metrics, threads: int = 2, queue: int = 4):
        self.metrics = metrics
        self.light = _Lane("light", threads, LIGHT_QUEUE, metrics.prompt_jobs.labels(lane="light"))
        self.heavy = _Lane("heavy", threads, threads + queue, metrics.prompt_jobs.labels(lane="heavy"))

    @staticmethod
    def is_light(body_bytes: int, messages: int = 0) -> bool:
        return body_bytes <= LIGHT_BYTES and messages <= LIGHT_MESSAGES

    async def run(self, light: bool, fn: Callable[[threading.Event], T]) -> T:
        """fn(cancelled) in a thread of the light or the heavy lane; 503 when the heavy lane is full."""
        lane = self.light if light else self.heavy
        if not lane.admit():
            self.metrics.rejections.labels(reason="prompt_lane_full").inc()
            raise ApiError(503, "the gateway is busy with other large prompts; retry later", retry_after=1.0,
                           code="overloaded")
        cancelled = threading.Event()

        def job():
            try:
                if cancelled.is_set():
                    raise RenderCancelled
                return fn(cancelled)
            except RenderCancelled:
                self.metrics.prompt_jobs_abandoned.inc()
                raise

        try:
            future = lane.executor.submit(job)
        except BaseException:
            lane.finished()
            raise
        # Counted until the thread is done with it, not until its caller stops waiting.
        future.add_done_callback(lane.finished)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            cancelled.set()
            if future.cancel():  # it had not started
                self.metrics.prompt_jobs_abandoned.inc()
            raise

    def close(self) -> None:
        for lane in (self.light, self.heavy):
            lane.executor.shutdown(wait=False, cancel_futures=True)
