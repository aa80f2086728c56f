"""Anthropic's Messages API (services/gateway/messages.py, docs/messages.md), through Anthropic's own Python client.

The reference is the chat pipeline the request means, on the same stack: for greedy requests the message's text,
tool calls and usage equal chat completions' answer to the equivalent chat request (prefill: vLLM's
continue_final_message, which tests/test_surface.py holds to the raw completion of transformers' cut). The client
checks the shapes (its models parse every body and event; its stream accumulator needs the events in Anthropic's
order). Thinking is read by the same splitter as chat's (tests/test_reasoning.py); here its blocks are checked on
the renderer, fed the decode worker's events for a known output.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import anthropic
import httpx
import jsonschema
import pytest

from splitgemma.serving.detokenize import TextStream
from splitgemma.services.gateway.messages import MessagesRenderer, MessagesRequest, chat_request
from splitgemma.services.gateway.reasoning import ReasoningFormat, plan_reasoning
from splitgemma.v1 import serving_pb2 as pb
from tools.tool_fixture import TEMPLATE, WEATHER, chat_tokenizer, gemma4_stack

MODEL = "mini-e2b-tame"
UNIT = {"name": "pick_unit", "description": "Picks a unit.",
        "input_schema": {"type": "object", "required": ["unit"], "additionalProperties": False,
                         "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}
ASK = [{"role": "user", "content": "What's the weather in Tokyo?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = gemma4_stack(tmp_path_factory.mktemp("messages"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack):
    return anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0, timeout=60)


def _create(client, **kw):
    return client.messages.create(model=MODEL, extra_body={**GREEDY, **kw.pop("extra_body", {})}, **kw)


def _chat(stack, messages, **kw):
    return stack.client().chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def _plain(message) -> dict:
    return message.model_dump(exclude={"id"}, exclude_none=True)


# ---------------------------------------------------------------------------------------------------------------
# Text

def test_text_answer_and_usage_are_chats(stack, client):
    system = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Be kind."}]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": [{"type": "text", "text": "Why 2+2?"},
                                             {"type": "text", "text": " Thanks"}]}]
    m = _create(client, max_tokens=10, system=system, messages=messages)
    chat = _chat(stack, [{"role": "system", "content": "You are terse.\n\nBe kind."}, messages[0], messages[1],
                         {"role": "user", "content": messages[2]["content"]}], max_tokens=10)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    u = m.usage
    assert u.input_tokens + u.cache_read_input_tokens == chat.usage.prompt_tokens
    assert u.output_tokens == chat.usage.completion_tokens and u.cache_creation_input_tokens == 0
    # Two user messages in a row are one turn, as Anthropic combines them.
    split = _create(client, max_tokens=10, system=system,
                    messages=[*messages[:2], {"role": "user", "content": "Why 2+2?"},
                              {"role": "user", "content": " Thanks"}])
    assert split.content[0].text == m.content[0].text


def test_stream_accumulates_to_the_body(client):
    kw = dict(max_tokens=12, messages=[{"role": "user", "content": "Hello!"}])
    body = _create(client, **kw)
    with client.messages.stream(model=MODEL, extra_body=GREEDY, **kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert _plain(final) == _plain(body)
    raw = [e for e in kinds if e not in ("text", "thinking", "input_json", "signature", "citation")]
    assert raw[0] == "message_start" and raw[-2:] == ["message_delta", "message_stop"]
    assert raw[1:-2] == ["content_block_start", *["content_block_delta"] * (len(raw) - 5), "content_block_stop"]


def test_stop_sequence_ends_the_answer(client):
    free = _create(client, max_tokens=16, messages=[{"role": "user", "content": "Hello!"}]).content[0].text
    at = len(free) - len(free.lstrip())
    assert at < len(free) - 1, f"the fixture's answer should hold text: {free!r}"
    stop = free[at:at + 2]
    for stream in (False, True):
        kw = dict(max_tokens=16, messages=[{"role": "user", "content": "Hello!"}], stop_sequences=["zz-none", stop])
        if stream:
            with client.messages.stream(model=MODEL, extra_body=GREEDY, **kw) as s:
                m = s.get_final_message()
        else:
            m = _create(client, **kw)
        assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
        assert "".join(b.text for b in m.content) == free[:free.index(stop)]


def test_last_assistant_message_is_continued(stack, client):
    messages = [*ASK, {"role": "assistant", "content": "It is"}]
    m = _create(client, max_tokens=8, messages=messages)
    chat = _chat(stack, messages, max_tokens=8,
                 extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert "".join(b.text for b in m.content) == chat.choices[0].message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens


# ---------------------------------------------------------------------------------------------------------------
# Tools

def _call_of(chat) -> tuple[str, dict]:
    [call] = chat.choices[0].message.tool_calls
    return call.function.name, json.loads(call.function.arguments)


def test_tool_use_is_chats_call(stack, client):
    for choice, chat_choice in (({"type": "any"}, "required"),
                                ({"type": "any", "disable_parallel_tool_use": True}, "required"),
                                ({"type": "tool", "name": "pick_unit", "disable_parallel_tool_use": True},
                                 {"type": "function", "function": {"name": "pick_unit"}})):
        m = _create(client, max_tokens=40, messages=ASK, tools=[UNIT], tool_choice=choice)
        chat = _chat(stack, ASK, max_tokens=40, tools=[{"type": "function", "function": {
            "name": UNIT["name"], "description": UNIT["description"], "parameters": UNIT["input_schema"]}}],
            tool_choice=chat_choice, parallel_tool_calls=choice.get("disable_parallel_tool_use") is not True)
        name, arguments = _call_of(chat)
        uses = [b for b in m.content if b.type == "tool_use"]
        assert [(u.name, u.input) for u in uses] == [(name, arguments)]
        jsonschema.validate(uses[0].input, UNIT["input_schema"])
        assert uses[0].id.startswith("toolu_")
        assert m.stop_reason == {"tool_calls": "tool_use", "length": "max_tokens"}[chat.choices[0].finish_reason]
        if not choice.get("disable_parallel_tool_use"):
            continue  # the fixture goes on calling until max_tokens cuts a call: the stream has told of it by then
        assert m.stop_reason == "tool_use", "one call, and the answer ends with it"
        with client.messages.stream(model=MODEL, extra_body=GREEDY, max_tokens=40, messages=ASK, tools=[UNIT],
                                    tool_choice=choice) as s:
            streamed = s.get_final_message()
        assert [b.model_dump(exclude={"id"}) for b in streamed.content] == \
            [b.model_dump(exclude={"id"}) for b in m.content]
        assert streamed.stop_reason == m.stop_reason


def test_tool_results_go_back_as_chats_tool_messages(stack, client):
    """A tool_use and its tool_result (with text after it) are the chat's call and tool message: the same prompt."""
    tool = {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}
    messages = [*ASK,
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": tool["name"], "input": {"location": "Tokyo, JP"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1",
                     "content": [{"type": "text", "text": "15 C, clear"}]},
                    {"type": "text", "text": "Thanks"}]}]
    chat_messages = [*ASK,
                     {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}], "tool_calls": [
                         {"id": "toolu_1", "type": "function", "function": {
                             "name": tool["name"], "arguments": json.dumps({"location": "Tokyo, JP"})}}]},
                     {"role": "tool", "tool_call_id": "toolu_1", "name": tool["name"], "content": "15 C, clear"},
                     {"role": "user", "content": [{"type": "text", "text": "Thanks"}]}]
    chat = _chat(stack, chat_messages, max_tokens=6, tools=[{"type": "function", "function": {
        "name": tool["name"], "description": tool["description"], "parameters": tool["input_schema"]}}])
    counted = client.messages.count_tokens(model=MODEL, messages=messages, tools=[tool])
    assert counted.input_tokens == chat.usage.prompt_tokens
    m = _create(client, max_tokens=6, messages=messages, tools=[tool], tool_choice={"type": "none"})
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens < chat.usage.prompt_tokens, \
        "tool_choice none leaves the tools out of the prompt, as chat does"
    assert client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens == \
        _chat(stack, ASK, max_tokens=1).usage.prompt_tokens


# ---------------------------------------------------------------------------------------------------------------
# Thinking

def test_thinking_turns_the_templates_thinking_on(stack, client):
    plain = client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    chat = _chat(stack, ASK, max_tokens=1, reasoning_effort="medium").usage.prompt_tokens
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}):
        counted = client.messages.count_tokens(model=MODEL, messages=ASK, thinking=thinking).input_tokens
        assert counted == chat > plain
    assert client.messages.count_tokens(model=MODEL, messages=ASK, thinking={"type": "disabled"}).input_tokens \
        == plain
    m = _create(client, max_tokens=1025, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024},
                stop_sequences=["a", "e", "\n"])
    assert m.usage.output_tokens_details.thinking_tokens == 0 and m.stop_reason in ("stop_sequence", "end_turn")


def test_the_context_may_end_the_answer_before_max_tokens(stack, client):
    """As Anthropic's API: max_tokens beyond what the context leaves is no error; the answer stops where the context
    ends, with stop_reason model_context_window_exceeded (chat answers 400 context_length_exceeded)."""
    context = httpx.get(stack.url + "/v1/models").json()["data"][0]["max_model_len"]

    def count(words: int) -> int:
        return client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hello! " * words}]) \
            .input_tokens

    one, per = count(1), (count(101) - count(1)) / 100
    messages = [{"role": "user", "content": "Hello! " * int(1 + (context - 20 - one) / per)}]
    n = client.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    assert context - 40 < n < context
    m = _create(client, max_tokens=context, messages=messages, extra_body={"top_k": 1})
    assert m.stop_reason == "model_context_window_exceeded" and m.usage.output_tokens == context - n
    with pytest.raises(Exception, match="maximum context length"):
        _chat(stack, messages, max_tokens=context)


def _events(tok, raw: str) -> list[pb.GenerateEvent]:
    """The decode worker's events for the output `raw` (control tokens as their ids), one token each, special tokens'
    text kept (as it sends them for a model with a thought channel)."""
    stream = TextStream(tok, skip_special_tokens=False)
    ids = tok.encode(raw, add_special_tokens=False).ids
    events = [pb.GenerateEvent(tokens=[pb.Token(token_id=i, text=stream.push(i)[0])], completion_tokens=k + 1)
              for k, i in enumerate(ids)]
    events[-1].tokens[0].text += stream.flush()
    events[-1].finish_reason = pb.FINISH_REASON_STOP
    events[-1].stop_token_id = tok.token_to_id("<turn|>")
    return events


def _frames(frames: list[str]) -> list[dict]:
    out = []
    for frame in frames:
        kind, data = frame.split("\n")[:2]
        body = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {body['type']}"
        out.append(body)
    return out


@pytest.mark.parametrize("display", [None, "omitted"])
def test_a_thought_is_a_thinking_block(display):
    tok = chat_tokenizer()
    fmt = ReasoningFormat.of(tok, TEMPLATE.read_text())
    thinking = {"type": "enabled", "budget_tokens": 1024, **({"display": display} if display else {})}
    req = MessagesRequest.model_validate({"model": MODEL, "max_tokens": 2048, "messages": ASK, "thinking": thinking})
    chat, _ = chat_request(req, effort_if_adaptive=True)
    assert chat.reasoning_effort == "medium" and chat.thinking_token_budget == 1024  # the budget bounds the thought
    gw = SimpleNamespace(config=SimpleNamespace(model_name=MODEL))
    thought = "celsius"
    raw = f"<|channel>thought\n{thought}<channel|>It is clear"

    def renderer():
        return MessagesRenderer(gw, "msg_x", req, None, plan_reasoning(chat, fmt, False, "thinking"))

    body = renderer()
    for e in _events(tok, raw):
        body.add(0, e)
    shown = thought if display is None else ""
    message = body.body()
    assert message["content"] == [{"type": "thinking", "thinking": shown, "signature": ""},
                                  {"type": "text", "text": "It is clear"}]
    assert message["stop_reason"] == "end_turn" and message["usage"]["output_tokens_details"]["thinking_tokens"] > 0

    streamed = renderer()
    frames = _frames(streamed.sse_start() + [f for e in _events(tok, raw) for f in streamed.sse_event(0, e)]
                     + streamed.sse_end())
    kinds = [(f["type"], f.get("content_block", f.get("delta", {})).get("type")) for f in frames]
    assert kinds[:3] == [("message_start", None), ("ping", None), ("content_block_start", "thinking")]
    assert kinds[-2:] == [("message_delta", None), ("message_stop", None)]
    blocks: dict[int, dict] = {}
    for f in frames:
        if f["type"] == "content_block_start":
            blocks[f["index"]] = dict(f["content_block"])
        elif f["type"] == "content_block_delta":
            delta = f["delta"]
            key = {"thinking_delta": "thinking", "text_delta": "text", "signature_delta": "signature"}[delta["type"]]
            blocks[f["index"]][key] += delta[key]
    assert [blocks[i] for i in sorted(blocks)] == message["content"]
    assert frames[-2]["usage"] == message["usage"]


def test_anthropics_client_lists_the_model(stack, client):
    [info] = client.models.list().data
    assert info.id == MODEL and info.type == "model" and info.display_name == MODEL and info.lifecycle == "active"
    assert int(info.created_at.timestamp()) == stack.client().models.retrieve(MODEL).created
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("other")


# ---------------------------------------------------------------------------------------------------------------
# Errors, in Anthropic's envelope

def _refused(client, error: type, **kw) -> dict:
    with pytest.raises(error) as e:
        client.messages.create(model=kw.pop("model", MODEL), **kw)
    body = e.value.body
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["request_id"]
    return body["error"]


def test_refusals_name_the_parameter(client):
    cases = [
        (dict(max_tokens=4, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
         "messages[0].content[0].type"),
        (dict(max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "tool_use", "id": "t", "name": "x", "input": {}}]}]), "messages[0].content[0].type"),
        (dict(max_tokens=4, messages=ASK, tools=[{"type": "web_search_20250305", "name": "web_search"}]),
         "tools[0].type"),
        (dict(max_tokens=1024, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024}),
         "thinking.budget_tokens"),
        (dict(max_tokens=2048, messages=ASK, thinking={"type": "enabled", "budget_tokens": 100}),
         "thinking.budget_tokens"),
        (dict(max_tokens=4, messages=ASK, tools=[UNIT], tool_choice={"type": "tool"}), "tool_choice.name"),
        (dict(max_tokens=4, messages=ASK, tools=[UNIT], tool_choice={"type": "tool", "name": "nope"}),
         "tool_choice"),
        (dict(max_tokens=4, messages=ASK, tools=[{**UNIT, "input_schema": {"type": "string"}}]),
         "tools[0].input_schema"),
        (dict(max_tokens=4, messages=ASK, extra_body={"container": "c1"}), "container"),
        (dict(max_tokens=4, messages=ASK, extra_body={"temperature": 1.5}), "temperature"),
        (dict(max_tokens=4, messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "pick_unit", "input": {}}]}], tools=[UNIT]), "messages"),
        (dict(max_tokens=0, messages=ASK), "max_tokens"),
        (dict(max_tokens=4, messages=[]), "messages"),
    ]
    for kw, param in cases:
        err = _refused(client, anthropic.BadRequestError, **kw)
        assert err["type"] == "invalid_request_error" and param in err["message"], (kw, err)
    err = _refused(client, anthropic.NotFoundError, model="other", max_tokens=4, messages=ASK)
    assert err["type"] == "not_found_error" and "other" in err["message"]


def test_http_errors_under_messages_are_anthropics(stack):
    missing = httpx.post(stack.url + "/v1/messages", json={"model": MODEL, "messages": ASK})
    assert missing.status_code == 400 and missing.json()["error"] == {
        "type": "invalid_request_error", "message": "missing required parameter: 'max_tokens'"}
    for r, status, kind in ((httpx.get(stack.url + "/v1/messages"), 405, "invalid_request_error"),
                            (httpx.post(stack.url + "/v1/messages/nope", json={}), 404, "not_found_error"),
                            (httpx.post(stack.url + "/v1/messages", content=b"{"), 400, "invalid_request_error")):
        assert r.status_code == status and r.json()["type"] == "error" and r.json()["error"]["type"] == kind, r.text
    # OpenAI's paths keep OpenAI's envelope.
    assert set(httpx.post(stack.url + "/v1/chat/completions", json={}).json()["error"]) == \
        {"message", "type", "param", "code"}
