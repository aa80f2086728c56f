"""Background responses (the Responses API's `background: true`, docs/responses.md): a response that runs in the
gateway while its client is away.

The create request is checked and its prompt rendered as any other (a bad request is still a 400 at once); then the
response is queued and the request answered at once — with the response object, status "queued", or with its event
stream, which the client may leave without cancelling anything. The run itself is the streamed response's
(Gateway.run through ResponsesRenderer): every event it makes is kept here, so `GET /v1/responses/{id}?stream=true&
starting_after=N` replays the events after sequence number N and follows the rest as they come, and a plain GET
answers the response as it stands (queued, in progress with the output items finished so far, or — from the store,
where the run puts it when it ends — completed, incomplete, failed or cancelled). `POST /v1/responses/{id}/cancel`
cancels a running one: its decode slot is released, and the response is stored with status "cancelled" and the
output finished so far.

Bounded: at most `limit` runs at once (more: 429, like a full queue), per gateway; a finished run's events stay for
stream replay only while it is one of the last `limit` to finish (the response itself is in the store, under the
store's limits). Runs are the gateway's: on shutdown they are cancelled with the gateway's other requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable

from .protocol import ApiError

if TYPE_CHECKING:
    from .responses import ResponsesRenderer

log = logging.getLogger("splitgemma.gateway")


class BackgroundRun:
    """One background response: its renderer, its events (SSE frames, the i-th with sequence number i), its task."""

    def __init__(self, owner: str, render: "ResponsesRenderer"):
        self.owner = owner
        self.render = render
        self.frames: list[str] = []
        self.done = False
        self.task: asyncio.Task | None = None
        self._more = asyncio.Event()   # set (and cleared by the readers' next wait) when frames were added

    @property
    def id(self) -> str:
        return self.render.id

    def add(self, frames: list[str]) -> None:
        self.frames += frames
        self._more.set()

    def end(self) -> None:
        self.done = True
        self._more.set()

    def snapshot(self) -> dict:
        """The response as it stands while it runs: queued until its stream starts, then in progress with the output
        items finished so far."""
        r = self.render
        return r.response("in_progress" if r.started else "queued", list(r.output))

    async def follow(self, starting_after: int | None) -> AsyncIterator[str]:
        """The frames after sequence number `starting_after` (all of them for None), then each new one as it comes,
        until the run ends."""
        sent = 0 if starting_after is None else starting_after + 1
        while True:
            while sent < len(self.frames):
                sent += 1
                yield self.frames[sent - 1]
            if self.done:
                return
            self._more.clear()
            if sent < len(self.frames) or self.done:
                continue
            await self._more.wait()


class BackgroundRuns:
    def __init__(self, limit: int):
        self.limit = limit
        self._running: dict[str, BackgroundRun] = {}
        self._finished: OrderedDict[str, BackgroundRun] = OrderedDict()   # the last `limit` to end, for replay

    def __len__(self) -> int:
        return len(self._running)

    def get(self, response_id: str, owner: str) -> BackgroundRun | None:
        run = self._running.get(response_id) or self._finished.get(response_id)
        return run if run is not None and run.owner == owner else None

    def running(self, response_id: str, owner: str) -> BackgroundRun | None:
        run = self._running.get(response_id)
        return run if run is not None and run.owner == owner else None

    def check_room(self) -> None:
        """429 when `limit` responses run already (checked before a request's prompt is rendered)."""
        if len(self._running) >= self.limit:
            raise ApiError(429, f"{self.limit} background responses are running on this gateway, the most it runs "
                           "at once; retry when one has finished", code="rate_limit_exceeded", retry_after=1.0)

    def start(self, owner: str, render: "ResponsesRenderer",
              stream: Callable[[], Awaitable[AsyncIterator[str]]]) -> BackgroundRun:
        """Queues a response: `stream()` admits, prefills and returns the response's event stream, which the run
        reads to its end."""
        run = BackgroundRun(owner, render)
        run.add(render.sse_queued())
        self._running[run.id] = run
        run.task = asyncio.create_task(self._run(run, stream), name=f"background {run.id}")
        # (a callback, not the coroutine's own finally: a task cancelled before its first step never runs it)
        run.task.add_done_callback(lambda _: self._ended(run))
        return run

    async def _run(self, run: BackgroundRun, stream) -> None:
        render = run.render
        try:
            async for frame in await stream():
                run.add([frame])
            if not render.kept:  # the stream failed mid-way (an error event): keep the failed response
                render.finish_as("failed", error=render.error)
        except asyncio.CancelledError:
            pass  # stored as cancelled when it has ended (_ended)
        except ApiError as e:  # refused before its stream began: admission, the context, a worker
            run.add(render.sse_error(e))
            render.finish_as("failed", error=render.error)
        except Exception:  # noqa: BLE001 - a background run has no client to raise to: logged, stored as failed
            log.exception("background response failed", extra={"request_id": run.id})
            e = ApiError(500, f"internal server error (request id {run.id})")
            run.add(render.sse_error(e))
            render.finish_as("failed", error=render.error)

    def _ended(self, run: BackgroundRun) -> None:
        if run.done:
            return
        if not run.render.kept:  # cancelled
            run.render.finish_as("cancelled")
        run.end()
        self._running.pop(run.id, None)
        self._finished[run.id] = run
        while len(self._finished) > self.limit:
            self._finished.popitem(last=False)

    async def cancel(self, run: BackgroundRun) -> None:
        """Cancels a running response and waits until it is stored as cancelled."""
        if run.task is not None and not run.done:
            run.task.cancel()
            await asyncio.gather(run.task, return_exceptions=True)
            self._ended(run)  # now, not when the task's callbacks get their turn

    async def close(self) -> None:
        for run in list(self._running.values()):
            await self.cancel(run)
