"""Authentication (docs/security.md), on real processes with real clients: the gateway's API keys (the openai
client and raw httpx), the service token the workers require of every gRPC caller but health checks (grpc stubs),
TLS / mTLS between the gateway and the workers and HTTPS on the gateway (certificates from trustme), `splitgemma up`
with an API key, and the precise refusal of unusable credential files and options."""

from __future__ import annotations

import os
import secrets
import signal
import ssl
import subprocess
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from splitgemma.v1 import serving_pb2 as pb
from splitgemma.v1 import serving_pb2_grpc as pbg
from test_gateway import MODEL, MODEL_NAME, TEMPLATE, Stack
from test_up import _children, _start
from tools.procs import SPLITGEMMA, LoggedProcess, free_ports, http_ready, wait_until

TOKEN = secrets.token_urlsafe(32)
KEYS = {"flag": "sk-flag-" + secrets.token_urlsafe(8), "file": "sk-file-" + secrets.token_urlsafe(8),
        "env": "sk-env-" + secrets.token_urlsafe(8)}
CHAT = [{"role": "user", "content": "w5 w6 w7"}]


def refused_code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


# ---------------------------------------------------------------------------------------------------------------
# API keys and the service token on one stack

@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("auth")
    key_file = folder / "api_keys"
    key_file.write_text(f"# the team's keys\n\n{KEYS['file']}\n")
    # The token reaches all three processes in the environment, the keys by all three routes at once.
    s = Stack(folder, env={"SPLITGEMMA_SERVICE_TOKEN": TOKEN, "SPLITGEMMA_API_KEYS": f" {KEYS['env']} ,"},
              gateway_args=("--api-key", KEYS["flag"], "--api-key-file", str(key_file),
                            "--chat-template", str(TEMPLATE)))
    yield s
    s.stop()


def client(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_every_configured_key_works(stack):
    for key in KEYS.values():
        assert [m.id for m in client(stack, key).models.list().data] == [MODEL_NAME]
    r = client(stack, KEYS["file"]).chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=3,
                                                            temperature=0)
    assert r.choices[0].message.content and r.usage.completion_tokens <= 3
    stream = client(stack, KEYS["env"]).completions.create(model=MODEL_NAME, prompt="w1 w2", max_tokens=3,
                                                           temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream)
    # The scheme is case-insensitive (RFC 6750).
    assert httpx.get(stack.url + "/v1/models", headers={"Authorization": f"bearer {KEYS['flag']}"}).status_code == 200


def test_a_wrong_or_missing_key_is_a_401_in_openais_shape(stack):
    for key in ("sk-wrong", KEYS["flag"] + "x", KEYS["flag"][:-1], TOKEN):
        with pytest.raises(openai.AuthenticationError) as e:
            client(stack, key).chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=3)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        assert e.value.type == "invalid_request_error" and e.value.param is None
        assert key not in e.value.response.text, "the key is not echoed"
    missing = httpx.post(stack.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x"})
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert missing.json() == {"error": {"message": missing.json()["error"]["message"],
                                        "type": "invalid_request_error", "param": None, "code": None}}
    assert "Authorization: Bearer" in missing.json()["error"]["message"]
    for headers in ({"Authorization": KEYS["flag"]}, {"Authorization": f"Basic {KEYS['flag']}"},
                    {"Authorization": "Bearer"}, {"X-Api-Key": f"Bearer {KEYS['flag']}"}, {"X-Api-Key": "sk-wrong"}):
        r = httpx.get(stack.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error", headers
    # An unknown path says 401 too: without a key nobody learns which paths exist.
    assert httpx.get(stack.url + "/v2/anything").status_code == 401
    assert httpx.get(stack.url + "/v2/anything", headers={"Authorization": f"Bearer {KEYS['flag']}"}) \
        .status_code == 404


def test_anthropic_clients_send_the_key_as_x_api_key(stack):
    """Anthropic's clients send the key as x-api-key (this SDK version as a bearer token): either works, on the
    Messages API and elsewhere; a wrong one is a 401 in Anthropic's envelope under /v1/messages."""
    import anthropic

    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "w5 w6"}]}
    for key in KEYS.values():
        r = httpx.post(stack.url + "/v1/messages", json=body, headers={"x-api-key": key})
        assert r.status_code == 200 and r.json()["type"] == "message", r.text
        assert httpx.get(stack.url + "/v1/models", headers={"X-Api-Key": key}).status_code == 200
    ok = anthropic.Anthropic(base_url=stack.url, api_key=KEYS["flag"], max_retries=0, timeout=60)
    assert ok.messages.create(**body).usage.output_tokens <= 2
    for key in ("sk-wrong", None):
        headers = {} if key is None else {"x-api-key": key}
        r = httpx.post(stack.url + "/v1/messages", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=stack.url, api_key="sk-wrong", max_retries=0, timeout=60).messages.create(**body)


def test_stored_objects_belong_to_the_key_that_was_presented(stack):
    """Whose conversation (or response, file, batch) a request sees is the key it was let in with, whichever header
    carried it: a key sent as x-api-key owns what it makes, and another key sent the same way does not see it (it
    once fell back to the empty Authorization header, which every x-api-key caller shared)."""
    def headers(name: str, how: str) -> dict:
        return {"x-api-key": KEYS[name]} if how == "x-api-key" else {"Authorization": f"Bearer {KEYS[name]}"}

    made = httpx.post(stack.url + "/v1/conversations", json={"metadata": {"who": "flag"}},
                      headers=headers("flag", "x-api-key"))
    assert made.status_code == 200, made.text
    path = stack.url + "/v1/conversations/" + made.json()["id"]
    for how in ("x-api-key", "bearer"):
        assert httpx.get(path, headers=headers("flag", how)).json()["metadata"] == {"who": "flag"}
        for other in ("file", "env"):
            assert httpx.get(path, headers=headers(other, how)).status_code == 404
    # Both headers, one of them wrong: the request is let in by the right one, and sees as its key.
    both = {"Authorization": "Bearer sk-wrong", "x-api-key": KEYS["flag"]}
    assert httpx.get(path, headers=both).status_code == 200


def test_probes_and_metrics_stay_open(stack):
    assert httpx.get(stack.url + "/health").json() == {"status": "ok"}
    assert httpx.get(stack.url + "/ready").status_code == 200
    assert httpx.get(stack.url + "/v1/models").status_code == 401
    metrics = httpx.get(stack.url + "/metrics")
    assert metrics.status_code == 200
    # The refusal was counted like any other answer.
    assert 'splitgemma_gateway_requests_total{endpoint="/v1/models",status="401"}' in metrics.text


def test_the_other_endpoints_need_a_key_too(stack):
    """/tokenize, /detokenize, /version, / and the OpenAPI pages are the API too: keyed like /v1/*."""
    good = {"Authorization": f"Bearer {KEYS['flag']}"}
    posts = {"/tokenize": {"model": MODEL_NAME, "prompt": "w1 w2"}, "/detokenize": {"tokens": [2, 3]}}
    for path in ("/version", "/", "/docs", "/openapi.json", *posts):
        send = (lambda **kw: httpx.post(stack.url + path, json=posts[path], **kw)) if path in posts else \
            (lambda **kw: httpx.get(stack.url + path, **kw))
        refused = send()
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "invalid_request_error", path
        assert send(headers={"Authorization": "Bearer sk-wrong"}).status_code == 401, path
        assert send(headers=good).status_code == 200, path


def test_reflection_v1_and_v1alpha_list_both_services(stack):
    """grpcurl and grpcui ask reflection v1 first. grpcio-reflection ships only v1alpha's classes, so this client
    speaks v1 from the server's own description of it: one hand-encoded v1 request for the file that defines
    grpc.reflection.v1.ServerReflection, then classes built from that file (as grpcurl does)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    bearer = (("authorization", f"Bearer {TOKEN}"),)
    v1_method = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
    symbol = b"grpc.reflection.v1.ServerReflection"
    ask_file = b"\x22" + bytes([len(symbol)]) + symbol   # field 4 (file_containing_symbol), length-delimited
    for name in ("decode", "prefill"):
        with grpc.insecure_channel(stack.addresses[name]) as channel:
            raw = channel.stream_stream(v1_method)
            assert refused_code(lambda: list(raw(iter([ask_file]), timeout=10))) == grpc.StatusCode.UNAUTHENTICATED
            [answer] = raw(iter([ask_file]), timeout=10, metadata=bearer)
            # Decoded with v1alpha's classes only to reach the bytes of the file descriptor.
            files = reflection_pb2.ServerReflectionResponse.FromString(answer) \
                .file_descriptor_response.file_descriptor_proto
            fdp = descriptor_pb2.FileDescriptorProto.FromString(files[0])
            assert fdp.package == "grpc.reflection.v1" and [s.name for s in fdp.service] == ["ServerReflection"]
            pool = descriptor_pool.DescriptorPool()
            pool.Add(fdp)
            classes = message_factory.GetMessages([fdp], pool=pool)
            request_cls = classes["grpc.reflection.v1.ServerReflectionRequest"]
            response_cls = classes["grpc.reflection.v1.ServerReflectionResponse"]
            v1 = channel.stream_stream(v1_method, request_serializer=request_cls.SerializeToString,
                                       response_deserializer=response_cls.FromString)
            [listed] = v1(iter([request_cls(list_services="")]), timeout=10, metadata=bearer)
            v1_names = {s.name for s in listed.list_services_response.service}
            v1alpha = reflection_pb2_grpc.ServerReflectionStub(channel)
            [listed] = v1alpha.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                    timeout=10, metadata=bearer)
            assert {s.name for s in listed.list_services_response.service} == v1_names
            assert {f"splitgemma.v1.{name.capitalize()}", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                    "grpc.reflection.v1alpha.ServerReflection"} <= v1_names
            # v1 describes the worker's own service as v1alpha does.
            ask = request_cls(file_containing_symbol=f"splitgemma.v1.{name.capitalize()}")
            [described] = v1(iter([ask]), timeout=10, metadata=bearer)
            got = descriptor_pb2.FileDescriptorProto.FromString(
                described.file_descriptor_response.file_descriptor_proto[0])
            assert got.package == "splitgemma.v1" and f"{name.capitalize()}" in {s.name for s in got.service}


def test_workers_require_the_service_token(stack):
    bearer = (("authorization", f"Bearer {TOKEN}"),)
    for name, stub_class in (("decode", pbg.DecodeStub), ("prefill", pbg.PrefillStub)):
        with grpc.insecure_channel(stack.addresses[name]) as channel:
            stub = stub_class(channel)
            # Health answers anyone: probes cannot send metadata, and it tells only SERVING or not.
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            for metadata in (None, (("authorization", "Bearer wrong-token-wrong-token"),),
                             (("authorization", TOKEN),), (("authorization", f"Bearer {TOKEN[:-1]}"),)):
                assert refused_code(lambda: stub.Stats(pb.StatsRequest(), timeout=10, metadata=metadata)) == \
                    grpc.StatusCode.UNAUTHENTICATED
            assert stub.Stats(pb.StatsRequest(), timeout=10, metadata=bearer).worker_id
            # Without the token nobody learns which methods exist.
            nope = channel.unary_unary(f"/splitgemma.v1.{name.capitalize()}/Nope")
            assert refused_code(lambda: nope(b"", timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
            assert refused_code(lambda: nope(b"", timeout=10, metadata=bearer)) == grpc.StatusCode.UNIMPLEMENTED
            # Reflection (a stream-stream call) maps the API: it needs the token too.
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            assert refused_code(lambda: list(reflect.ServerReflectionInfo(iter([ask]), timeout=10))) == \
                grpc.StatusCode.UNAUTHENTICATED
            [answer] = reflect.ServerReflectionInfo(iter([ask]), timeout=10, metadata=bearer)
            assert f"splitgemma.v1.{name.capitalize()}" in {s.name for s in answer.list_services_response.service}
    # Every call shape of the pipeline is refused: Reserve (unary), Generate (server streaming), PushKv, Prefill.
    with grpc.insecure_channel(stack.decode_addr) as channel:
        decode = pbg.DecodeStub(channel)
        assert refused_code(lambda: decode.Reserve(pb.ReserveRequest(request_id="x", prompt_tokens=4),
                                                   timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        lease = decode.Reserve(pb.ReserveRequest(request_id="x", prompt_tokens=4), timeout=10, metadata=bearer)
        assert refused_code(lambda: list(decode.Generate(pb.GenerateRequest(request_id="x", lease=lease),
                                                         timeout=10))) == grpc.StatusCode.UNAUTHENTICATED
        # The network KV transport (bidirectional streaming) too: a push without the token writes nothing.
        push = pb.KvPush(open=pb.KvPushOpen(request_id="x", lease=lease, prompt_tokens=4))
        assert refused_code(lambda: list(decode.PushKv(iter([push]), timeout=10))) == \
            grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(stack.prefill_addr) as pc:
            assert refused_code(lambda: pbg.PrefillStub(pc).Prefill(
                pb.PrefillRequest(request_id="x", prompt_token_ids=[2, 3, 4, 5], lease=lease),
                timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        decode.Release(pb.ReleaseRequest(lease=lease), timeout=10, metadata=bearer)


def test_a_gateway_with_another_token_is_not_ready(stack, tmp_path):
    """Health is open, so the gateway's probe also calls Stats: a refused credential shows in /ready."""
    port, = free_ports(1)
    env = {k: v for k, v in stack.env.items() if k != "SPLITGEMMA_API_KEYS"}
    env["SPLITGEMMA_SERVICE_TOKEN"] = secrets.token_urlsafe(32)
    gw = LoggedProcess([*SPLITGEMMA, "gateway", "--model", str(MODEL), "--prefill", stack.prefill_addr,
                        "--decode", stack.decode_addr, "--port", str(port)], tmp_path / "gateway.log", env=env)
    try:
        def refused() -> bool:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2)
            except httpx.HTTPError:
                return False
            workers = r.json()["workers"]
            return all(w["status"].startswith("UNAUTHENTICATED") for kind in ("prefill", "decode")
                       for w in workers[kind])
        wait_until(refused, "both workers refusing the gateway", 30, watch={"gateway": gw})
        assert httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 503
        # The API is open on this gateway (no key) and says why it cannot serve.
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": MODEL_NAME, "prompt": "w1"})
        assert r.status_code == 503
    finally:
        gw.send_signal(signal.SIGTERM)
        gw.wait(20)
    assert "no API key configured" not in gw.log(), "it listens on loopback: no warning"


def test_metrics_auth(stack, tmp_path):
    port, = free_ports(1)
    env = {k: v for k, v in stack.env.items() if k != "SPLITGEMMA_API_KEYS"}
    gw = LoggedProcess([*SPLITGEMMA, "gateway", "--model", str(MODEL), "--prefill", stack.prefill_addr,
                        "--decode", stack.decode_addr, "--port", str(port), "--api-key", KEYS["flag"],
                        "--metrics-auth"], tmp_path / "gateway.log", env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_ready(url), "the gateway", 30, watch={"gateway": gw})
        assert httpx.get(url + "/metrics").status_code == 401
        r = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEYS['flag']}"})
        assert r.status_code == 200 and "splitgemma_gateway_" in r.text
        assert httpx.get(url + "/health").status_code == 200
    finally:
        gw.send_signal(signal.SIGTERM)
        gw.wait(20)


def test_an_open_api_beyond_loopback_is_logged(caplog):
    from splitgemma.services.gateway.auth import warn_if_open
    for host, keys, warned in (("0.0.0.0", [], True), ("", [], True), ("10.1.2.3", [], True),
                               ("gateway.internal", [], True), ("0.0.0.0", ["k"], False), ("127.0.0.1", [], False),
                               ("::1", [], False), ("localhost", [], False)):
        caplog.clear()
        warn_if_open(host, keys)
        assert ("no API key configured" in caplog.text) == warned, host


# ---------------------------------------------------------------------------------------------------------------
# mTLS between the gateway and the workers, HTTPS in front

@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA with a server certificate for 127.0.0.1 and a client certificate, and an unrelated CA, as PEM files."""
    folder = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    files = {"ca": folder / "ca.pem", "other-ca": folder / "other-ca.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    other.cert_pem.write_to_path(str(files["other-ca"]))
    for name, issuer, cert in (("server", ca, ca.issue_cert("127.0.0.1", "localhost")),
                               ("client", ca, ca.issue_cert("gateway@splitgemma")),
                               ("stranger", other, other.issue_cert("stranger@elsewhere"))):
        files[name] = folder / f"{name}.pem"
        files[f"{name}-key"] = folder / f"{name}-key.pem"
        cert.cert_chain_pems[0].write_to_path(str(files[name]))
        cert.private_key_pem.write_to_path(str(files[f"{name}-key"]))
    return files


def trusting(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


class HttpsStack(Stack):
    """The stack with the gateway on HTTPS (its /ready polled over TLS)."""

    def __init__(self, *args, ca: Path, **kw):
        self.ca = ca
        super().__init__(*args, **kw)

    def wait_ready(self, timeout=60.0):
        self.url = self.url.replace("http://", "https://")

        def ready() -> bool:
            try:
                return httpx.get(self.url + "/ready", timeout=2, verify=trusting(self.ca)).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(ready, "the TLS stack", timeout, watch=self.procs)


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory, pki):
    f = {k: str(v) for k, v in pki.items()}
    s = HttpsStack(tmp_path_factory.mktemp("tls"), ca=pki["ca"],
                   worker_args=("--tls-cert", f["server"], "--tls-key", f["server-key"], "--tls-ca", f["ca"]),
                   gateway_args=("--worker-tls-ca", f["ca"], "--worker-tls-cert", f["client"],
                                 "--worker-tls-key", f["client-key"],
                                 "--tls-cert", f["server"], "--tls-key", f["server-key"],
                                 "--chat-template", str(TEMPLATE)))
    yield s
    s.stop()


def test_gateway_serves_https_over_mtls_workers(tls_stack, pki):
    c = openai.OpenAI(base_url=tls_stack.url + "/v1", api_key="unused", max_retries=0, timeout=60,
                      http_client=httpx.Client(verify=trusting(pki["ca"])))
    r = c.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=3, temperature=0)
    assert r.choices[0].message.content
    with pytest.raises(httpx.ConnectError):  # a client that does not trust the certificate
        httpx.get(tls_stack.url + "/health")


def test_workers_refuse_clients_without_a_certificate_of_their_ca(tls_stack, pki):
    read = {k: Path(v).read_bytes() for k, v in pki.items()}
    no_cert = grpc.ssl_channel_credentials(root_certificates=read["ca"])
    stranger = grpc.ssl_channel_credentials(root_certificates=read["ca"], private_key=read["stranger-key"],
                                            certificate_chain=read["stranger"])
    ours = grpc.ssl_channel_credentials(root_certificates=read["ca"], private_key=read["client-key"],
                                        certificate_chain=read["client"])
    check = health_pb2.HealthCheckRequest()
    for name in ("decode", "prefill"):
        address = tls_stack.addresses[name]
        with grpc.insecure_channel(address) as plain:
            assert refused_code(lambda: health_pb2_grpc.HealthStub(plain).Check(check, timeout=5)) == \
                grpc.StatusCode.UNAVAILABLE
        for creds in (no_cert, stranger):
            with grpc.secure_channel(address, creds) as channel:
                assert refused_code(lambda: health_pb2_grpc.HealthStub(channel).Check(check, timeout=5)) == \
                    grpc.StatusCode.UNAVAILABLE
        with grpc.secure_channel(address, ours) as channel:
            stats = (pbg.DecodeStub if name == "decode" else pbg.PrefillStub)(channel).Stats(pb.StatsRequest(),
                                                                                              timeout=10)
            assert stats.worker_id


# ---------------------------------------------------------------------------------------------------------------
# splitgemma up

def test_up_with_an_api_key(shm_dir, tmp_path):
    key = "sk-up-" + secrets.token_urlsafe(12)
    p, url = _start(shm_dir, tmp_path, "--slots", "2", "--threads", "1", "--api-key", key)
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="sk-wrong", max_retries=0, timeout=30).models.list()
        r = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=30).completions.create(
            model="mini-e2b-tame", prompt="w5 w6", max_tokens=3, temperature=0)
        assert r.choices[0].text and r.usage.completion_tokens <= 3
        children = {cmd.split()[3]: (pid, cmd) for pid, cmd in _children(p.pid).items()}
        tokens = set()
        for kind, (pid, cmd) in children.items():
            environ = dict(item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                           if b"=" in item)
            tokens.add(environ[b"SPLITGEMMA_SERVICE_TOKEN"].decode())
            assert key not in cmd, f"the API key is on the {kind}'s command line"
        [token] = tokens
        assert len(token) >= 32 and not any(token in cmd for _, cmd in children.values())
        # The workers, on loopback, still refuse callers that are not the gateway.
        decode_port = children["decode"][1].split("--port ")[1].split()[0]
        with grpc.insecure_channel(f"127.0.0.1:{decode_port}") as channel:
            stub = pbg.DecodeStub(channel)
            assert refused_code(lambda: stub.Stats(pb.StatsRequest(), timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
            assert stub.Stats(pb.StatsRequest(), timeout=10, metadata=(("authorization", f"Bearer {token}"),))
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, (tmp_path / "up.log").read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()


# ---------------------------------------------------------------------------------------------------------------
# Unusable credentials: a precise error at start, never a hang or a traceback

def _fails(argv: list[str], env: dict | None = None) -> str:
    r = subprocess.run([*SPLITGEMMA, *argv], capture_output=True, text=True, timeout=60,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    return r.stderr


def test_bad_credentials_are_refused_at_start(tmp_path, pki):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    short = tmp_path / "short"
    short.write_text("abc\n")
    spaced = tmp_path / "spaced"
    spaced.write_text("ok-key\nsk two words\n")
    gateway = ["gateway", "--model", str(MODEL), "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"]
    worker = ["decode", "--model", str(MODEL), "--port", "0", "--slots", "1"]
    cases = [
        (gateway + ["--api-key-file", str(fifo)], None, "not a regular file"),
        (gateway + ["--api-key-file", str(tmp_path / "missing")], None, "No such file"),
        (gateway + ["--api-key-file", str(spaced)], None, f"--api-key-file {spaced} line 2"),
        (gateway + ["--api-key", "sk-bad\u00e9"], None, "only visible ASCII"),
        (gateway, {"SPLITGEMMA_API_KEYS": "good,bad key"}, "SPLITGEMMA_API_KEYS item 2"),
        (gateway + ["--service-token-file", str(short)], None, "at least 16"),
        (gateway + ["--worker-tls-cert", str(pki["client"])], None, "go together"),
        (gateway + ["--worker-tls-ca", str(pki["client-key"])], None, "not PEM CA certificates"),
        (gateway + ["--tls-cert", str(pki["server"]), "--tls-key", str(pki["client-key"])], None,
         "matching private key"),
        (worker + ["--service-token-file", str(fifo)], None, "not a regular file"),
        (worker, {"SPLITGEMMA_SERVICE_TOKEN": "too-short"}, "SPLITGEMMA_SERVICE_TOKEN: the service token has 9"),
        (worker + ["--tls-ca", str(pki["ca"])], None, "a TLS server needs --tls-cert and --tls-key"),
    ]
    for argv, env, message in cases:
        err = _fails(argv, env)
        assert message in err, (argv, err)
        assert "sk-bad" not in err and "bad key" not in err, "a secret is never printed"
