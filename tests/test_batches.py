"""The Files and Batch APIs (services/gateway/files.py, batches.py) on real processes, with the openai client: a
batch's answers are the endpoints' own (each compared with the same request sent directly), a bad input file fails
the batch with its lines named, cancel and the completion window stop it and free its decode slots, the files are
per key and bounded, and a gateway restarted on its folder takes up a batch where it stood."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from test_gateway import MODEL_NAME, TEMPLATE, Stack
from tools.procs import wait_until

KEY, OTHER_KEY = "sk-batch-one", "sk-batch-two"
FILES_MB = 8
CONCURRENCY = 3
FINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("batches")
    s = Stack(folder, gateway_args=("--chat-template", str(TEMPLATE), "--api-key", KEY, "--api-key", OTHER_KEY,
                                    "--files-dir", str(folder / "files"), "--files-mb", str(FILES_MB),
                                    "--batch-concurrency", str(CONCURRENCY)))
    yield s
    s.stop()


def _client(stack, key=KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(stack):
    return _client(stack)


def chat_body(i: int, **kw) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"w{i} w{i + 3} w{i + 7}"}],
            "temperature": 0, "max_tokens": 8, **kw}


def upload(client, endpoint: str, bodies: dict[str, dict]):
    lines = [json.dumps({"custom_id": cid, "method": "POST", "url": endpoint, "body": body})
             for cid, body in bodies.items()]
    return client.files.create(file=("requests.jsonl", "\n".join(lines).encode()), purpose="batch")


def start(client, endpoint: str, bodies: dict[str, dict], window: str = "24h", **kw):
    f = upload(client, endpoint, bodies)
    return client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window=window, **kw)


def wait(client, batch_id: str, until=FINAL, timeout: float = 120.0):
    seen = {}

    def reached():
        seen["batch"] = client.batches.retrieve(batch_id)
        return seen["batch"].status in until
    wait_until(reached, f"batch {batch_id} {until}", timeout, interval=0.05)
    return seen["batch"]


def answers(client, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    out = {}
    for line in client.files.content(file_id).text.splitlines():
        answer = json.loads(line)
        assert answer["custom_id"] not in out, "each request is answered once"
        out[answer["custom_id"]] = answer
    return out


def test_a_chat_batch_answers_as_the_endpoint_does(stack, client):
    good = {f"chat-{i}": chat_body(i) for i in range(5)}
    bad = {"wrong-model": chat_body(1, model="no-such-model"), "streamed": chat_body(2, stream=True),
           "bad-field": chat_body(3, temperature="hot"),
           # past the gateway's --max-body-bytes (4 MiB): refused as the endpoint refuses it
           "too-large": chat_body(4, messages=[{"role": "user", "content": "w1 " * (3 << 19)}])}
    batch = start(client, "/v1/chat/completions", {**good, **bad}, metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    batch = wait(client, batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.total == 9 and batch.request_counts.completed == 5
    assert batch.request_counts.failed == 4
    assert batch.model == MODEL_NAME and batch.completed_at >= batch.in_progress_at >= batch.created_at
    out, errors = answers(client, batch.output_file_id), answers(client, batch.error_file_id)
    assert set(out) == set(good) and set(errors) == set(bad)
    usage = {"input": 0, "output": 0}
    for cid, body in good.items():
        direct = client.chat.completions.create(**body)
        answer = out[cid]["response"]
        assert answer["status_code"] == 200 and out[cid]["error"] is None
        assert answer["body"]["id"] == answer["request_id"] and answer["body"]["object"] == "chat.completion"
        assert answer["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert answer["body"]["usage"]["completion_tokens"] == direct.usage.completion_tokens
        usage["input"] += direct.usage.prompt_tokens
        usage["output"] += direct.usage.completion_tokens
    assert (batch.usage.input_tokens, batch.usage.output_tokens) == (usage["input"], usage["output"])
    assert batch.usage.total_tokens == usage["input"] + usage["output"]
    # Each refusal is the endpoint's own, in its envelope.
    assert errors["wrong-model"]["response"]["status_code"] == 404
    assert errors["wrong-model"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert errors["streamed"]["response"]["body"]["error"]["param"] == "stream"
    assert errors["bad-field"]["response"]["status_code"] == 400
    assert errors["bad-field"]["response"]["body"]["error"]["param"] == "temperature"
    assert errors["too-large"]["response"]["status_code"] == 413
    # The files are the Files API's, of purpose batch_output; the batch is listed.
    output = client.files.retrieve(batch.output_file_id)
    assert output.purpose == "batch_output" and output.filename == f"{batch.id}_output.jsonl"
    listed = client.files.list(purpose="batch_output").data
    assert {batch.output_file_id, batch.error_file_id} <= {f.id for f in listed}
    assert batch.id in [b.id for b in client.batches.list().data]
    client.files.delete(batch.input_file_id)   # 4.5 MB of the store's 8


def test_completions_and_responses_batches(client):
    prompts = {"a": "w1 w2 w3", "b": "w4 w5"}
    batch = start(client, "/v1/completions", {k: {"model": MODEL_NAME, "prompt": p, "max_tokens": 6,
                                                  "temperature": 0} for k, p in prompts.items()})
    batch = wait(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 2
    out = answers(client, batch.output_file_id)
    for k, p in prompts.items():
        direct = client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=6, temperature=0)
        assert out[k]["response"]["body"]["choices"][0]["text"] == direct.choices[0].text
        assert out[k]["response"]["request_id"].startswith("cmpl-")
    batch = start(client, "/v1/responses", {k: {"model": MODEL_NAME, "input": p, "max_output_tokens": 6,
                                                "temperature": 0} for k, p in prompts.items()})
    batch = wait(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 2, batch
    out = answers(client, batch.output_file_id)
    for k, p in prompts.items():
        direct = client.responses.create(model=MODEL_NAME, input=p, max_output_tokens=6, temperature=0)
        body = out[k]["response"]["body"]
        assert body["object"] == "response" and body["output"][0]["content"][0]["text"] == direct.output_text
        # Stored under the batch's key, as a response created directly is.
        assert client.responses.retrieve(body["id"]).output_text == direct.output_text
        with pytest.raises(openai.NotFoundError):
            _client_other(client).responses.retrieve(body["id"])


def _client_other(client) -> openai.OpenAI:
    return openai.OpenAI(base_url=str(client.base_url), api_key=OTHER_KEY, max_retries=0, timeout=60)


def test_a_bad_file_fails_the_batch_with_its_lines_named(client):
    good = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": chat_body(1)}
    lines = ["not json", json.dumps(good), json.dumps(good), json.dumps({**good, "custom_id": "y", "method": "GET"}),
             json.dumps({**good, "custom_id": "z", "url": "/v1/completions"}), "",
             json.dumps({**good, "custom_id": "w", "body": "text"}), json.dumps([1, 2])]
    f = client.files.create(file=("bad.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = wait(client, batch.id)
    assert batch.status == "failed" and batch.failed_at and batch.output_file_id is None
    named = {(e.line, e.code) for e in batch.errors.data}
    assert named == {(1, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "invalid_request"),
                     (5, "mismatched_endpoint"), (7, "invalid_request"), (8, "invalid_json_line")}, named
    empty = client.files.create(file=("empty.jsonl", b"\n\n"), purpose="batch")
    batch = wait(client, client.batches.create(input_file_id=empty.id, endpoint="/v1/completions",
                                               completion_window="24h").id)
    assert batch.status == "failed" and batch.errors.data[0].code == "empty_file"


def test_refusals_at_create(client):
    f = upload(client, "/v1/chat/completions", {"a": chat_body(1)})
    cases = [({"input_file_id": "file-nope"}, 404, "input_file_id"),
             ({"endpoint": "/v1/embeddings"}, 400, "endpoint"),
             ({"completion_window": "forever"}, 400, "completion_window"),
             ({"completion_window": "8d"}, 400, "completion_window"),
             ({"metadata": {"k": 1}}, 400, "metadata"),
             ({"output_expires_after": {"anchor": "created_at", "seconds": 5}}, 400, "output_expires_after.seconds"),
             ({"extra_field": 1}, 400, "extra_field")]
    for change, status, param in cases:
        body = {"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **change}
        r = httpx.post(str(client.base_url) + "batches", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == status and r.json()["error"]["param"] == param, (change, r.text)
    # Another key's file is not there for this one; an output file is no batch input.
    with pytest.raises(openai.NotFoundError):
        _client_other(client).batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                             completion_window="24h")
    done = wait(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                              completion_window="24h").id)
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=done.output_file_id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    assert e.value.param == "input_file_id"
    with pytest.raises(openai.NotFoundError):
        _client_other(client).batches.retrieve(done.id)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(done.id)


def long_requests(n: int, tokens: int = 1500) -> dict[str, dict]:
    return {f"long-{i}": chat_body(i, max_tokens=tokens, ignore_eos=True) for i in range(n)}


def test_cancel_stops_a_batch_and_frees_its_slots(stack, client):
    batch = start(client, "/v1/chat/completions", long_requests(12))
    wait_until(lambda: stack.stats().slots_running > 0, "the batch's requests run", 60, interval=0.02)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    batch = wait(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    assert batch.request_counts.completed < 12
    assert len(answers(client, batch.output_file_id)) == batch.request_counts.completed
    assert client.batches.cancel(batch.id).status == "cancelled"   # again: the same answer
    stack.wait_idle()


def test_a_batch_past_its_window_expires(stack, client):
    batch = start(client, "/v1/chat/completions", long_requests(12), window="2s")
    batch = wait(client, batch.id, timeout=60)
    assert batch.status == "expired" and batch.expired_at
    out, errors = answers(client, batch.output_file_id), answers(client, batch.error_file_id)
    assert len(out) + len(errors) == 12 == batch.request_counts.total
    assert batch.request_counts.failed == len(errors) > 0
    assert all(e["error"]["code"] == "batch_expired" and e["response"] is None for e in errors.values())
    stack.wait_idle()


def test_files_api(stack, client):
    data = b'{"a": 1}\n{"b": "\xc3\xa9"}\n'
    f = client.files.create(file=("mine.jsonl", data), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 3600})
    assert f.bytes == len(data) and f.filename == "mine.jsonl" and f.purpose == "batch"
    assert f.expires_at == f.created_at + 3600
    assert client.files.content(f.id).read() == data
    assert client.files.retrieve(f.id).id == f.id and f.id in [x.id for x in client.files.list(purpose="batch")]
    other = _client_other(client)
    assert f.id not in [x.id for x in other.files.list().data]
    for call in (other.files.retrieve, other.files.content, other.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(f.id)
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    headers = {"Authorization": f"Bearer {KEY}"}
    url = stack.url + "/v1/files"
    r = httpx.post(url, files={"file": ("x.txt", b"x")}, data={"purpose": "fine-tune"}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"
    r = httpx.post(url, data={"purpose": "batch"}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    r = httpx.post(url, json={"purpose": "batch"}, headers=headers)
    assert r.status_code == 400
    r = httpx.post(url, files={"file": ("big.jsonl", b"x" * ((FILES_MB << 20) + 1))}, data={"purpose": "batch"},
                   headers=headers)
    assert r.status_code == 413 and "--files-mb" in r.json()["error"]["message"]
    assert httpx.get(url + "?limit=0", headers=headers).status_code == 400
    # Forms that are not what an upload is: each a 400 naming the file, and nothing kept.
    before = {x.id for x in client.files.list().data}
    part = b'--B\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\nabc\r\n'
    purpose = b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    multipart = {**headers, "content-type": "multipart/form-data; boundary=B"}
    for body in (part + purpose,                       # no closing boundary
                 part + part + purpose + b"--B--\r\n",   # two files
                 part + b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n' + b"b" * 5000
                 + b"\r\n--B--\r\n"):                  # a field longer than a field may be
        r = httpx.post(url, content=body, headers=multipart)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("file", "purpose"), r.text
    assert {x.id for x in client.files.list().data} == before
    assert not list((stack.folder / "files").glob("*.part")), "no partial upload is left behind"
    # A larger file arrives in many chunks: the same bytes come back.
    big = b"".join(b'{"n": %d}\n' % i for i in range(300000))
    f = client.files.create(file=("big.jsonl", big), purpose="batch")
    assert f.bytes == len(big) and client.files.content(f.id).read() == big
    client.files.delete(f.id)
    metrics = httpx.get(stack.url + "/metrics").text
    assert 'splitgemma_gateway_kept{kind="files"}' in metrics and 'splitgemma_gateway_kept{kind="batches"}' in metrics


def test_a_restarted_gateway_takes_up_its_batches(stack, client):
    """A gateway stopped while an OpenAI batch and an Anthropic message batch run, started again on the same folder,
    finishes both: every request answered once, the answers as the endpoint gives them."""
    anthropic_client = _anthropic(stack)   # first: importing the client takes as long as a batch may run
    bodies = long_requests(12, tokens=600)
    batch = start(client, "/v1/chat/completions", bodies)
    # Long enough to be running still when the first of the other batch's answers comes (~1/10 of its work).
    messages = anthropic_client.messages.batches.create(requests=[
        {"custom_id": f"m{i}", "params": messages_params(i, max_tokens=200)} for i in range(60)])
    wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, "a first answer", 60,
               interval=0.02)
    assert anthropic_client.messages.batches.retrieve(messages.id).processing_status == "in_progress"
    gateway = stack.procs["gateway"]
    gateway.send_signal(signal.SIGTERM)
    assert gateway.wait(30) == 0
    stack._spawn("gateway", ["gateway", *stack.gateway_args])
    stack.wait_ready()
    batch = wait(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 12, batch
    out = answers(client, batch.output_file_id)
    assert set(out) == set(bodies)
    body = dict(bodies["long-0"])
    extra = {"ignore_eos": body.pop("ignore_eos")}
    direct = client.chat.completions.create(**body, extra_body=extra)
    assert out["long-0"]["response"]["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
    assert batch.usage.output_tokens == 12 * 600
    assert "batch taken up again" in stack.log("gateway")
    ended = wait_ended(_anthropic(stack), messages.id)
    assert ended.request_counts.succeeded == 60
    assert sorted(r.custom_id for r in _anthropic(stack).messages.batches.results(messages.id)) == \
        sorted(f"m{i}" for i in range(60))
    assert stack.log("gateway").count("batch taken up again") == 2
    stack.wait_idle()


def test_batch_and_flex_requests_wait_behind_interactive_ones(tmp_path):
    """A batch runs at the lowest priority, and so does a request of service tier flex: with one decode slot, a
    chat request that arrives while one such request runs and another waits for the slot goes before the waiting
    one (first come, first served would run the waiting one first)."""
    s = Stack(tmp_path, slots=1, gateway_args=("--chat-template", str(TEMPLATE), "--batch-concurrency", "2"))
    try:
        c = s.client()
        batch = start(c, "/v1/chat/completions", long_requests(2, tokens=1900))

        def one_running_one_waiting():
            stats = s.stats()
            return stats.slots_running == 1 and stats.admission.queued == 1
        wait_until(one_running_one_waiting, "the batch's first request running, its second waiting", 60,
                   interval=0.005)
        assert c.chat.completions.create(**chat_body(9, max_tokens=4)).choices[0].message.content
        assert c.batches.retrieve(batch.id).request_counts.completed == 1, "the chat request went first"
        assert wait(c, batch.id).request_counts.completed == 2
        s.wait_idle()

        body = dict(chat_body(5, max_tokens=1900, service_tier="flex"))
        extra = {"ignore_eos": body.pop("ignore_eos", True)}
        with ThreadPoolExecutor(2) as pool:
            flex = [pool.submit(c.chat.completions.create, **body, extra_body=extra) for _ in range(2)]
            wait_until(one_running_one_waiting, "one flex request running, the other waiting", 60, interval=0.005)
            direct = c.chat.completions.create(**chat_body(9, max_tokens=4))
            assert direct.service_tier == "default"
            assert sum(f.done() for f in flex) == 1, "the default-tier request went before the waiting flex one"
            assert [f.result().service_tier for f in flex] == ["flex", "flex"]
    finally:
        s.stop()


# ---------------------------------------------------------------------------------------------------------------
# Anthropic's Message Batches API, with Anthropic's client

def _anthropic(stack, key=KEY):
    import anthropic
    return anthropic.Anthropic(base_url=stack.url, api_key=key, max_retries=0, timeout=60)


def messages_params(i: int, **kw) -> dict:
    return {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": f"w{i} w{i + 2} w{i + 5}"}], **kw}


def wait_ended(client, batch_id: str, timeout: float = 120.0):
    seen = {}

    def ended():
        seen["batch"] = client.messages.batches.retrieve(batch_id)
        return seen["batch"].processing_status == "ended"
    wait_until(ended, f"message batch {batch_id}", timeout, interval=0.05)
    return seen["batch"]


def test_a_message_batch_answers_as_the_messages_endpoint_does(stack):
    import anthropic

    client = _anthropic(stack)
    good = {f"m-{i}": messages_params(i) for i in range(3)}
    bad = {"no-messages": messages_params(1, messages=[]), "streamed": messages_params(2, stream=True),
           "other-model": messages_params(3, model="no-such-model")}
    batch = client.messages.batches.create(requests=[{"custom_id": k, "params": p}
                                                     for k, p in {**good, **bad}.items()])
    assert batch.type == "message_batch" and batch.processing_status == "in_progress"
    assert batch.request_counts.processing == 6 and batch.results_url is None
    batch = wait_ended(client, batch.id)
    counts = batch.request_counts
    assert (counts.succeeded, counts.errored, counts.canceled, counts.expired, counts.processing) == (3, 3, 0, 0, 0)
    assert batch.ended_at >= batch.created_at and batch.expires_at > batch.created_at
    assert batch.results_url.endswith(f"/v1/messages/batches/{batch.id}/results")
    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert set(results) == set(good) | set(bad)
    for k, params in good.items():
        params = dict(params)
        sampling = {"temperature": params.pop("temperature")}   # current SDKs no longer send it themselves
        direct = client.messages.create(**params, extra_body=sampling)
        assert results[k].type == "succeeded" and results[k].message.content[0].text == direct.content[0].text
        assert results[k].message.usage.output_tokens == direct.usage.output_tokens
    for k in bad:
        assert results[k].type == "errored" and results[k].error.type == "error", results[k]
    assert results["other-model"].error.error.type == "not_found_error"
    assert batch.id in [b.id for b in client.messages.batches.list()]
    # Another key sees none of it; an OpenAI batch id is no message batch (nor the other way round).
    with pytest.raises(anthropic.NotFoundError):
        _anthropic(stack, OTHER_KEY).messages.batches.retrieve(batch.id)
    assert batch.id not in [b.id for b in _anthropic(stack, OTHER_KEY).messages.batches.list()]
    with pytest.raises(openai.NotFoundError):
        _client(stack).batches.retrieve(batch.id)
    deleted = client.messages.batches.delete(batch.id)
    assert deleted.type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(batch.id)


def test_a_cancelled_message_batch_ends_with_the_rest_canceled(stack):
    import anthropic

    # A batch of long chat requests holds the runner's CONCURRENCY places first, so the message batch is cancelled
    # before it can have finished, however fast the host (its 200 short requests alone had all succeeded before the
    # cancel on a fast one: a test that hung on the machine's speed).
    chat = _client(stack)
    holder = start(chat, "/v1/chat/completions", long_requests(CONCURRENCY))
    wait_until(lambda: stack.stats().slots_running >= CONCURRENCY, "the long batch holds the runner", 60,
               interval=0.02)
    client = _anthropic(stack)
    n = 200
    batch = client.messages.batches.create(requests=[{"custom_id": f"c-{i}", "params": messages_params(i)}
                                                     for i in range(n)])
    with pytest.raises(anthropic.BadRequestError):
        client.messages.batches.delete(batch.id)     # still processing: cancel first
    early = httpx.get(f"{stack.url}/v1/messages/batches/{batch.id}/results", headers={"x-api-key": KEY})
    assert early.status_code == 400 and early.json()["error"]["type"] == "invalid_request_error"
    canceling = client.messages.batches.cancel(batch.id)
    assert canceling.processing_status in ("canceling", "ended") and canceling.cancel_initiated_at
    batch = wait_ended(client, batch.id)
    counts = batch.request_counts
    assert counts.canceled > 0 and counts.succeeded + counts.errored + counts.canceled == n
    kinds = [r.result.type for r in client.messages.batches.results(batch.id)]
    assert len(kinds) == n and kinds.count("canceled") == counts.canceled
    assert kinds.count("succeeded") == counts.succeeded
    chat.batches.cancel(holder.id)
    assert wait(chat, holder.id).status == "cancelled"
    stack.wait_idle()


def test_message_batch_create_refusals(stack):
    url = stack.url + "/v1/messages/batches"
    headers = {"x-api-key": KEY}
    ok = {"custom_id": "a", "params": messages_params(1)}
    cases = [{}, {"requests": []}, {"requests": [ok, ok]}, {"requests": [{**ok, "custom_id": "has space"}]},
             {"requests": [{**ok, "params": "text"}]}, {"requests": [{"custom_id": "a"}]},
             {"requests": [ok], "extra": 1}]
    for body in cases:
        r = httpx.post(url, json=body, headers=headers)
        assert r.status_code == 400 and r.json()["type"] == "error", (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(url + "/msgbatch_nope", headers=headers).json()["error"]["type"] == "not_found_error"
