"""Plumbing shared by the prefill and decode workers: the model, JSON logs, the Prometheus endpoint, the gRPC
server with health and reflection, shutdown on signals, sampling parameters. (Their command-line options are in
splitgemma/commands/prefill.py, which `splitgemma --help` imports without loading any of this.)"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitgemma.serving import credentials, reflection, telemetry
from splitgemma.serving.grammar import ConstraintError, Grammars, constraint_kind
from splitgemma.serving.log_limit import STANDARD_ATTRS, RepeatFilter
from splitgemma.v1 import serving_pb2 as pb

MAX_TOP_LOGPROBS = 20

log = logging.getLogger("splitgemma.worker")


# ---------------------------------------------------------------------------------------------------------------
# Process setup


def worker_id(kind: str) -> str:
    """Unique per process start, also across containers where every worker is pid 1."""
    return f"{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def open_model(args, max_batch: int):
    from splitgemma.engine import Model
    return Model(args.model, threads=args.threads, max_context=args.max_context, chunk=args.chunk,
                 max_batch=max_batch, weights=args.weights, backend=args.backend, kv_dtype=args.kv_dtype,
                 q8g_input=args.q8g_input)


# ---------------------------------------------------------------------------------------------------------------
# Logs: one JSON object per line on stderr, with the request id and other context as fields.


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str, worker: str):
        super().__init__()
        self.service = service
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "service": self.service, "worker_id": self.worker,
               "logger": record.name, "msg": record.getMessage()}
        for k, v in vars(record).items():
            if k not in STANDARD_ATTRS and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


# The name the native core prints its one-time "GEMM backend …" line under (native/src/kernels/backend.cpp), so that
# the three processes' stderr, interleaved under `up` or compose, say which is which.
SERVICE_ENV = "SPLITGEMMA_SERVICE"


def setup_logging(service: str, worker: str, level: str) -> None:
    """JSON log lines on stderr, each with `service` (splitgemma-gateway, -prefill, -decode: the OTel
    service.name too) and `worker`."""
    os.environ[SERVICE_ENV] = service
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service, worker))
    handler.addFilter(RepeatFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


# ---------------------------------------------------------------------------------------------------------------
# Metrics


def start_metrics(port: int | None, host: str, registry) -> None:
    if port is None:
        return
    from prometheus_client import disable_created_metrics, start_http_server
    disable_created_metrics()  # the *_created series: clutter no dashboard reads
    start_http_server(port, addr=host, registry=registry)
    log.info("metrics endpoint up", extra={"port": port})


# ---------------------------------------------------------------------------------------------------------------
# gRPC server


async def constraint_matcher(grammars: Grammars, sampling: pb.SamplingParams, context):
    """The matcher of the call's constraint (None without one); the call is aborted INVALID_ARGUMENT for a bad one.
    Compiled off the event loop: the first constrained call builds the grammar tokenizer (seconds for 262k ids)."""
    if not constraint_kind(sampling.constraint):
        return None
    try:
        return await asyncio.to_thread(grammars.matcher, sampling.constraint)
    except ConstraintError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.constraint: {e}")


# The largest gRPC message a worker takes (gRPC's default is 4 MiB): a network K/V part may be one whole prefix-cache
# block, one chunk of positions (splitgemma/serving/kv_transport.py; E2B at --chunk 1024: 9.6 MB).
MAX_MESSAGE_BYTES = 64 << 20


class GrpcServer:
    """A grpc.aio server with OTel interceptors, health (grpc.health.v1) and reflection for `services`; with a
    service token, calls without it are refused (health excepted), and with `tls`, the port speaks TLS
    (splitgemma/serving/credentials.py)."""

    def __init__(self, host: str, port: int, services: Sequence[str],
                 add_servicers: Callable[[grpc.aio.Server], None], *, token: str | None = None,
                 tls: credentials.TlsFiles | None = None):
        # The token check first: a refused call costs no span. SO_REUSEPORT is gRPC's default on Linux: a second
        # worker started on a taken port would come up and share it, the kernel spreading calls over both. Off, the
        # bind fails and the worker says so.
        self.server = grpc.aio.server(interceptors=[*credentials.server_interceptors(token),
                                                    *telemetry.grpc_server_interceptors()],
                                      options=[("grpc.so_reuseport", 0),
                                               ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        add_servicers(self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.services = list(services)
        reflection.enable_server_reflection([*self.services, health.SERVICE_NAME], self.server)
        try:
            if tls is not None and tls.enabled:
                self.port = self.server.add_secure_port(f"{host}:{port}", tls.server_credentials())
            else:
                self.port = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:  # grpc reports a failed bind this way (older versions return port 0)
            self.port = 0
        if not self.port:
            raise OSError(f"cannot listen on {host}:{port}: {_bind_error(host, port)}; is another process (a worker "
                          f"already running?) on port {port}? Choose another --port")

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.services):
            await self.health.set(name, status)


def _bind_error(host: str, port: int) -> str:
    """Why host:port cannot be bound, in the OS's words (gRPC's error says only that the bind failed)."""
    try:
        addresses = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"cannot resolve {host!r} ({e.strerror})"
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: TIME_WAIT is no conflict
            try:
                probe.bind(address)
            except OSError as e:
                return e.strerror.lower()
    return "gRPC could not bind it"


def on_signals(loop: asyncio.AbstractEventLoop, callback: Callable[[str], None]) -> None:
    """Call callback(signal name) on SIGTERM and SIGINT (a second signal while stopping is the same call)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, callback, sig.name)


async def serve_until_signalled(server: GrpcServer, busy: Callable[[], int], drain_seconds: float,
                                start_draining: Callable[[], None],
                                before_stop: Callable[[], None] | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then drain: stop admitting (start_draining(), health NOT_SERVING), let the work
    counted by busy() finish for up to drain_seconds (a second signal cuts the wait short), run before_stop, and stop
    the gRPC server."""
    stop = asyncio.Event()
    signals: list[str] = []

    def on_signal(name: str) -> None:
        signals.append(name)
        stop.set()

    on_signals(asyncio.get_running_loop(), on_signal)
    await stop.wait()
    log.info("draining", extra={"signal": signals[0], "busy": busy()})
    start_draining()
    await server.set_serving(False)
    deadline = time.monotonic() + drain_seconds
    while busy() and time.monotonic() < deadline and len(signals) < 2:
        await asyncio.sleep(0.02)
    if before_stop is not None:
        before_stop()
    await server.server.stop(grace=1.0)


# ---------------------------------------------------------------------------------------------------------------
# Sampling parameters (proto SamplingParams → splitgemma.engine.sample keywords)


class InvalidRequest(ValueError):
    """A request field is out of range: the message names it; the RPC answers INVALID_ARGUMENT."""


def sampling_kwargs(p) -> dict:
    """The sample() keywords for a proto SamplingParams (the rng state is the caller's)."""
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise InvalidRequest(f"sampling.temperature must be a finite number >= 0, got {p.temperature}")
    if p.top_k < 0:
        raise InvalidRequest(f"sampling.top_k must be >= 0, got {p.top_k}")
    if not math.isfinite(p.top_p) or not 0 <= p.top_p <= 1:
        raise InvalidRequest(f"sampling.top_p must be in [0, 1] (0 = no cut), got {p.top_p}")
    if not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"sampling.top_logprobs must be 0..{MAX_TOP_LOGPROBS}, got {p.top_logprobs}")
    return {"temperature": float(p.temperature), "top_k": int(p.top_k),
            "top_p": float(p.top_p) if p.top_p > 0 else 1.0, "n_logprobs": int(p.top_logprobs)}


def token_message(s) -> pb.Token:
    """A splitgemma.engine.Sample as a proto Token (its text is the decode worker's to fill)."""
    return pb.Token(token_id=s.token, logprob=s.logprob,
                    top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in s.top_logprobs])


def gen_ai_request_attributes(model: str, request, max_tokens: int | None = None) -> dict:
    """gen_ai.* attributes of a worker span for one request (a PrefillRequest or GenerateRequest): the response id
    and operation the gateway's span has, so that one id finds the request's spans in every process."""
    p = request.sampling
    attrs = {"gen_ai.operation.name": request.operation or "text_completion",
             "gen_ai.provider.name": telemetry.PROVIDER_NAME, "gen_ai.request.model": model,
             "gen_ai.response.id": request.response_id or request.request_id,
             "splitgemma.request_id": request.request_id,
             "gen_ai.request.temperature": p.temperature, "gen_ai.request.top_k": p.top_k,
             "gen_ai.request.top_p": p.top_p if p.top_p > 0 else 1.0}
    if p.HasField("seed"):
        attrs["gen_ai.request.seed"] = telemetry.seed_attribute(p.seed)
    if max_tokens:
        attrs["gen_ai.request.max_tokens"] = max_tokens
    return attrs
