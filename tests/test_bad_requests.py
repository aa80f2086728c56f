"""Bad input of every kind gets a precise 4xx (or, for files and options, a clear error and an orderly exit), never a
500, a traceback, a hang or a crash: request bodies against a real gateway (each known class, then property-based
fuzzing with hypothesis), .fgm headers and tensor tables against the native reader, a FIFO as the model path, a
model file truncated under a running stack, CLI integers out of range.

Reproducibility of the fuzzing: every hypothesis test here runs with derandomize=True (the examples are a function
of the test's source, so CI runs the same ones every time and a failure is never a matter of luck), and first runs
the committed seed corpus in tests/fixtures/fuzz/ (its README): every input that once failed, or stands for a class
of bad input, as an explicit example, so those stay covered whatever the generator does. A failure hypothesis finds
is printed as a minimal example, which belongs in that corpus.

Budget: the request fuzzing sends REQUEST_EXAMPLES bodies (most are answered 400 in milliseconds; the valid ones
generate at most 4 tokens × 3 choices), the .fgm fuzzing opens FGM_EXAMPLES files; together well under a minute.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from splitgemma._native import EXIT_MODEL_FILE_CHANGED, FgmError, FgmFile
from test_fgm_reader import split_file, write_with_header
from test_gateway import MODEL, MODEL_NAME, TEMPLATE, Stack
from tools.procs import SPLITGEMMA, LoggedProcess, free_ports, http_ready, wait_until

REQUEST_EXAMPLES = 500
FGM_EXAMPLES = 200
# What a body must never show a client: a traceback, a source path, an exception's class and text.
LEAKS = re.compile(r"Traceback|File \"|\.py\b|/work/|/usr/|site-packages|Error: |internal error:")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("bad-requests"), gateway_args=("--chat-template", str(TEMPLATE)))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.url, timeout=60) as c:
        yield c


def post(http, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(path, content=content, headers={"content-type": "application/json"})


def raw(text: str) -> bytes:
    """A body written by hand (lone surrogate escapes, NaN, … are what json.dumps would not write)."""
    return text.encode("utf-8", "surrogatepass")


def assert_client_error(r: httpx.Response, param: str | None = "-", status: int = 400) -> dict:
    """A 4xx in the OpenAI error shape, with `param` when given, and nothing internal in it."""
    assert r.status_code == status, r.text[:500]
    assert not LEAKS.search(r.text), r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["message"]
    if param != "-":
        assert err["param"] == param, err
    return err


def completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 1, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **fields}


C, CHAT, RESPONSES, MESSAGES = "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"
M = json.dumps(MODEL_NAME)


# ---------------------------------------------------------------------------------------------------------------
# Each class, against the running gateway

@pytest.mark.parametrize("path, body, param", [
    (C, raw('{"model": %s, "prompt": "a\\ud800b", "max_tokens": 1}' % M), "prompt"),
    (C, raw('{"model": %s, "prompt": ["ok", "\\udfff"], "max_tokens": 1}' % M), "prompt[1]"),
    (CHAT, raw('{"model": %s, "messages": [{"role": "user", "content": "\\udc00"}]}' % M), "messages[0].content"),
    (C, raw('{"model": "\\ud800", "prompt": "x"}'), "model"),
    (C, raw('{"model": %s, "prompt": "x", "stop": ["\\ud83d"]}' % M), "stop[0]"),
    (C, raw('{"model": %s, "prompt": "x", "user": "\\ud800"}' % M), "user"),
    (CHAT, raw('{"model": %s, "messages": [{"role": "user", "content": "x"}], '
               '"chat_template_kwargs": {"\\ud800": 1}}' % M), "chat_template_kwargs"),
])
def test_lone_surrogates(http, path, body, param):
    err = assert_client_error(post(http, path, body), param)
    assert "surrogate" in err["message"]


def test_surrogate_pairs_are_text(http):
    # A valid pair (an emoji) is one character, not an error.
    assert post(http, C, raw('{"model": %s, "prompt": "\\ud83d\\ude00", "max_tokens": 1}' % M)).status_code == 200


@pytest.mark.parametrize("field, value, param", [
    ("seed", 1 << 64, "seed"),
    ("seed", -(1 << 63) - 1, "seed"),
    ("top_k", 1 << 31, "top_k"),                     # the workers' top_k is an int32
    ("top_k", -2, "top_k"),
    ("max_tokens", 1 << 32, "max_tokens"),
    ("logprobs", 1 << 31, "logprobs"),
    ("n", 1 << 40, "n"),
    ("stop_token_ids", [1 << 32], "stop_token_ids[0]"),
    ("stop_token_ids", [10**6], "stop_token_ids"),   # beyond the vocabulary, as a prompt's ids are
    ("prompt", [1 << 32], "prompt[0]"),
    ("prompt", [[1, 2], [10**6]], "prompt"),
    ("best_of", 0, "best_of"),
])
def test_integers_beyond_what_the_workers_take(http, field, value, param):
    assert_client_error(post(http, C, completion(**{field: value})), param)


def test_chat_integer_fields(http):
    assert_client_error(post(http, CHAT, chat(max_completion_tokens=1 << 32)), "max_completion_tokens")
    assert_client_error(post(http, CHAT, chat(logprobs=True, top_logprobs=1 << 31)), "top_logprobs")


@pytest.mark.parametrize("body, fragment", [
    (raw('{"model": %s, "prompt": "x", "seed": %s}' % (M, "9" * 5000)), "digits"),
    (raw('{"model": %s, "prompt": "x", "temperature": -%s}' % (M, "1" * 10000)), "digits"),
    (raw('{"model": %s, "prompt": "x", "temperature": NaN}' % M), "NaN"),
    (raw('{"model": %s, "prompt": "x", "top_p": Infinity}' % M), "Infinity"),
    (raw('{"model": %s, "prompt": "x", "top_p": -Infinity}' % M), "Infinity"),
    (raw('{"model": %s, "prompt": "x", "temperature": 1e999}' % M), "out of range"),
    (raw('{"model": %s, "prompt": "x", "logit_bias": {"5": -1e400}}' % M), "out of range"),
    (raw('{"model": %s, "prompt": "x", "temperature": %s.5}' % (M, "9" * 400)), "out of range"),
    (raw('{"model": %s, "prompt": ' % M + "[" * 100_000 + "]" * 100_000 + "}"), "nested too deeply"),
    (raw('{"model": %s, "prompt": "x", "max_tokens": 1, "max_tokens": 2}' % M), "appears twice"),
    (b'{"model": "m", "prompt": "\xff\xfe"}', "UTF-8"),
    (b'{"model": "m", "prompt": "\xed\xa0\x80"}', "UTF-8"),  # a surrogate encoded as UTF-8 bytes
    (b'\xef\xbb\xbf{"model": "m", "prompt": "x"}', "JSON"),  # a byte order mark (RFC 8259: must not be sent)
    (b"", "JSON"),
    (b"{", "JSON"),
    (b'{"model": "m", "prompt": "x"} trailing', "JSON"),
    (b"[]", "JSON object"),
    (b'"just a string"', "JSON object"),
    (b"null", "JSON object"),
    (b"42", "JSON object"),
])
def test_malformed_bodies(http, body, fragment):
    err = assert_client_error(post(http, C, body), None)
    assert fragment in err["message"], err


def test_nesting_beyond_the_limit_names_the_place(http):
    deep = 1
    for _ in range(40):
        deep = [deep]
    for path, body, where in ((CHAT, chat(chat_template_kwargs={"x": deep}), "chat_template_kwargs.x[0]"),
                              (CHAT, chat(messages=[{"role": "user", "content": "hi", "extra": deep}]),
                               "messages[0].extra[0]"),
                              (C, completion(unknown_field=deep), "unknown_field[0]")):
        err = assert_client_error(post(http, path, body))
        assert "levels deep" in err["message"] and err["param"].startswith(where), err


@pytest.mark.parametrize("name", ["tools", "messages", "add_generation_prompt", "documents", "bos_token",
                                  "raise_exception", "range"])
def test_chat_template_kwargs_cannot_replace_the_templates_arguments(http, name):
    tools = [{"type": "function", "function": {"name": "exfiltrate", "parameters": {}}}]
    err = assert_client_error(post(http, CHAT, chat(chat_template_kwargs={name: tools})), "chat_template_kwargs")
    assert name in err["message"]


def test_chat_template_kwargs_of_its_own_still_work(http):
    assert post(http, CHAT, chat(chat_template_kwargs={"enable_thinking": True})).status_code == 200


@pytest.mark.parametrize("path, body, param", [
    (C, completion(prompt=5), "prompt"),
    (C, completion(prompt={"text": "x"}), "prompt"),
    (C, completion(prompt=[]), "prompt"),
    (C, completion(prompt=[[]]), "prompt"),
    (C, completion(prompt=[-1]), "prompt[0]"),
    (C, completion(prompt=[1.5]), "prompt"),
    (C, completion(prompt=[True]), "prompt"),
    (C, completion(max_tokens="5"), "max_tokens"),
    (C, completion(max_tokens=1.0), "max_tokens"),
    (C, completion(max_tokens=True), "max_tokens"),
    (C, completion(max_tokens=None, temperature="hot"), "temperature"),
    (C, completion(temperature=[1]), "temperature"),
    (C, completion(top_p=0), "top_p"),
    (C, completion(stream="yes"), "stream"),
    (C, completion(stop=[""]), "stop"),
    (C, completion(stop=["s"] * 17), "stop"),
    (C, completion(stop="x" * 5000), "stop"),
    (C, completion(stop=["x" * 5000]), "stop[0]"),
    (C, completion(stop=[1]), "stop"),
    (C, completion(model=7), "model"),
    (C, {"prompt": "x"}, "model"),
    (C, completion(prompt=[[1]] * 65), "n"),  # more choices than a request may ask for
    (C, completion(n=2, prompt=[[1]] * 5), "n"),  # more choices than the decode worker has slots (8)
    (CHAT, chat(messages=[]), "messages"),
    (CHAT, chat(messages="hi"), "messages"),
    (CHAT, chat(messages=[None]), "messages[0]"),
    (CHAT, chat(messages=[{"role": "user", "content": {"a": 1}}]), "messages[0].content"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages[0].content[0].text"),
    (CHAT, chat(messages=[{"content": "x"}]), "messages[0].role"),
    (CHAT, chat(messages=[{"role": "user", "content": "x", "tool_calls": 5}]), "messages[0].tool_calls"),
    (CHAT, chat(chat_template_kwargs=[1]), "chat_template_kwargs"),
    (CHAT, chat(response_format={"type": "json_schema"}), "response_format.json_schema.schema"),
    (CHAT, chat(response_format={"type": "json_object"}), "response_format"),  # this tokenizer: not for llguidance
    (CHAT, chat(tool_choice="required"), "tool_choice"),
    (CHAT, chat(logprobs="yes"), "logprobs"),
])
def test_wrong_types_and_values(http, path, body, param):
    assert_client_error(post(http, path, body), param)


def test_model_and_endpoint_errors_carry_nothing_internal(http):
    assert_client_error(post(http, C, completion(model="x" * 10_000)), "model", status=404)
    r = http.get("/v1/models/%ED%A0%80")  # a lone surrogate's UTF-8 bytes in the path
    assert r.status_code == 404 and not LEAKS.search(r.text)
    r = http.post("/v1/nope", content=b"{}")
    assert r.status_code == 404 and not LEAKS.search(r.text)


def test_tiny_temperatures_and_top_p_sample_like_their_limits(http):
    """A temperature whose inverse overflows float32 once sampled garbage and reported -inf logprobs (a 500: JSON
    has no -Infinity); it is greedy now, and a top_p that rounds to 0 keeps the likeliest token, as 1e-6 does."""
    greedy = post(http, C, completion(prompt="hello there", max_tokens=4, temperature=0, logprobs=2)).json()
    for fields in ({"temperature": 1e-39}, {"temperature": 5e-324}, {"top_p": 5e-324}, {"top_p": 1e-45}):
        r = post(http, C, completion(prompt="hello there", max_tokens=4, logprobs=2, seed=7, **fields))
        assert r.status_code == 200, (fields, r.text[:300])
        body = r.json()
        assert body["choices"][0]["text"] == greedy["choices"][0]["text"], fields
        lps = body["choices"][0]["logprobs"]
        assert all(lp >= -9999.0 for lp in lps["token_logprobs"])
        assert all(lp >= -9999.0 for top in lps["top_logprobs"] for lp in top.values())


# ---------------------------------------------------------------------------------------------------------------
# Fuzzing request bodies against the running gateway

def _json_values(max_leaves: int = 6):
    scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**70), max_value=2**70)
               | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=max_leaves)


_ANY = _json_values()
_TEXT = st.text(max_size=30)
_TOKEN_IDS = st.lists(st.integers(min_value=0, max_value=1100), max_size=6)

# Values that are (mostly) valid, so that the bodies reach every stage (rendering, admission, the workers,
# streaming) and not just validation; then one field in two bodies gets a value of any JSON shape. Counts stay
# small: a valid body generates a few tokens at most.
_COMMON = {
    "n": st.integers(min_value=1, max_value=3),
    "temperature": st.floats(min_value=0, max_value=2) | st.sampled_from([1e-40, 5e-324, 1e-5]),
    "top_p": st.floats(min_value=1e-300, max_value=1) | st.sampled_from([1e-45, 5e-324]),
    "top_k": st.integers(min_value=-1, max_value=2**31 - 1),
    "seed": st.integers(min_value=-(2**63), max_value=2**64 - 1),
    "stop": _TEXT.filter(bool) | st.lists(_TEXT.filter(bool), max_size=4),
    "stop_token_ids": st.lists(st.integers(min_value=0, max_value=1023), max_size=4),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "user": _TEXT,
    "priority": st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31), 2**31, "high"]),
}
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
     "content": _TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT}), max_size=3)},
    optional={"name": _TEXT, "reasoning_content": _TEXT, "tool_call_id": _TEXT})
_COMPLETION = st.fixed_dictionaries(
    {"model": st.just(MODEL_NAME), "max_tokens": st.integers(min_value=1, max_value=4),
     "prompt": _TEXT | st.lists(_TEXT, min_size=1, max_size=3) | _TOKEN_IDS | st.lists(_TOKEN_IDS, max_size=3)},
    optional={**_COMMON, "logprobs": st.integers(min_value=0, max_value=20), "echo": st.just(False),
              "best_of": st.integers(min_value=1, max_value=3)})
_CHAT = st.fixed_dictionaries(
    {"model": st.just(MODEL_NAME), "max_tokens": st.integers(min_value=1, max_value=4),
     "messages": st.lists(_MESSAGE, min_size=1, max_size=4)},
    optional={**_COMMON, "logprobs": st.booleans(), "top_logprobs": st.integers(min_value=0, max_value=20),
              "tools": st.just([]), "tool_choice": st.just("none"), "response_format": st.just({"type": "text"}),
              "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
              "thinking_token_budget": st.integers(min_value=-1, max_value=8),
              "include_reasoning": st.booleans(),
              "prediction": st.fixed_dictionaries({"type": st.sampled_from(["content", "x"]),
                                                   "content": _TEXT | st.lists(st.fixed_dictionaries(
                                                       {"type": st.sampled_from(["text", "image"]), "text": _TEXT}),
                                                       max_size=2) | st.integers()}) | _TEXT,
              "reasoning_effort": st.sampled_from(["none", "low", "high", "max"]) | _TEXT,
              "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "tools", "messages",
                                                                      "bos_token", "x"]) | _TEXT, _ANY,
                                                      max_size=3)})
_FIELDS = sorted({*_COMMON, "model", "prompt", "messages", "max_tokens", "logprobs", "top_logprobs", "best_of",
                  "echo", "suffix", "tools", "tool_choice", "response_format", "max_completion_tokens",
                  "presence_penalty", "logit_bias", "chat_template_kwargs", "add_generation_prompt",
                  "continue_final_message", "thinking_token_budget",
                  "reasoning_effort", "include_reasoning", "prediction", "unknown"})


_CONTENT_PART = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "refusal", "input_image",
                                                                 "text"]), "text": _TEXT}, optional={"refusal": _TEXT})
_ITEM = (st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
                                "content": _TEXT | st.lists(_CONTENT_PART, max_size=3)},
                               optional={"type": st.just("message"), "id": _TEXT, "status": _TEXT})
         | st.fixed_dictionaries({"type": st.just("function_call"), "call_id": _TEXT, "name": _TEXT,
                                  "arguments": _TEXT | st.just('{"a": 1}')})
         | st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": _TEXT,
                                  "output": _TEXT | st.lists(_CONTENT_PART, max_size=2)})
         | st.fixed_dictionaries({"type": st.just("reasoning")}, optional={
             "content": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["reasoning_text", "output_text"]),
                                                        "text": _TEXT}), max_size=2),
             "summary": st.lists(st.fixed_dictionaries({"type": st.just("summary_text"), "text": _TEXT}), max_size=2)
             | _TEXT, "encrypted_content": _TEXT})
         | st.fixed_dictionaries({"type": _TEXT | st.sampled_from(["reasoning", "item_reference"])}))
_RESPONSES_BODY = st.fixed_dictionaries(
    {"model": st.just(MODEL_NAME), "max_output_tokens": st.integers(min_value=1, max_value=4),
     "input": _TEXT | st.lists(_ITEM, min_size=1, max_size=4)},
    optional={**{k: v for k, v in _COMMON.items() if k not in ("n", "stream_options")}, "instructions": _TEXT,
              "include": st.lists(st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content",
                                                   "x"]), max_size=2),
              "top_logprobs": st.integers(min_value=0, max_value=20), "store": st.booleans(),
              "previous_response_id": _TEXT, "truncation": st.sampled_from(["auto", "disabled"]),
              "text": st.fixed_dictionaries({"format": st.sampled_from([{"type": "text"}, {"type": "json_object"}])}),
              "tools": st.just([]) | st.just([{"type": "function", "name": "f"}]) | st.just([{"type": "web_search"}]),
              "tool_choice": st.sampled_from(["none", "auto", "required"]),
              "metadata": st.dictionaries(_TEXT, _TEXT, max_size=3),
              "reasoning": st.sampled_from([None, {"effort": "none"}, {"effort": "high", "summary": "auto"},
                                            {"effort": "x"}, {"summary": "detailed"}])})
_RESPONSES_FIELDS = sorted({*_COMMON, "model", "input", "instructions", "max_output_tokens", "include", "tools",
                            "tool_choice", "text", "store", "previous_response_id", "truncation", "metadata",
                            "reasoning", "background", "conversation", "unknown"})


@st.composite
def _responses_bodies(draw):
    body = dict(draw(_RESPONSES_BODY))
    if draw(st.booleans()):
        body[draw(st.sampled_from(_RESPONSES_FIELDS))] = draw(_ANY)
    first = body["input"][0] if isinstance(body.get("input"), list) and body["input"] else None
    if isinstance(first, dict) and draw(st.booleans()):
        body["input"][0] = {**first, draw(st.sampled_from(["role", "content", "type", "call_id",
                                                                      "output"])): draw(_ANY)}
    return body


@st.composite
def _bodies(draw):
    body = dict(draw(_COMPLETION | _CHAT))
    if draw(st.booleans()):
        body[draw(st.sampled_from(_FIELDS))] = draw(_ANY)
    if "messages" in body and draw(st.booleans()) and isinstance(body["messages"], list) and body["messages"]:
        body["messages"][0] = {**body["messages"][0], draw(st.sampled_from(["role", "content", "tool_calls",
                                                                            "name"])): draw(_ANY)}
    return body


def _check_answer(http, path: str, content: bytes) -> None:
    with http.stream("POST", path, content=content, headers={"content-type": "application/json"}) as r:
        text = r.read().decode("utf-8")  # a streamed answer is read to its end: it must end, too
    event(f"status {r.status_code}")
    assert r.status_code < 500, (content[:300], r.status_code, text[:500])
    assert not LEAKS.search(text), (content[:300], text[:500])
    if r.status_code >= 400:
        err = json.loads(text)["error"]
        envelope = {"message", "type"} if path == MESSAGES else {"message", "type", "param", "code"}
        assert set(err) == envelope, text[:500]
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        if path == MESSAGES:  # typed events: the message's start, its end last
            typed = [json.loads(e)["type"] for e in events]
            assert typed[0] == "message_start" and typed[-1] == "message_stop", text[-500:]
            return
        if path == RESPONSES:  # typed events, numbered, the last one the response's end
            typed = [json.loads(e) for e in events]
            assert [e["sequence_number"] for e in typed] == list(range(len(typed))), text[-500:]
            assert typed[-1]["type"] in ("response.completed", "response.incomplete"), text[-500:]
            return
        assert events[-1] == "[DONE]", text[-500:]
        for e in events[:-1]:
            json.loads(e)  # every chunk is JSON (no NaN, no -Infinity)
    else:
        json.loads(text)


SEEDS = Path(__file__).parent / "fixtures" / "fuzz"


def seeded(corpus: str, to_example):
    """Applies one hypothesis example per line of the seed corpus tests/fixtures/fuzz/<corpus>."""
    entries = [json.loads(line) for line in (SEEDS / corpus).read_text().splitlines() if line.strip()]
    assert entries, corpus

    def apply(test):
        for e in entries:
            test = to_example(e)(test)
        return test
    return apply


def _named(body: dict) -> dict:
    """A corpus body with the served model's name in place of its "MODEL"."""
    return {**body, "model": MODEL_NAME} if body.get("model") == "MODEL" else body


_FUZZ = settings(max_examples=REQUEST_EXAMPLES, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.function_scoped_fixture])


@_FUZZ
@given(path=st.sampled_from([None, None, None, C, CHAT]), body=_bodies(), mangle=st.sampled_from(
    ["none", "none", "none", "surrogate", "nan", "digits", "nest", "duplicate", "truncate", "bytes"]),
    junk=st.binary(max_size=40))
@seeded("requests.jsonl", lambda e: example(path=e["path"], body=_named(e["body"]), mangle=e["mangle"],
                                                junk=bytes.fromhex(e["junk_hex"])))
def test_fuzzed_bodies_get_an_answer_never_a_500(http, path, body, mangle, junk):
    """path None = the endpoint the body was made for."""
    path = path or (CHAT if "messages" in body else RESPONSES if "input" in body else C)
    _check_answer(http, path, _mangled(body, mangle, junk))


@_FUZZ
@given(body=_responses_bodies(), mangle=st.sampled_from(
    ["none", "none", "none", "surrogate", "nan", "nest", "duplicate", "truncate", "bytes"]),
    junk=st.binary(max_size=40))
def test_fuzzed_responses_bodies_get_an_answer_never_a_500(http, body, mangle, junk):
    """The same for /v1/responses, with bodies of its own shape: input items of every type, tools, formats, stored
    ids (mostly unknown), truncation."""
    _check_answer(http, RESPONSES, _mangled(body, mangle, junk))


_BLOCK = (st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT})
          | st.fixed_dictionaries({"type": st.just("tool_use"), "id": _TEXT, "name": st.sampled_from(["f", "g"]),
                                   "input": st.dictionaries(_TEXT, _TEXT, max_size=2)})
          | st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": _TEXT},
                                  optional={"is_error": st.booleans(), "content": _TEXT | st.lists(
                                      st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT}), max_size=2)})
          | st.fixed_dictionaries({"type": st.just("thinking"), "thinking": _TEXT, "signature": _TEXT})
          | st.fixed_dictionaries({"type": _TEXT | st.sampled_from(["image", "redacted_thinking", "document"])}))
_MESSAGES_BODY = st.fixed_dictionaries(
    {"model": st.just(MODEL_NAME), "max_tokens": st.integers(min_value=1, max_value=4),
     "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                                 "content": _TEXT | st.lists(_BLOCK, max_size=3)}),
                          min_size=1, max_size=4)},
    optional={"system": _TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT}), max_size=2),
              "stop_sequences": st.lists(_TEXT, max_size=3), "stream": st.booleans(),
              "temperature": st.floats(min_value=0, max_value=1.5), "top_p": st.floats(min_value=0, max_value=1),
              "top_k": st.integers(min_value=-1, max_value=2**31),
              "tools": st.just([]) | st.just([{"name": "f", "input_schema": {"type": "object"}}])
              | st.just([{"type": "web_search_20250305", "name": "web_search"}]),
              "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"},
                                              {"type": "tool", "name": "f"}, {"type": "tool"}]),
              "thinking": st.sampled_from([{"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"},
                                           {"type": "disabled"}, {"type": "enabled"}]),
              "output_config": st.sampled_from([{"format": {"type": "json_schema", "schema": {"type": "object"}}},
                                                {"effort": "high"}, {"format": {"type": "x"}}]),
              "metadata": st.fixed_dictionaries({"user_id": _TEXT})})
_MESSAGES_FIELDS = sorted({"model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature",
                           "top_p", "top_k", "tools", "tool_choice", "thinking", "output_config", "metadata",
                           "container", "unknown"})


@st.composite
def _messages_bodies(draw):
    body = dict(draw(_MESSAGES_BODY))
    if draw(st.booleans()):
        body[draw(st.sampled_from(_MESSAGES_FIELDS))] = draw(_ANY)
    return body


@settings(_FUZZ, max_examples=REQUEST_EXAMPLES // 2)
@given(body=_messages_bodies(), mangle=st.sampled_from(["none", "none", "none", "surrogate", "nan", "nest",
                                                         "duplicate", "truncate", "bytes"]),
       junk=st.binary(max_size=40))
def test_fuzzed_messages_bodies_get_an_answer_never_a_500(http, body, mangle, junk):
    """The same for Anthropic's /v1/messages: blocks of every type in either role, tools (a server tool too),
    thinking, output formats; errors in Anthropic's envelope."""
    _check_answer(http, MESSAGES, _mangled(body, mangle, junk))


_CONVERSATION_BODY = st.fixed_dictionaries({}, optional={
    "items": st.lists(_ITEM, max_size=4) | st.lists(_ITEM, min_size=21, max_size=22) | _ANY,
    "metadata": st.dictionaries(_TEXT, _TEXT, max_size=3) | _ANY, "unknown": _ANY})


@settings(_FUZZ, max_examples=REQUEST_EXAMPLES // 5)
@given(body=_CONVERSATION_BODY, target=st.sampled_from(["create", "items", "update"]),
       mangle=st.sampled_from(["none", "none", "surrogate", "nan", "duplicate", "truncate", "bytes"]),
       junk=st.binary(max_size=40))
def test_fuzzed_conversation_bodies_get_an_answer_never_a_500(http, body, target, mangle, junk):
    """The Conversations API's bodies: items of every type (and too many), metadata of any shape, on create, on
    adding items and on updating a conversation."""
    path = "/v1/conversations"
    if target != "create":
        made = post(http, path, {})
        assert made.status_code == 200, made.text
        path += "/" + made.json()["id"] + ("/items" if target == "items" else "")
    _check_answer(http, path, _mangled(body, mangle, junk))


_BATCH_LINE = st.one_of(
    *[st.tuples(st.just("request"), _bodies() | _responses_bodies())] * 6,
    st.tuples(st.sampled_from(["wrong url", "GET"]), _bodies()), st.tuples(st.just("json"), _ANY),
    st.tuples(st.just("text"), st.text(max_size=40).map(lambda t: t.replace("\n", " ").replace("\r", " "))))
_BATCH_CREATE = st.fixed_dictionaries({}, optional={
    "completion_window": st.sampled_from(["24h", "1h", "90s"]) | _ANY, "metadata": st.dictionaries(_TEXT, _TEXT,
                                                                                                   max_size=3) | _ANY,
    "output_expires_after": st.just({"anchor": "created_at", "seconds": 3600}) | _ANY, "unknown": _ANY})


def _batch_line(index: int, kind: str, value, ids: list[str]) -> str:
    if kind == "text":
        return value
    if kind == "json":
        return json.dumps(value)
    url = CHAT if "messages" in value else RESPONSES if "input" in value else C
    custom_id = ids[index % len(ids)]
    return json.dumps({"custom_id": custom_id, "method": "GET" if kind == "GET" else "POST",
                       "url": "/v1/elsewhere" if kind == "wrong url" else url, "body": value})


@settings(_FUZZ, max_examples=REQUEST_EXAMPLES // 10)
@given(lines=st.lists(_BATCH_LINE, max_size=4), endpoint=st.sampled_from([None, None, None, C, CHAT, RESPONSES]),
       repeat_ids=st.sampled_from([False, False, False, True]), create=st.just({}) | st.just({}) | _BATCH_CREATE)
def test_fuzzed_batches_end_and_answer_every_request(http, lines, endpoint, repeat_ids, create):
    """The Batch API on fuzzed input files (requests of every endpoint, fuzzed bodies among them, wrong urls and
    methods, repeated custom_ids, JSON that is no request, text that is no JSON) and create bodies: create answers
    (never a 500); a batch created ends — failed with its bad lines named, or completed with every request answered
    once, each answer the endpoint's own 2xx or its error envelope. endpoint None: the first line's."""
    ids = ["a"] if repeat_ids else [f"r{i}" for i in range(max(1, len(lines)))]
    encoded = [_batch_line(i, kind, value, ids) for i, (kind, value) in enumerate(lines)]
    data = "\n".join(encoded).encode()
    if endpoint is None:
        first = next((json.loads(e) for e, (kind, _) in zip(encoded, lines) if kind == "request"), None)
        endpoint = first["url"] if first else C
    up = http.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
    assert up.status_code == 200, up.text
    body = {"input_file_id": up.json()["id"], "endpoint": endpoint, "completion_window": "24h", **create}
    made = post(http, "/v1/batches", body)
    assert made.status_code < 500 and not LEAKS.search(made.text), made.text
    if made.status_code != 200:
        assert set(made.json()["error"]) == {"message", "type", "param", "code"}, made.text
        return
    batch = {}

    def ended():
        batch.update(http.get("/v1/batches/" + made.json()["id"]).json())
        return batch["status"] in ("completed", "failed")
    wait_until(ended, "the batch's end", 120, interval=0.05)
    event(f"batch {batch['status']}")
    if batch["status"] == "failed":
        assert batch["errors"]["data"] and batch["output_file_id"] is None, batch
        return
    answered = []
    for field in ("output_file_id", "error_file_id"):
        if batch[field] is not None:
            text = http.get(f"/v1/files/{batch[field]}/content").text
            for line in text.splitlines():
                answer = json.loads(line)
                response = answer["response"]
                answered.append(answer["custom_id"])
                assert (field == "output_file_id") == (200 <= response["status_code"] < 300), answer
                assert not LEAKS.search(json.dumps(response)), answer
                if field == "error_file_id":
                    assert set(response["body"]["error"]) == {"message", "type", "param", "code"}, answer
    counts = batch["request_counts"]
    assert sorted(answered) == sorted(set(answered)) and len(answered) == counts["total"], batch
    assert counts["completed"] + counts["failed"] == counts["total"], batch


@settings(_FUZZ, max_examples=REQUEST_EXAMPLES // 20)
@given(params=st.lists(_messages_bodies(), min_size=1, max_size=4),
       ids=st.sampled_from(["unique", "unique", "unique", "unique", "repeated", "bad"]),
       other=st.sampled_from([None, None, None, None, "any"]), junk=_ANY)
def test_fuzzed_message_batches_end_and_give_every_result(http, params, ids, other, junk):
    """Anthropic's Message Batches on fuzzed requests (fuzzed Messages bodies, repeated or bad custom_ids, requests
    of any shape): create answers (a 400 in Anthropic's envelope, never a 500); a batch created ends, with one
    result per request, each succeeded or errored (with the endpoint's error envelope)."""
    custom = {"unique": lambda i: f"r-{i}", "repeated": lambda i: "same", "bad": lambda i: f"r {i}"}[ids]
    requests = [{"custom_id": custom(i), "params": p} for i, p in enumerate(params)] if other is None else junk
    made = post(http, "/v1/messages/batches", {"requests": requests})
    assert made.status_code < 500 and not LEAKS.search(made.text), made.text
    event(f"create {made.status_code}")
    if made.status_code != 200:
        assert made.json()["type"] == "error" and set(made.json()["error"]) == {"type", "message"}, made.text
        return
    batch = {}

    def ended():
        batch.update(http.get("/v1/messages/batches/" + made.json()["id"]).json())
        return batch["processing_status"] == "ended"
    wait_until(ended, "the message batch's end", 120, interval=0.05)
    lines = http.get(f"/v1/messages/batches/{batch['id']}/results").text.splitlines()
    results = [json.loads(line) for line in lines]
    assert sorted(r["custom_id"] for r in results) == sorted(r["custom_id"] for r in requests), results
    for r in results:
        assert r["result"]["type"] in ("succeeded", "errored"), r
        if r["result"]["type"] == "errored":
            assert r["result"]["error"]["type"] == "error" and not LEAKS.search(json.dumps(r)), r
    counts = batch["request_counts"]
    assert counts["succeeded"] + counts["errored"] == len(requests) and counts["processing"] == 0, batch


def _mangled(body: dict, mangle: str, junk: bytes) -> bytes:
    text = json.dumps(body, ensure_ascii=True)
    if mangle == "surrogate":
        text = text.replace('"', '"\\udc80', 1)
    elif mangle == "nan":
        text = text.replace(":", ": NaN, \"x\":", 1)
    elif mangle == "digits":
        text = text.replace(":", ": %s, \"x\":" % ("7" * 6000), 1)
    elif mangle == "nest":
        text = text[:-1] + ', "deep": ' + "[" * 5000 + "]" * 5000 + "}"
    elif mangle == "duplicate":
        text = text[:-1] + ', "model": "other"}'
    elif mangle == "truncate":
        text = text[: len(text) // 2]
    content = text.encode("utf-8", "surrogatepass")
    if mangle == "bytes":
        content = content[:1] + junk + content[1:]
    return content


def test_the_server_still_answers_after_the_fuzzing(http, stack):
    # Runs after the fuzzing (pytest keeps file order): nothing it sent broke or wedged anything.
    assert http.get("/health").status_code == 200
    r = post(http, C, completion(prompt="hello there", max_tokens=3, temperature=0))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    stats = stack.wait_idle()
    assert stats.slots_leased == stats.slots_running == 0
    assert "Traceback" not in stack.log("prefill") + stack.log("decode")


# ---------------------------------------------------------------------------------------------------------------
# Fuzzing .fgm headers and tensor tables against the reader

_FGM = split_file(MODEL)  # (bytes, header) of the mini model every stack here serves
_CONFIG_KEYS = sorted(_FGM[1]["config"])
_TENSORS = sorted(_FGM[1]["tensors"])
_ENTRY_KEYS = ["dtype", "shape", "offset", "nbytes", "meta"]
_SCALE_KEYS = ["rms_norm_eps", "final_logit_softcapping", "embed_scale", "attention_scale", "ple_embed_scale",
               "ple_model_projection_scale", "ple_input_scale"]
_NUMBERS = (st.integers(min_value=-(2**64), max_value=2**64) | st.floats() | st.sampled_from(
    [0, -1, 1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 1e-300, 1e300, 5e-324, -0.0, 1e-45, 1e39]))
_FGM_VALUE = _NUMBERS | _json_values(4) | st.sampled_from(["f32", "f16", "q4g", "q8c", "q4r", "q8r", "q8g", "bf16"])


@st.composite
def _header_change(draw):
    """(where, new value): a config key, a tensor entry's field, one element of a shape, or a tensor dropped."""
    kind = draw(st.sampled_from(["config", "config", "scale", "scale", "entry", "shape", "drop", "meta"]))
    if kind == "scale":  # a float the engine multiplies by, around and inside the accepted ranges
        value = draw(st.floats(min_value=1e-40, max_value=1e40) | st.sampled_from([1e-30, 1e-6, 0.01, 1.0, 1e6]))
        return ("config", draw(st.sampled_from(_SCALE_KEYS)), None), value
    if kind == "config":
        return ("config", draw(st.sampled_from(_CONFIG_KEYS)), None), draw(_FGM_VALUE)
    name = draw(st.sampled_from(_TENSORS))
    if kind == "entry":
        return ("entry", name, draw(st.sampled_from(_ENTRY_KEYS))), draw(_FGM_VALUE)
    if kind == "shape":
        return ("shape", name, draw(st.integers(0, 3))), draw(_NUMBERS)
    if kind == "meta":
        return ("meta", name, draw(st.sampled_from(["group", "hadamard"]))), draw(_NUMBERS)
    return ("drop", name, None), None


def _apply(header: dict, change) -> None:
    (kind, name, field), value = change
    if kind == "config":
        header["config"][name] = value
    elif kind == "drop":
        del header["tensors"][name]
    elif kind == "entry":
        header["tensors"][name][field] = value
    elif kind == "shape":
        shape = header["tensors"][name]["shape"]
        shape[min(field, len(shape) - 1)] = value
    else:
        header["tensors"][name].setdefault("meta", {})[field] = value


def _finite_logits(path: Path) -> bool:
    import numpy as np

    from splitgemma.engine import Model, open_arena
    m = Model(str(path), max_context=64, chunk=16, max_batch=1, threads=1)
    logits = m.prefill(open_arena(m, 1), 0, [2, 10, 20, 30])
    return bool(np.isfinite(logits).all())


@settings(max_examples=FGM_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(changes=st.lists(_header_change(), min_size=1, max_size=3))
@seeded("fgm_headers.jsonl", lambda e: example(changes=[(tuple(where), value) for where, value in e["changes"]]))
def test_fuzzed_fgm_headers_load_or_raise_fgm_error(tmp_path_factory, changes):
    data, header = _FGM
    header = json.loads(json.dumps(header))
    for change in changes:
        try:
            _apply(header, change)
        except (KeyError, TypeError, IndexError):
            pass  # an earlier change removed or retyped what this one targets
    text = json.dumps(header, separators=(",", ":"))
    if len(text) + 12 > 2_097_216:
        return  # does not fit before the first blob (write_with_header's room): not a header this can make
    path = write_with_header(tmp_path_factory.mktemp("fgm"), data, header)
    try:
        FgmFile(str(path))
    except FgmError:
        event("refused")
        return
    event("accepted")
    # Accepted: then the engine either refuses it with a clean ValueError (a geometry it cannot run) or a forward
    # pass gives finite logits (a configuration value cannot make NaN).
    try:
        finite = _finite_logits(path)
    except ValueError:
        event("accepted, engine refused")
        return
    assert finite, changes


def test_fuzzed_tensor_bytes_of_the_small_vectors_are_refused_when_not_finite(tmp_path):
    data, header = _FGM
    entry = header["tensors"]["l2.q_norm"]
    buf = bytearray(data)
    buf[entry["offset"] + 8: entry["offset"] + 12] = struct.pack("<f", float("nan"))
    p = tmp_path / "nan.fgm"
    p.write_bytes(bytes(buf))
    with pytest.raises(FgmError, match=r"'l2.q_norm' holds a NaN or infinity at \[2\]"):
        FgmFile(str(p))


@pytest.mark.parametrize("key, value", [("rms_norm_eps", 1e-300), ("rms_norm_eps", 2.0), ("embed_scale", 1e300),
                                        ("final_logit_softcapping", 1e-300), ("attention_scale", 1e39),
                                        ("head_dim", 1 << 20), ("num_attention_heads", 1 << 16),
                                        ("vocab_size", 1 << 30), ("ple_input_scale", 0.0)])
def test_config_values_outside_their_range_are_refused(tmp_path, key, value):
    data, header = _FGM
    header = json.loads(json.dumps(header))
    header["config"][key] = value
    with pytest.raises(FgmError, match=re.escape(f"config.{key} = ") + ".* is outside the supported range"):
        FgmFile(str(write_with_header(tmp_path, data, header)))


# ---------------------------------------------------------------------------------------------------------------
# Files and options

def _run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*SPLITGEMMA, *argv], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def test_a_fifo_as_the_model_is_an_error_not_a_hang(tmp_path):
    fifo = tmp_path / "model.fgm"
    os.mkfifo(fifo)
    r = _run(["inspect", str(fifo)])
    assert r.returncode == 1 and "not a regular file" in r.stderr and "Traceback" not in r.stderr
    # The services load the model the same way; the gateway also reads the tokenizer beside it.
    for argv in (["gateway", "--model", str(fifo), "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:1",
                  "--tokenizer", str(MODEL.parent / "tokenizer.json")],
                 ["prefill", "--model", str(fifo), "--port", "0"]):
        r = _run(argv)
        assert r.returncode != 0 and "not a regular file" in r.stderr, r.stderr[-2000:]


def test_fifos_beside_the_model_are_errors_not_hangs(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    os.symlink(MODEL, folder / "model.fgm")
    os.mkfifo(folder / "tokenizer.json")
    r = _run(["gateway", "--model", str(folder / "model.fgm"), "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:1"])
    assert r.returncode != 0 and "tokenizer.json is not a regular file (a FIFO)" in r.stderr, r.stderr[-2000:]
    os.unlink(folder / "tokenizer.json")
    shutil.copy(MODEL.parent / "tokenizer.json", folder)
    os.mkfifo(folder / "template.jinja")
    r = _run(["gateway", "--model", str(folder / "model.fgm"), "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:1",
              "--chat-template", str(folder / "template.jinja")])
    assert r.returncode != 0 and "template.jinja is not a regular file (a FIFO)" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("argv", [
    ["prefill", "--model", "m.fgm", "--max-context", "2147483648"],
    ["decode", "--model", "m.fgm", "--max-context", "99999999999999999999999999999999999999999999999"],
    ["decode", "--model", "m.fgm", "--slots", "4294967296"],
    ["decode", "--model", "m.fgm", "--queue-timeout", "inf"],
    ["prefill", "--model", "m.fgm", "--chunk", "0"],
    ["prefill", "--model", "m.fgm", "--threads", "100000"],
    ["prefill", "--model", "m.fgm", "--drain-seconds", "nan"],
    ["generate", "--model", "m.fgm", "--prompt", "x", "--max-tokens", "1", "--max-context", "2147483648"],
    ["gateway", "--prefill", "a:1", "--decode", "b:1", "--port", "65536"],
    ["up", "--max-context", "-1"],
    ["up", "--port", "99999"],
])
def test_out_of_range_options_are_argparse_errors(argv):
    r = _run(argv, timeout=60)
    assert r.returncode == 2 and "error: argument" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_model_truncated_under_a_running_stack_ends_it_with_a_clear_message(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    for name in (MODEL.name, "tokenizer.json", "config.json"):
        shutil.copy(MODEL.parent / name, folder)
    model = folder / MODEL.name
    s = Stack(tmp_path, model=model, gateway_args=("--chat-template", str(TEMPLATE)))
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert post(c, C, completion(max_tokens=2)).status_code == 200
            os.truncate(model, 4096)  # in place, as `cp` over it or a converter writing into it would
            r = post(c, C, completion(prompt="hello again", max_tokens=2))
            assert r.status_code >= 500 and not LEAKS.search(r.text), r.text
        # The prefill worker read a weight past the new end first; the decode worker follows at its next step
        # or keeps serving what it still can: either way nobody dies of a signal.
        wait_until(lambda: s.procs["prefill"].poll() is not None, "the prefill worker to exit", 60)
        for name in ("prefill", "decode"):
            p = s.procs[name]
            if p.poll() is None:
                continue
            assert p.returncode == EXIT_MODEL_FILE_CHANGED, (name, p.returncode, s.log(name)[-2000:])
            assert f"the model file {model} was truncated or rewritten" in s.log(name)
    finally:
        s.stop()


def test_an_unexpected_error_is_a_500_that_says_nothing_but_the_request_id(stack, tmp_path):
    """A second gateway on the same workers whose (operator-supplied) chat template recurses forever: a fault of
    the server, not of the request, so a 500; its body names the request id and nothing else, the traceback is in
    the log under that id."""
    template = tmp_path / "recursive.jinja"
    template.write_text("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}")
    (port,) = free_ports(1)
    p = LoggedProcess([*SPLITGEMMA, "gateway", "--model", str(MODEL), "--port", str(port), "--chat-template",
                       str(template), "--prefill", stack.prefill_addr, "--decode", stack.decode_addr],
                      tmp_path / "gw.log", env=stack.env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: http_ready(url), "the second gateway", 30, watch={"gateway": p})
        r = httpx.post(url + CHAT, json=chat(), headers={"X-Request-Id": "req-boom"}, timeout=60)
        assert r.status_code == 500 and r.headers["X-Request-Id"] == "req-boom"
        assert r.json() == {"error": {"message": "internal server error (request id req-boom)",
                                      "type": "server_error", "param": None, "code": None}}
        assert httpx.post(url + C, json=completion(), timeout=60).status_code == 200  # and it goes on serving
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(20) == 0
    logged = [json.loads(line) for line in p.log().splitlines() if line.startswith("{")]
    assert any(rec.get("request_id") == "req-boom" and "RecursionError" in rec.get("exc", "") for rec in logged)


@pytest.mark.parametrize("key", _SCALE_KEYS)
def test_the_ends_of_every_accepted_range_give_finite_logits(tmp_path, key):
    data, header = _FGM
    ranges = {"rms_norm_eps": (1e-30, 1.0), "final_logit_softcapping": (1e-2, 1e6)}
    for value in ranges.get(key, (1e-6, 1e6)):
        h = json.loads(json.dumps(header))
        h["config"][key] = value
        path = write_with_header(tmp_path, data, h, f"{key}-{value}.fgm")
        assert _finite_logits(path), (key, value)
