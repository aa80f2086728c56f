"""splitgemma.serving.telemetry: OTEL_* configuration, W3C context over grpc.aio (server streaming stays in one
trace), gen_ai span attributes and the GenAI server histograms."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading

import grpc
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from splitgemma.serving import telemetry
from splitgemma.v1 import serving_pb2 as pb
from splitgemma.v1 import serving_pb2_grpc as pbg
from tools.procs import free_ports


def _provider():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


class _StreamingDecode(pbg.DecodeServicer):
    """A Decode service whose Generate streams three events and opens a span between yields, like the real one
    (its decode steps happen after the stream has started)."""

    def __init__(self, tracer):
        self.tracer = tracer

    async def Generate(self, request, context):
        for i in range(3):
            with self.tracer.start_as_current_span(f"step {i}"):
                await asyncio.sleep(0)
            yield pb.GenerateEvent(tokens=[pb.Token(token_id=10 + i)], completion_tokens=i + 1)

    async def Stats(self, request, context):
        return pb.DecodeStats(worker_id="w")

    async def Release(self, request, context):
        return pb.ReleaseResponse(released=True)


def _serve_in_thread(server_provider, ready: threading.Event, stop: threading.Event, port_box: list):
    """The server runs on its own thread and event loop so nothing can reach it but the gRPC metadata."""

    async def main():
        server = grpc.aio.server(interceptors=telemetry.grpc_server_interceptors(server_provider))
        pbg.add_DecodeServicer_to_server(_StreamingDecode(server_provider.get_tracer("test-server")), server)
        port_box.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.02)
        await server.stop(None)

    asyncio.run(main())


@pytest.fixture
def decode_server():
    provider, exporter = _provider()
    ready, stop, port_box = threading.Event(), threading.Event(), []
    t = threading.Thread(target=_serve_in_thread, args=(provider, ready, stop, port_box), daemon=True)
    t.start()
    assert ready.wait(10)
    yield port_box[0], exporter
    stop.set()
    t.join(10)


async def _call(port: int, client_provider, *, propagate: bool):
    tracer = client_provider.get_tracer("test-client")
    interceptors = telemetry.grpc_client_interceptors(client_provider) if propagate else None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=interceptors) as ch:
        stub = pbg.DecodeStub(ch)
        with tracer.start_as_current_span("request"):
            ids = [ev.tokens[0].token_id async for ev in stub.Generate(pb.GenerateRequest(request_id="r"),
                                                                        timeout=10)]
            stats = await stub.Stats(pb.StatsRequest(), timeout=10)
            released = await stub.Release(pb.ReleaseRequest(request_id="r"), timeout=10)
    return ids, stats, released


def test_server_streaming_call_stays_in_one_trace(decode_server):
    port, server_spans = decode_server
    client_provider, client_spans = _provider()
    ids, stats, released = asyncio.run(_call(port, client_provider, propagate=True))
    assert ids == [10, 11, 12] and stats.worker_id == "w" and released.released
    client_provider.force_flush()

    client = {s.name: s for s in client_spans.get_finished_spans()}
    server = {s.name: s for s in server_spans.get_finished_spans()}
    root = client["request"]
    trace_id = root.context.trace_id
    gen_client = client["/splitgemma.v1.Decode/Generate"]
    gen_server = server["/splitgemma.v1.Decode/Generate"]
    assert gen_client.kind == SpanKind.CLIENT and gen_server.kind == SpanKind.SERVER
    assert gen_client.parent.span_id == root.context.span_id
    assert gen_server.parent.span_id == gen_client.context.span_id
    # Spans opened by the handler after the stream started (between yields) belong to the same trace.
    for i in range(3):
        step = server[f"step {i}"]
        assert step.context.trace_id == trace_id
        assert step.parent.span_id == gen_server.context.span_id
    # A unary call the same way; the Stats probe is not traced on either side.
    assert server["/splitgemma.v1.Decode/Release"].parent.span_id == \
        client["/splitgemma.v1.Decode/Release"].context.span_id
    assert "/splitgemma.v1.Decode/Stats" not in client and "/splitgemma.v1.Decode/Stats" not in server
    assert {s.context.trace_id for s in [*client.values(), *server.values()]} == {trace_id}
    # The client span ends only when the stream has been drained, after every server step.
    assert gen_client.end_time >= server["step 2"].end_time


def test_without_client_interceptors_the_server_starts_its_own_trace(decode_server):
    """The control for the test above: the shared trace id comes from the metadata, nothing else."""
    port, server_spans = decode_server
    client_provider, client_spans = _provider()
    asyncio.run(_call(port, client_provider, propagate=False))
    root = next(s for s in client_spans.get_finished_spans() if s.name == "request")
    gen_server = next(s for s in server_spans.get_finished_spans() if s.name == "/splitgemma.v1.Decode/Generate")
    assert gen_server.parent is None
    assert gen_server.context.trace_id != root.context.trace_id


def test_gen_ai_span_attributes_and_error():
    provider, exporter = _provider()
    tracer = provider.get_tracer("t")
    with telemetry.gen_ai_span(tracer, "chat", "gemma-mini", max_tokens=16, temperature=0.0, top_p=1.0,
                               seed=7, choice_count=1, stop_sequences=["\n"], stream=True) as span:
        telemetry.set_gen_ai_response(span, response_id="chatcmpl-1", finish_reasons=["stop"],
                                      input_tokens=5, output_tokens=3)
    with pytest.raises(RuntimeError):
        with telemetry.gen_ai_span(tracer, "text_completion", "gemma-mini", choice_count=2):
            raise RuntimeError("boom")
    ok, bad = exporter.get_finished_spans()
    assert ok.name == "chat gemma-mini" and ok.kind == SpanKind.INTERNAL
    assert dict(ok.attributes) == {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "splitgemma", "gen_ai.request.model": "gemma-mini",
        "gen_ai.request.max_tokens": 16, "gen_ai.request.temperature": 0.0, "gen_ai.request.top_p": 1.0,
        "gen_ai.request.seed": 7, "gen_ai.request.stop_sequences": ("\n",), "gen_ai.request.stream": True,
        "gen_ai.response.id": "chatcmpl-1", "gen_ai.response.finish_reasons": ("stop",),
        "gen_ai.usage.input_tokens": 5, "gen_ai.usage.output_tokens": 3,
    }
    assert ok.status.status_code == StatusCode.UNSET
    assert bad.name == "text_completion gemma-mini"
    assert bad.attributes["gen_ai.request.choice.count"] == 2
    assert bad.attributes["error.type"] == "RuntimeError"
    assert bad.status.status_code == StatusCode.ERROR
    assert any(e.name == "exception" for e in bad.events)


def test_gen_ai_server_metrics_buckets_and_tpot():
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("t")
    m = telemetry.GenAiServerMetrics(meter)
    m.record("chat", "mini", duration_s=1.0, ttft_s=0.2, output_tokens=5)      # tpot = 0.8 / 4 = 0.2
    m.record("chat", "mini", duration_s=0.5, ttft_s=0.1, output_tokens=1)      # one token: no tpot
    m.record("chat", "mini", duration_s=0.3, error_type="503")                  # errors: duration only
    data = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                data[metric.name] = list(metric.data.data_points)
    (ttft,) = data["gen_ai.server.time_to_first_token"]
    assert ttft.count == 2 and tuple(ttft.explicit_bounds) == telemetry.TTFT_BUCKETS
    (tpot,) = data["gen_ai.server.time_per_output_token"]
    assert tpot.count == 1 and tpot.sum == pytest.approx(0.2)
    assert tuple(tpot.explicit_bounds) == telemetry.TPOT_BUCKETS
    durations = {dp.attributes.get("error.type"): dp.count for dp in data["gen_ai.server.request.duration"]}
    assert durations == {None: 2, "503": 1}
    assert ttft.attributes == {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "splitgemma",
                               "gen_ai.request.model": "mini"}


def _setup_in_subprocess(env: dict, code: str = "") -> subprocess.CompletedProcess:
    script = textwrap.dedent("""
        from opentelemetry import trace, metrics
        from splitgemma.serving.telemetry import setup_telemetry
        t = setup_telemetry("splitgemma-test")
        print(t.service_name, ",".join(t.traces_exporters) or "-", ",".join(t.metrics_exporters) or "-",
              type(trace.get_tracer_provider()).__module__.split(".")[1])
    """) + textwrap.dedent(code)
    base = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_")}
    return subprocess.run([sys.executable, "-c", script], env={**base, **env}, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("env, expected", [
    ({}, "splitgemma-test - - trace"),                                     # nothing set: no SDK, nothing exported
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}, "splitgemma-test otlp otlp sdk"),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "none", "OTEL_SERVICE_NAME": "gw"},
     "gw console - sdk"),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}, "splitgemma-test - - trace"),
])
def test_setup_from_environment(env, expected):
    r = _setup_in_subprocess(env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == expected


def test_console_exporter_writes_spans_on_shutdown():
    r = _setup_in_subprocess({"OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "none"}, """
        with t.tracer.start_as_current_span("hello"):
            pass
        t.shutdown()
    """)
    assert r.returncode == 0, r.stderr
    assert '"name": "hello"' in r.stdout and '"service.name": "splitgemma-test"' in r.stdout


@pytest.mark.parametrize("env, message", [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "unsupported exporter 'zipkin'"),
    ({"OTEL_TRACES_EXPORTER": "none,console"}, "'none' cannot be combined"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "unsupported protocol"),
])
def test_bad_environment_is_a_precise_error(env, message):
    r = _setup_in_subprocess(env)
    assert r.returncode != 0
    assert "TelemetryConfigError" in r.stderr and message in r.stderr


def test_shutdown_is_bounded_when_the_collector_is_unreachable():
    """A stopping service must not hang on exports to a collector that is gone."""
    (dead,) = free_ports(1)   # nothing listens there
    r = _setup_in_subprocess({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp",
                              "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                              "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{dead}"}, """
        import time
        with t.tracer.start_as_current_span("lost"):
            pass
        t0 = time.monotonic()
        flushed = t.shutdown(timeout_s=1.0)
        print("flushed" if flushed else "gave-up", round(time.monotonic() - t0, 1))
    """)
    assert r.returncode == 0, r.stderr
    verdict, seconds = r.stdout.splitlines()[-1].split()
    assert verdict == "gave-up" and float(seconds) < 2.0
