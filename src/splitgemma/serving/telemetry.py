r"""OpenTelemetry for the three services: one call at process start, gRPC interceptors, gen_ai spans and metrics.

Usage (every service)::

    from splitgemma.serving import telemetry
    tel = telemetry.setup_telemetry("splitgemma-decode")      # reads the OTEL_* variables, once per process
    server = grpc.aio.server(interceptors=telemetry.grpc_server_interceptors())
    channel = grpc.aio.insecure_channel(addr, interceptors=telemetry.grpc_client_interceptors())
    with telemetry.gen_ai_span(tel.tracer, "chat", "gemma-4-e2b-it", max_tokens=64) as span:
        ...
        telemetry.set_gen_ai_response(span, response_id=..., finish_reasons=["stop"], input_tokens=..., output_tokens=...)
    tel.shutdown()                                             # flush the exporters before exit

Configuration: the standard variables, nothing splitgemma-specific.

| variable | values | default |
|---|---|---|
| OTEL_SDK_DISABLED | true | false |
| OTEL_SERVICE_NAME (and OTEL_RESOURCE_ATTRIBUTES) | | the name given to setup_telemetry |
| OTEL_TRACES_EXPORTER, OTEL_METRICS_EXPORTER | comma list of otlp, console, none | otlp if an OTLP endpoint variable is set, else none |
| OTEL_EXPORTER_OTLP_[TRACES_\|METRICS_]PROTOCOL | grpc, http/protobuf | grpc (as the Python SDK's own auto-configuration) |
| OTEL_EXPORTER_OTLP_[TRACES_\|METRICS_]ENDPOINT | URL | read by the exporters themselves |
| OTEL_PROPAGATORS | tracecontext, baggage, … | tracecontext,baggage (read by opentelemetry.propagate) |
| OTEL_BSP_*, OTEL_METRIC_EXPORT_INTERVAL | | the SDK's |

Why "none" by default: a service started with no telemetry configured must not try to reach a collector on
localhost:4317 and log export errors forever. With traces off no SDK tracer provider is installed, so spans are
non-recording, but the W3C context still flows through (the server interceptor re-uses the caller's span
context), so a process with tracing off does not break the trace of the processes around it.

gRPC: the interceptors are the ones of opentelemetry-instrumentation-grpc for grpc.aio. The client interceptor
injects traceparent/tracestate/baggage into the call metadata; the server interceptor extracts them and runs the
handler under a SERVER span that is a child of the caller's CLIENT span. For server-streaming RPCs (Decode.Generate)
the whole stream, including spans the handler opens between yields, stays in that one trace (contrib #257 was that
bug; tests/test_telemetry.py checks it).

gen_ai spans and metrics follow the GenAI semantic conventions (status Development): span name
"{operation} {model}", gen_ai.provider.name "splitgemma", gen_ai.request.* / gen_ai.response.* / gen_ai.usage.*;
histograms gen_ai.server.time_to_first_token, gen_ai.server.time_per_output_token and
gen_ai.server.request.duration with the buckets the conventions recommend.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from opentelemetry import metrics, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

PROVIDER_NAME = "splitgemma"

# Bucket boundaries from the GenAI metric conventions (gen-ai-metrics.md).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)

_EXPORTER_NAMES = ("otlp", "console", "none")
_OTLP_PROTOCOLS = ("grpc", "http/protobuf")


class TelemetryConfigError(ValueError):
    """An OTEL_* variable has a value this process cannot honour (named in the message)."""


@dataclass
class Telemetry:
    """What setup_telemetry configured. tracer/meter are usable whether or not anything is exported."""

    service_name: str
    traces_exporters: tuple[str, ...]
    metrics_exporters: tuple[str, ...]
    tracer: trace.Tracer
    meter: metrics.Meter
    _tracer_provider: object = None
    _meter_provider: object = None
    _shut: bool = field(default=False, repr=False)

    def shutdown(self, timeout_s: float = 5.0) -> bool:
        """Flush and stop the exporters (idempotent), waiting at most timeout_s. Call it before the process exits.

        An unreachable collector makes the SDK retry each export for up to OTEL_EXPORTER_OTLP_TIMEOUT (10 s by
        default) per signal, so the flush runs on a daemon thread and a stopping service gives up on it after
        timeout_s instead of hanging its shutdown. Returns False when it gave up."""
        if self._shut:
            return True
        self._shut = True
        providers = [p for p in (self._tracer_provider, self._meter_provider) if p is not None]
        if not providers:
            return True
        worker = threading.Thread(target=lambda: [p.shutdown() for p in providers], name="otel-shutdown",
                                  daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            logging.getLogger("splitgemma.telemetry").warning(
                "telemetry not flushed: the exporters did not finish in time", extra={"timeout_s": timeout_s})
            return False
        return True


_configured: Telemetry | None = None


def _exporters(env: str) -> tuple[str, ...]:
    raw = os.environ.get(env)
    if raw is None or not raw.strip():
        endpoint_set = any(os.environ.get(v) for v in (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" if "TRACES" in env else "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"))
        return ("otlp",) if endpoint_set else ()
    names = tuple(dict.fromkeys(n.strip().lower() for n in raw.split(",") if n.strip()))
    for n in names:
        if n not in _EXPORTER_NAMES:
            raise TelemetryConfigError(f"{env}={raw!r}: unsupported exporter {n!r} (use {', '.join(_EXPORTER_NAMES)})")
    if "none" in names:
        if len(names) > 1:
            raise TelemetryConfigError(f"{env}={raw!r}: 'none' cannot be combined with other exporters")
        return ()
    return names


def _otlp_protocol(signal: str) -> str:
    for var in (f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = os.environ.get(var, "").strip()
        if value:
            if value not in _OTLP_PROTOCOLS:
                raise TelemetryConfigError(f"{var}={value!r}: unsupported protocol (use {' or '.join(_OTLP_PROTOCOLS)})")
            return value
    return "grpc"


def _span_exporter(name: str):
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        return ConsoleSpanExporter()
    if _otlp_protocol("TRACES") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()


def _metric_exporter(name: str):
    if name == "console":
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter
        return ConsoleMetricExporter()
    if _otlp_protocol("METRICS") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    return OTLPMetricExporter()


def setup_telemetry(service_name: str) -> Telemetry:
    """Configure tracing and metrics for this process from the OTEL_* variables (see the module docstring).

    Installs the global tracer/meter providers when an exporter is configured, so the gRPC interceptors and any
    library instrumentation pick them up. A second call in the same process returns the first configuration
    (the OTel globals can be set only once). Raises TelemetryConfigError for an unsupported variable value.
    """
    global _configured
    if _configured is not None:
        return _configured
    disabled = os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    traces = () if disabled else _exporters("OTEL_TRACES_EXPORTER")
    metric_names = () if disabled else _exporters("OTEL_METRICS_EXPORTER")
    tracer_provider = meter_provider = None
    if traces or metric_names:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES but lets attributes given here
        # win, so the built-in name is passed only when the variables do not name the service.
        named_by_env = bool(os.environ.get("OTEL_SERVICE_NAME", "").strip()) or \
            "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
        resource = Resource.create({} if named_by_env else {SERVICE_NAME: service_name})
        service_name = str(resource.attributes.get(SERVICE_NAME, service_name))
    if traces:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        tracer_provider = TracerProvider(resource=resource)
        for name in traces:
            tracer_provider.add_span_processor(BatchSpanProcessor(_span_exporter(name)))
        trace.set_tracer_provider(tracer_provider)
    if metric_names:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        readers = [PeriodicExportingMetricReader(_metric_exporter(n)) for n in metric_names]
        meter_provider = MeterProvider(resource=resource, metric_readers=readers)
        metrics.set_meter_provider(meter_provider)
    _configured = Telemetry(
        service_name=service_name,
        traces_exporters=traces,
        metrics_exporters=metric_names,
        tracer=trace.get_tracer("splitgemma"),
        meter=metrics.get_meter("splitgemma"),
        _tracer_provider=tracer_provider,
        _meter_provider=meter_provider,
    )
    return _configured


# ---------------------------------------------------------------------------------------------------------------
# gRPC (grpc.aio)

def _probe_filter():
    # Health checks and Stats (the gateway polls both every half second) would otherwise flood the trace store
    # with one root trace each.
    from opentelemetry.instrumentation.grpc.filters import any_of, full_method_name, negate, service_name
    return negate(any_of(service_name("grpc.health.v1.Health"), full_method_name("/splitgemma.v1.Decode/Stats"),
                         full_method_name("/splitgemma.v1.Prefill/Stats")))


def grpc_server_interceptors(tracer_provider=None) -> list:
    """Interceptors for grpc.aio.server(interceptors=…): a SERVER span per RPC, child of the caller's traceparent
    (health checks and Stats are not traced), its streaming responses closed in the RPC's own task
    (_CloseStreamsInTask)."""
    import grpc
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    class _CloseStreamsInTask(grpc.aio.ServerInterceptor):
        """OTel's server interceptor wraps a streaming handler in an async generator that holds the span's context
        token across its yields. grpc.aio iterates such a generator but never closes it (grpc/grpc#42295): when
        the client cancels while the generator waits at a yield, it is closed later by the garbage collector's
        finaliser in another task, whose context cannot detach the token ("Failed to detach context", two
        tracebacks per cancelled Generate). Driven from here instead, by a handler that writes each message with
        context.write and closes the generator in a finally, it is always closed in the RPC's task."""

        async def intercept_service(self, continuation, details):
            handler = await continuation(details)
            if handler is None or not handler.response_streaming:
                return handler
            behavior = handler.unary_stream or handler.stream_stream

            async def drive(request, context):
                stream = behavior(request, context)
                if not inspect.isasyncgen(stream):  # a handler that writes itself (grpc.health's Watch)
                    return await stream
                try:
                    async for message in stream:
                        await context.write(message)
                finally:
                    await stream.aclose()

            make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else \
                grpc.stream_stream_rpc_method_handler
            return make(drive, request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)

    return [_CloseStreamsInTask(), aio_server_interceptor(tracer_provider=tracer_provider, filter_=_probe_filter())]


def grpc_client_interceptors(tracer_provider=None) -> list:
    """Interceptors for grpc.aio.insecure_channel(…, interceptors=…): a CLIENT span per RPC and the current
    context injected as traceparent/tracestate/baggage metadata (all four call shapes, streaming included), and
    an innermost one that makes cancelling a unary call cancel the RPC (_CancelUnaryCalls)."""
    import grpc
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    class _CancelUnaryCalls(grpc.aio.UnaryUnaryClientInterceptor):
        """grpc.aio runs the interceptor chain of a call in a task of its own, and OTel's unary interceptor awaits
        the call's status inside it. Cancelling the caller (or call.cancel()) cancels that task, which abandons
        the wait but not the RPC: the server would go on (a queued Decode.Reserve would keep its place in the
        queue, a Prefill would run to its end). Cancel the RPC with the task."""

        async def intercept_unary_unary(self, continuation, client_call_details, request):
            call = await continuation(client_call_details, request)
            asyncio.current_task().add_done_callback(lambda task: call.cancel() if task.cancelled() else None)
            return call

    return [*aio_client_interceptors(tracer_provider=tracer_provider, filter_=_probe_filter()), _CancelUnaryCalls()]


# ---------------------------------------------------------------------------------------------------------------
# gen_ai spans

def start_gen_ai_span(tracer: trace.Tracer, operation: str, model: str, *, max_tokens: int | None = None,
                      temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                      seed: int | None = None, choice_count: int | None = None,
                      stop_sequences: Sequence[str] | None = None, stream: bool | None = None,
                      server_address: str | None = None, server_port: int | None = None,
                      kind: SpanKind = SpanKind.INTERNAL) -> Span:
    """Start (not make current) an inference span named "{operation} {model}" (operation: chat,
    text_completion, …) with the request's gen_ai.request.* attributes, as a child of the current span. For
    spans that outlive one block, e.g. across an HTTP streaming response: make it current only around the calls
    that must see it (trace.use_span(span, end_on_exit=False)) and end it yourself."""
    attrs: dict[str, object] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": PROVIDER_NAME,
        "gen_ai.request.model": model,
    }
    optional = {
        "gen_ai.request.max_tokens": max_tokens,
        "gen_ai.request.temperature": temperature,
        "gen_ai.request.top_p": top_p,
        "gen_ai.request.top_k": top_k,
        "gen_ai.request.seed": None if seed is None else seed_attribute(seed),
        "gen_ai.request.stop_sequences": list(stop_sequences) if stop_sequences else None,
        "gen_ai.request.stream": stream,
        "server.address": server_address,
        "server.port": server_port,
    }
    # The conventions ask for choice.count only when it is not 1.
    if choice_count is not None and choice_count != 1:
        optional["gen_ai.request.choice.count"] = choice_count
    attrs.update({k: v for k, v in optional.items() if v is not None})
    return tracer.start_span(f"{operation} {model}", kind=kind, attributes=attrs)


def seed_attribute(seed: int) -> int | str:
    """gen_ai.request.seed as OTel can export it: attribute integers are int64 (a larger one makes the exporter log
    an error and drop the attribute), but seeds are uint64 (and the API takes -2**63 .. 2**64-1). A seed outside
    int64 is exported as its decimal string, the same number, rather than wrapped to another value."""
    return seed if -(1 << 63) <= seed < (1 << 63) else str(seed)


@contextlib.contextmanager
def gen_ai_span(tracer: trace.Tracer, operation: str, model: str, **request: Any) -> Iterator[Span]:
    """start_gen_ai_span as the current span for a block (same keywords). An exception escaping the block is
    recorded and sets error.type and an ERROR status."""
    span = start_gen_ai_span(tracer, operation, model, **request)
    with trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=False):
        try:
            yield span
        except BaseException as e:
            span.record_exception(e)
            set_gen_ai_error(span, type(e).__qualname__, str(e))
            raise


def set_gen_ai_response(span: Span, *, response_id: str | None = None, response_model: str | None = None,
                        finish_reasons: Sequence[str] | None = None, input_tokens: int | None = None,
                        output_tokens: int | None = None) -> None:
    """The gen_ai.response.* and gen_ai.usage.* attributes, set once the response is known."""
    values = {
        "gen_ai.response.id": response_id,
        "gen_ai.response.model": response_model,
        "gen_ai.response.finish_reasons": list(finish_reasons) if finish_reasons is not None else None,
        "gen_ai.usage.input_tokens": input_tokens,
        "gen_ai.usage.output_tokens": output_tokens,
    }
    span.set_attributes({k: v for k, v in values.items() if v is not None})


def set_gen_ai_error(span: Span, error_type: str, description: str = "") -> None:
    """error.type (a low-cardinality name: an exception class, an HTTP status, a gRPC code) and an ERROR status."""
    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR, description))


class GenAiServerMetrics:
    """The GenAI server histograms on an OTel meter. Attributes: operation, provider, model (+ error.type)."""

    def __init__(self, meter: metrics.Meter):
        self.ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s",
            description="Time to generate the first token for successful responses",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS)
        self.tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token", unit="s",
            description="Time per output token generated after the first token for successful responses",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS)
        self.duration = meter.create_histogram(
            "gen_ai.server.request.duration", unit="s",
            description="Generative AI server request duration such as time-to-last byte or last output token",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS)

    @staticmethod
    def attributes(operation: str, model: str, error_type: str | None = None) -> dict[str, str]:
        attrs = {"gen_ai.operation.name": operation, "gen_ai.provider.name": PROVIDER_NAME,
                 "gen_ai.request.model": model}
        if error_type:
            attrs["error.type"] = error_type
        return attrs

    def record(self, operation: str, model: str, *, duration_s: float, ttft_s: float | None = None,
               output_tokens: int = 0, error_type: str | None = None) -> None:
        """One finished request. time_per_output_token = (duration - TTFT) / (output tokens after the first),
        recorded only when there were at least two output tokens and no error, as the conventions define it."""
        attrs = self.attributes(operation, model, error_type)
        self.duration.record(duration_s, attrs)
        if error_type is None and ttft_s is not None:
            self.ttft.record(ttft_s, attrs)
            if output_tokens >= 2:
                self.tpot.record((duration_s - ttft_s) / (output_tokens - 1), attrs)
