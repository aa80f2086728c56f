"""What one HTTP client may cost the gateway: connections, time to send a request, size of a chat.

uvicorn has a keep-alive timeout (`timeout_keep_alive`), a cap on the size of an incomplete request head
(`h11_max_incomplete_event_size`) and `limit_concurrency`, but no deadline for a request's head and no cap that acts
before a request is read: a client that opens connections and sends half a request line holds a file descriptor
each for ever, and `limit_concurrency` answers only once a complete head has arrived. `GuardedH11Protocol` (uvicorn's
h11 protocol with two additions, given to uvicorn as its `http` class) supplies both:

- a head deadline: a request's head (request line and headers) must be complete `header_timeout` s after the
  connection opened, or after the first byte of a request on a kept-alive connection; otherwise 408 and close;
- a connection cap: past `max_connections` open connections, the connection that has been waiting longest for a
  request head (a half-sent request, or an idle kept-alive one) is closed to make room, so a crowd of slow or
  idle clients cannot lock out a new one (the newcomer is /health too); only when every connection has a request
  in progress is the newcomer answered 503 at once, before reading anything.

RequestLimits are the application's: the body has its own deadline (`read_body`, as the request handler reads it),
`body_timeout` s from the end of the head, else 408; a chat has a bounded number of messages (`check_messages`),
and its rendered size is bounded while it renders (splitgemma.serving.chat_template.RenderBudget).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import anyio
import h11
from starlette.requests import ClientDisconnect, Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from .protocol import ApiError, invalid

log = logging.getLogger("splitgemma.gateway")

# File descriptors the gateway needs besides its HTTP connections (worker channels, logs, the listening socket).
FD_RESERVE = 256
# The listen backlog (uvicorn's default). asyncio accepts up to this many connections in one go before their
# protocols run, so for a moment that many more than max_connections can be open: the file limit allows for it.
BACKLOG = 2048


@dataclass(frozen=True)
class HttpLimits:
    max_connections: int = 1000
    header_timeout: float = 10.0      # s for a request's head
    keep_alive_timeout: float = 5.0   # s an idle kept-alive connection stays open (uvicorn's timeout_keep_alive)
    max_header_bytes: int = 16384     # largest incomplete request head (h11's default)


@dataclass(frozen=True)
class RequestLimits:
    """The limits the application enforces on each request."""

    body_timeout: float = 60.0        # s for a request's body, from the end of its head
    max_messages: int = 1024
    max_rendered_chars: int = 1_000_000


def _canned(status: int, reason: str, message: str, code: str, extra: str = "") -> bytes:
    body = json.dumps({"error": {"message": message, "type": ApiError.TYPES.get(status, "server_error"),
                                 "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra}connection: close\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head and a cap on open connections (module
    docstring). `limits` is set on the subclass guarded_protocol() makes."""

    limits: HttpLimits = HttpLimits()
    # Connections waiting for a request head, oldest first (dicts keep insertion order); shared by the server's
    # connections, all of which run on its one event loop.
    _waiting: dict["GuardedH11Protocol", None]

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.limits.max_connections:
            oldest = next(iter(self._waiting), None)
            if oldest is None:
                log.warning("connection refused: every connection has a request in progress",
                            extra={"max_connections": self.limits.max_connections})
                transport.write(_canned(503, "Service Unavailable", "the server has too many connections open; "
                                        "retry later", "too_many_connections", "retry-after: 1\r\n"))
                transport.close()
                return
            log.info("closed the connection waiting longest for a request head to make room",
                     extra={"max_connections": self.limits.max_connections})
            oldest._close_waiting()
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE:
            # (The first bytes of) a request head: on a kept-alive connection its deadline starts now.
            self._await_head()
        else:
            self._head_done()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            # Kept alive: uvicorn's keep-alive timer runs until the next request's first byte, then ours.
            self._waiting[self] = None

    def connection_lost(self, exc) -> None:
        self._head_done()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        self._waiting[self] = None
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)

    def _head_done(self) -> None:
        self._waiting.pop(self, None)
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.info("request head not received in time; connection closed",
                     extra={"header_timeout": self.limits.header_timeout})
            self.transport.write(_canned(408, "Request Timeout", f"the request head did not arrive within "
                                         f"{self.limits.header_timeout:g} s", "request_timeout"))
            self._close_waiting()

    def _close_waiting(self) -> None:
        self._head_done()
        self.transport.close()


def guarded_protocol(limits: HttpLimits) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn.Config(http=…), with these limits."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits, "_waiting": {}})


def uvicorn_settings(limits: HttpLimits) -> dict:
    """uvicorn.Config keywords for the limits uvicorn has itself, and the guarded protocol for the others."""
    return {"http": guarded_protocol(limits), "backlog": BACKLOG, "timeout_keep_alive": limits.keep_alive_timeout,
            "h11_max_incomplete_event_size": limits.max_header_bytes}


def ensure_fd_limit(limits: HttpLimits) -> None:
    """Raise this process's soft file-descriptor limit so that max_connections fit beside BACKLOG and FD_RESERVE;
    ValueError when the hard limit does not allow it."""
    need = limits.max_connections + BACKLOG + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        except (ValueError, OSError):  # above the hard limit (or the kernel's nr_open)
            raise ValueError(f"--max-connections {limits.max_connections} needs {need} file descriptors; this "
                             f"process may open at most {hard} (ulimit -Hn)") from None


async def read_body(request: Request, max_bytes: int, timeout: float) -> bytes:
    """The request body: 413 past max_bytes, 408 (and the connection closed) if it has not all arrived `timeout` s
    after the head."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise ApiError(413, f"the request body is {int(length)} bytes; the limit is {max_bytes}",
                       code="request_too_large")
    body = bytearray()
    try:
        with anyio.fail_after(timeout):
            async for chunk in request.stream():
                body += chunk
                if len(body) > max_bytes:
                    raise ApiError(413, f"the request body is larger than the limit of {max_bytes} bytes",
                                   code="request_too_large")
    except TimeoutError:
        raise _BodyTimeout(timeout) from None
    except ClientDisconnect:
        raise ClientGoneError from None
    return bytes(body)


async def stream_body(request: Request, max_bytes: int, idle_timeout: float,
                      too_large: Callable[[], str] | None = None) -> AsyncIterator[bytes]:
    """The request body as it arrives, for one too large to hold (an upload): 413 past max_bytes (`too_large()` its
    message), 408 when no part of it arrives for `idle_timeout` s (a long upload may take as long as it keeps
    coming)."""
    def refuse():
        return ApiError(413, too_large() if too_large else f"the request body is larger than the limit of "
                        f"{max_bytes} bytes", code="request_too_large")

    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise refuse()
    seen = 0
    chunks = request.stream().__aiter__()
    while True:
        try:
            with anyio.fail_after(idle_timeout):
                chunk = await chunks.__anext__()
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise _BodyTimeout(idle_timeout) from None
        except ClientDisconnect:
            raise ClientGoneError from None
        seen += len(chunk)
        if seen > max_bytes:
            raise refuse()
        yield chunk


class _BodyTimeout(ApiError):
    def __init__(self, timeout: float):
        super().__init__(408, f"the request body did not arrive within {timeout:g} s", code="request_timeout")

    def headers(self) -> dict[str, str]:
        # The rest of the body may still come: the connection cannot carry another request.
        return {**super().headers(), "Connection": "close"}


class ClientGoneError(Exception):
    """The client closed the connection before its request body was complete (nobody to answer)."""


def check_messages(messages: list, limits: RequestLimits, param: str = "messages") -> None:
    if len(messages) > limits.max_messages:
        raise invalid(f"Invalid '{param}': array too long. Expected an array with maximum length "
                      f"{limits.max_messages}, but got an array with length {len(messages)} instead.",
                      param=param, code="array_above_max_length")
