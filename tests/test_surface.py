"""The API surface beside generation, on real processes (decode + prefill + gateway, OTLP to a collector in this
process): /tokenize and /detokenize in vLLM's shapes, the model card, /version, / and the OpenAPI pages; and the
traces of one request lining up across the three processes (one id, the operation, seeds beyond int64), with no
telemetry error logged, not even when the client goes away mid-stream."""

from __future__ import annotations

import os
import time

import httpx
import pytest
from tokenizers import Tokenizer

from test_gateway import MAX_CONTEXT, MODEL, MODEL_NAME, TEMPLATE, Stack, _error
from test_gateway import collector  # noqa: F401  (the module's OTLP receiver fixture, shared)

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "w5 w6 w7"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, collector):
    s = Stack(tmp_path_factory.mktemp("surface"), env=collector.env(),
              gateway_args=("--chat-template", str(TEMPLATE)))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(MODEL.parent / "tokenizer.json"))


def _post(stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(stack.url + path, json=body, timeout=30)


# ---------------------------------------------------------------------------------------------------------------
# /tokenize, /detokenize

def test_tokenize_round_trips_through_detokenize(stack, tokenizer):
    text = "w5 w6 w7 w40"  # the fixture's word-level vocabulary (its tokenizer adds no <bos>; the default model's
    # does: tests/test_gemma3.py)
    r = _post(stack, "/tokenize", {"model": MODEL_NAME, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode(text, add_special_tokens=True).ids
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_CONTEXT
    assert "token_strs" not in body
    plain = _post(stack, "/tokenize", {"prompt": text, "add_special_tokens": False,
                                       "return_token_strs": True}).json()
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False).ids
    assert plain["token_strs"] == [tokenizer.id_to_token(i) for i in plain["tokens"]]
    assert _post(stack, "/detokenize", {"model": MODEL_NAME, "tokens": plain["tokens"]}).json() == {"prompt": text}
    assert _post(stack, "/detokenize", {"tokens": body["tokens"]}).json()["prompt"] == \
        tokenizer.decode(body["tokens"], skip_special_tokens=False)


def test_tokenize_messages_is_the_chat_prompt(stack):
    """The ids of the chat template applied, as /v1/chat/completions feeds them to the model."""
    r = _post(stack, "/tokenize", {"model": MODEL_NAME, "messages": CHAT})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    chat = stack.client().chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=1, temperature=0)
    assert chat.usage.prompt_tokens == len(ids) == r.json()["count"]
    done = _post(stack, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()["tokens"]
    assert ids[:len(done)] == done and len(done) < len(ids), "the generation prompt is what add_generation_prompt adds"
    bos = _post(stack, "/tokenize", {"prompt": ""}).json()["tokens"]
    again = _post(stack, "/tokenize", {"messages": CHAT, "add_special_tokens": True}).json()["tokens"]
    assert again == ids and ids[:len(bos)] == bos, "the template writes <bos> itself: not twice"


def test_continue_final_message_continues_the_answer(stack):
    """vLLM's continue_final_message: the prompt ends inside the last message (the render cut as transformers cuts
    it: tests/test_gateway.py's oracle cases), and the chat's answer is the raw completion of that prompt."""
    messages = CHAT + [{"role": "assistant", "content": "w8 w9"}]
    ids = _post(stack, "/tokenize", {"messages": messages, "add_generation_prompt": False,
                                     "continue_final_message": True}).json()["tokens"]
    closed = _post(stack, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    assert closed[:len(ids)] == ids and len(closed) > len(ids), "the same turn, left open"
    c = stack.client()
    chat = c.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0,
                                     extra_body={"add_generation_prompt": False, "continue_final_message": True})
    raw = c.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == raw.choices[0].text
    assert chat.usage.prompt_tokens == len(ids)
    both = _post(stack, "/v1/chat/completions", {"model": MODEL_NAME, "messages": messages,
                                                 "continue_final_message": True})
    assert _error(both, 400)["param"] == "continue_final_message"


def test_tokenize_and_detokenize_errors(stack):
    cases = [("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
             ("/tokenize", {"model": MODEL_NAME}, 400, "prompt"),
             ("/tokenize", {"prompt": 5}, 400, "prompt"),
             ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
             ("/tokenize", {"messages": []}, 400, "messages"),
             ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
             ("/detokenize", {"tokens": [1, 10 ** 9]}, 400, "tokens"),
             ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
             ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
             ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model")]
    for path, body, status, param in cases:
        err = _error(_post(stack, path, body), status)
        assert err["param"] == param, (path, body, err)
    bad_json = httpx.post(stack.url + "/tokenize", content=b'{"prompt": "x",}', timeout=30)
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"


# ---------------------------------------------------------------------------------------------------------------
# model card, version, root, OpenAPI

def test_model_card_version_root_and_openapi(stack):
    c = stack.client()
    [card] = c.models.list().data
    assert card.id == MODEL_NAME and card.object == "model" and card.owned_by == "splitgemma"
    assert isinstance(card.created, int)
    extra = card.model_extra
    assert extra["max_model_len"] == MAX_CONTEXT and extra["root"] == MODEL_NAME and extra["parent"] is None
    assert extra["chat_template"] == "--chat-template"
    [perm] = extra["permission"]
    assert perm["object"] == "model_permission" and perm["id"].startswith("modelperm-")
    assert c.models.retrieve(MODEL_NAME).model_extra["max_model_len"] == MAX_CONTEXT
    from splitgemma import __version__
    assert httpx.get(stack.url + "/version").json() == {"version": __version__}
    root = httpx.get(stack.url + "/").json()
    assert root["model"] == MODEL_NAME and "/tokenize" in root["endpoints"] and root["docs"] == "/docs"
    docs = httpx.get(stack.url + "/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower() and "/openapi.json" in docs.text
    paths = httpx.get(stack.url + "/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/responses/{response_id}",
            "/v1/messages", "/v1/messages/count_tokens", "/v1/models", "/tokenize", "/detokenize",
            "/version"} <= set(paths)
    assert "/v1/responses" in root["endpoints"]


# ---------------------------------------------------------------------------------------------------------------
# Traces

def _spans(collector, trace_id: str, wanted: set[str], timeout: float = 15.0) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while True:
        by = {s["name"]: s for s in collector.trace(trace_id)}
        if wanted <= set(by):
            return by
        assert time.monotonic() < deadline, f"spans so far: {sorted(by)}"
        time.sleep(0.1)


@pytest.mark.parametrize("seed", [(1 << 63) + 5, (1 << 64) - 1])
def test_one_id_and_the_operation_in_every_span_and_large_seeds_exported(stack, collector, seed):
    trace_id = os.urandom(16).hex()
    c = stack.client(default_headers={"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"})
    raw = c.chat.completions.with_raw_response.create(model=MODEL_NAME, messages=CHAT, max_tokens=3,
                                                      temperature=0.7, seed=seed)
    body = raw.parse()
    assert body.id.startswith("chatcmpl-") and raw.headers["x-request-id"] == body.id
    names = {f"chat {MODEL_NAME}", "prefill.forward", "decode.generate"}
    by = _spans(collector, trace_id, names)
    for name in names:
        a = by[name]["attributes"]
        assert a["gen_ai.response.id"] == body.id, name
        assert a["gen_ai.operation.name"] == "chat", name
        assert a["gen_ai.request.seed"] == str(seed), f"{name}: a seed beyond int64 goes as its decimal string"
    # A client's own X-Request-Id is the id of everything, the body's too.
    given = "req-" + os.urandom(6).hex()
    trace_id = os.urandom(16).hex()
    c = stack.client(default_headers={"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01",
                                      "X-Request-Id": given})
    r = c.completions.create(model=MODEL_NAME, prompt="w1 w2", max_tokens=2, temperature=0, seed=3)
    assert r.id == given
    names = {f"text_completion {MODEL_NAME}", "prefill.forward", "decode.generate"}
    by = _spans(collector, trace_id, names)
    for name in names:
        a = by[name]["attributes"]
        assert a["gen_ai.response.id"] == given and a["gen_ai.operation.name"] == "text_completion", name
        assert a["gen_ai.request.seed"] == 3, name
    for name in ("gateway", "prefill", "decode"):
        log = stack.log(name)
        assert "Invalid type" not in log and "gen_ai.request.seed" not in log, f"{name}: {log[-2000:]}"
    assert f"{given}-0" in stack.log("decode"), "the workers log the request under the same id (+ choice index)"


def test_a_client_going_away_logs_no_telemetry_error(stack):
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", stack.url + "/v1/completions",
                      json={"model": MODEL_NAME, "prompt": "w1 w2 w3", "max_tokens": 200, "stream": True,
                            "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # one event, then hang up
    stack.wait_idle()
    for name in ("gateway", "prefill", "decode"):
        log = stack.log(name)
        assert "Failed to detach context" not in log and "Traceback" not in log, f"{name}: {log[-3000:]}"


def test_streaming_rpcs_of_every_shape_still_answer(stack):
    """The workers' server interceptors drive every streaming handler: an async generator (Generate, through the
    tests above) and one that writes itself (grpc.health's Watch)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    watch = health_pb2_grpc.HealthStub(stack.channels["decode"]).Watch(health_pb2.HealthCheckRequest(), timeout=10)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    with pytest.raises(grpc.RpcError) as e:
        next(watch)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    assert "Traceback" not in stack.log("decode")


# ---------------------------------------------------------------------------------------------------------------
# Metrics under vLLM's names

def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_vllm_metric_names_beside_ours(stack):
    before = _samples(httpx.get(stack.url + "/metrics").text)
    c = stack.client()
    c.completions.create(model=MODEL_NAME, prompt="w5 w6 w7 w8", max_tokens=2, temperature=0,
                       extra_body={"ignore_eos": True})
    c.completions.create(model=MODEL_NAME, prompt="w5 w6 w7 w8", max_tokens=2, temperature=0,
                       extra_body={"ignore_eos": True})
    stack.wait_idle()
    text = httpx.get(stack.url + "/metrics").text
    after = _samples(text)
    label = f'model_name="{MODEL_NAME}"'

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew(f'vllm:request_success_total{{finished_reason="length",{label}}}') == 2
    assert grew(f"vllm:prompt_tokens_total{{{label}}}") == grew("splitgemma_gateway_prompt_tokens_total") > 0
    assert grew(f"vllm:prefix_cache_queries_total{{{label}}}") == grew("splitgemma_gateway_prompt_tokens_total")
    assert grew(f"vllm:prefix_cache_hits_total{{{label}}}") == \
        grew("splitgemma_gateway_prompt_tokens_cached_total")
    assert grew(f"vllm:generation_tokens_total{{{label}}}") == 4
    assert grew(f"vllm:request_queue_time_seconds_count{{{label}}}") == 2
    assert grew(f"vllm:time_to_first_token_seconds_count{{{label}}}") == 2
    assert grew(f"vllm:e2e_request_latency_seconds_count{{{label}}}") == 2
    assert after[f"vllm:num_requests_running{{{label}}}"] == 0
    assert after[f"vllm:num_requests_waiting{{{label}}}"] == 0
    assert 0.0 <= after[f"vllm:kv_cache_usage_perc{{{label}}}"] <= 1.0
    assert "# TYPE vllm:request_success_total counter" in text and "_created" not in text
