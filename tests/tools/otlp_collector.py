"""An OTLP receiver in the test process: the spans and metric names the services export, per service."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as mpb
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as mgrpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tgrpc


def attribute(attrs, key: str):
    """The value of attribute `key` in a list of OTLP KeyValues (None when absent)."""
    return next((value(a.value) for a in attrs if a.key == key), None)


def value(v):
    """An OTLP AnyValue as a Python value (arrays as lists)."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class OtlpCollector:
    """Receives OTLP over `protocol` ("http/protobuf" or "grpc", as OTEL_EXPORTER_OTLP_PROTOCOL names them) on a
    free loopback port. `spans`: one dict per span (service, name, trace_id, span_id, parent, kind, attributes);
    read them under `lock`."""

    def __init__(self, protocol: str = "http/protobuf"):
        self.protocol = protocol
        self.spans: list[dict] = []
        self._metric_names: set[tuple[str, str]] = set()
        self.lock = threading.Lock()
        if protocol == "http/protobuf":
            self._start_http()
        elif protocol == "grpc":
            self._start_grpc()
        else:
            raise ValueError(f"unsupported OTLP protocol {protocol!r}")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _add_spans(self, request: tpb.ExportTraceServiceRequest) -> None:
        with self.lock:
            for rs in request.resource_spans:
                service = attribute(rs.resource.attributes, "service.name")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append({
                            "service": service, "name": s.name, "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                            "kind": s.kind, "attributes": {a.key: value(a.value) for a in s.attributes}})

    def _add_metrics(self, request: mpb.ExportMetricsServiceRequest) -> None:
        with self.lock:
            for rm in request.resource_metrics:
                service = attribute(rm.resource.attributes, "service.name")
                self._metric_names |= {(service, m.name) for sm in rm.scope_metrics for m in sm.metrics}

    def _start_http(self) -> None:
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path == "/v1/traces":
                    collector._add_spans(tpb.ExportTraceServiceRequest.FromString(body))
                elif self.path == "/v1/metrics":
                    collector._add_metrics(mpb.ExportMetricsServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        self.port = self._http.server_address[1]

    def _start_grpc(self) -> None:
        collector = self

        class Traces(tgrpc.TraceServiceServicer):
            def Export(self, request, context):
                collector._add_spans(request)
                return tpb.ExportTraceServiceResponse()

        class Metrics(mgrpc.MetricsServiceServicer):
            def Export(self, request, context):
                collector._add_metrics(request)
                return mpb.ExportMetricsServiceResponse()

        self._grpc = grpc.server(ThreadPoolExecutor(max_workers=4))
        tgrpc.add_TraceServiceServicer_to_server(Traces(), self._grpc)
        mgrpc.add_MetricsServiceServicer_to_server(Metrics(), self._grpc)
        self.port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._grpc.start()

    def env(self) -> dict[str, str]:
        """OTEL_* variables that make a service export here, quickly (short batch and metric intervals)."""
        return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_PROTOCOL": self.protocol, "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
                "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_METRIC_EXPORT_INTERVAL": "300"}

    def trace(self, trace_id: str) -> list[dict]:
        """The spans received so far of trace `trace_id` (hex)."""
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def metric_names(self) -> set[tuple[str, str]]:
        """(service, metric name) of every metric received so far."""
        with self.lock:
            return set(self._metric_names)

    def close(self) -> None:
        if self.protocol == "grpc":
            self._grpc.stop(grace=None)
        else:
            self._http.shutdown()
