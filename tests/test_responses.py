"""The Responses API (/v1/responses, docs/responses.md) over real processes, driven with the openai client's own
`client.responses` (whose models parse every body and event): a response is the chat completion its request means —
the same prompt tokens and the same greedy tokens as /v1/chat/completions given the equivalent messages (itself
checked against the in-process engine in test_gateway.py) — shaped as a response object or its typed event stream;
stored responses continue conversations per API key; tools, structured output, logprobs and truncation carry over;
what is not served is refused by name.

One stack (the random-weight fixture model with Gemma 4's template and tool syntax, two API keys) serves the module;
the store's bookkeeping is checked on its own at the end.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest

from splitgemma.services.gateway.conversation_store import ConversationStore
from splitgemma.services.gateway.protocol import ApiError
from splitgemma.services.gateway.response_store import ChainBroken, ResponseStore, StoreLimits
from tools.tool_fixture import TEMPLATE, model_folder

KEY, OTHER_KEY = "sk-responses-test-key-1", "sk-responses-test-key-2"
INPUT = "Tell me a story about a cat"   # the random model answers it in visible text
PING = {"type": "function", "name": "ping", "description": "Pings.",
        "parameters": {"type": "object", "properties": {"twice": {"type": "boolean"}}, "required": ["twice"]}}
CONTEXT = 512


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from test_gateway import Stack

    folder = tmp_path_factory.mktemp("responses")
    s = Stack(folder, model=model_folder(folder / "model"), worker_args=("--max-context", str(CONTEXT)),
              gateway_args=("--chat-template", str(TEMPLATE), "--api-key", KEY, "--api-key", OTHER_KEY))
    yield s
    s.stop()


def _client(stack, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(stack):
    return _client(stack)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _chat(client, model, messages, **kw):
    return client.chat.completions.create(model=model, messages=messages, temperature=0, **kw)


def test_a_response_is_the_chat_completion_it_means(client, model):
    for max_tokens in (6, 40):
        r = client.responses.create(model=model, input=INPUT, instructions="Answer briefly.",
                                    max_output_tokens=max_tokens, temperature=0)
        c = _chat(client, model, [{"role": "system", "content": "Answer briefly."},
                                  {"role": "user", "content": INPUT}], max_tokens=max_tokens)
        assert r.object == "response" and r.id.startswith("resp_") and r.model == model
        assert r.output_text == c.choices[0].message.content
        assert r.usage.input_tokens == c.usage.prompt_tokens
        assert r.usage.output_tokens == c.usage.completion_tokens
        assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
        [item] = r.output
        assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
        if c.choices[0].finish_reason == "length":
            assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
            assert item.status == "incomplete"
        else:
            assert r.status == "completed" and r.incomplete_details is None and item.status == "completed"
        assert r.instructions == "Answer briefly." and r.max_output_tokens == max_tokens and r.temperature == 0


def test_input_tokens_counts_the_prompt(client, model):
    """POST /v1/responses/input_tokens: the prompt a create request would have, tools and stored turns included."""
    # Greedy: a sampled answer of this random model may hold an ordinary token that spells a control token
    # (`<|"|>{`), which its next turn then refuses to encode as plain text.
    r = client.responses.create(model=model, input=INPUT, instructions="Be brief.", max_output_tokens=2,
                                temperature=0)
    count = client.responses.input_tokens.count(model=model, input=INPUT, instructions="Be brief.")
    assert count.object == "response.input_tokens" and count.input_tokens == r.usage.input_tokens
    with_tools = client.responses.input_tokens.count(input=INPUT, tools=[PING])   # model is optional here
    assert with_tools.input_tokens > count.input_tokens
    follow = client.responses.input_tokens.count(model=model, previous_response_id=r.id, input="And then?")
    again = client.responses.create(model=model, previous_response_id=r.id, input="And then?", max_output_tokens=2,
                                    temperature=0)
    assert follow.input_tokens == again.usage.input_tokens


def test_input_items_are_the_messages_they_name(client, model):
    """Typed items, role-only messages and content parts render exactly as the chat messages they stand for."""
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be terse."}]},
             {"role": "user", "content": "What is 2 + 2?"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "And 3 "}, {"type": "input_text",
                                                                                        "text": "+ 3?"}]}]
    r = client.responses.create(model=model, input=items, max_output_tokens=5, temperature=0)
    c = _chat(client, model, [{"role": "developer", "content": "Be terse."},
                              {"role": "user", "content": "What is 2 + 2?"},
                              {"role": "assistant", "content": "4."},
                              {"role": "user", "content": "And 3 + 3?"}], max_tokens=5)
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.output_text == c.choices[0].message.content


def test_the_stream_is_the_response_as_typed_events(client, model):
    whole = client.responses.create(model=model, input=INPUT, max_output_tokens=12, temperature=0)
    events = list(client.responses.create(model=model, input=INPUT, max_output_tokens=12, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == events[-4].text == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert len({e.item_id for e in events if hasattr(e, "item_id")}) == 1
    assert client.responses.retrieve(final.id).output_text == final.output_text   # stored as it ended
    # the client's stream helper assembles the same response (it wants response.completed: a stop string ends it)
    kw = dict(model=model, input=INPUT, max_output_tokens=12, temperature=0, extra_body={"stop": ["gaga"]})
    stopped = client.responses.create(**kw)
    assert stopped.status == "completed" and stopped.output_text
    with client.responses.stream(**kw) as stream:
        assert stream.get_final_response().output_text == stopped.output_text


def test_logprobs_are_the_chat_logprobs(client, model):
    r = client.responses.create(model=model, input=INPUT, max_output_tokens=6, temperature=0, top_logprobs=3,
                                include=["message.output_text.logprobs"])
    c = _chat(client, model, [{"role": "user", "content": INPUT}], max_tokens=6, logprobs=True, top_logprobs=3)
    got = r.output[0].content[0].logprobs
    want = c.choices[0].logprobs.content
    assert [(x.token, x.logprob, x.bytes) for x in got] == [(x.token, x.logprob, x.bytes) for x in want]
    assert [[(a.token, a.logprob) for a in x.top_logprobs] for x in got] == \
        [[(a.token, a.logprob) for a in x.top_logprobs] for x in want]
    events = list(client.responses.create(model=model, input=INPUT, max_output_tokens=6, temperature=0,
                                          top_logprobs=3, include=["message.output_text.logprobs"], stream=True))
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.token for lp in done.logprobs] == [x.token for x in got]
    assert streamed == [x.token for x in got][:len(streamed)]
    plain = client.responses.create(model=model, input=INPUT, max_output_tokens=6, temperature=0)
    assert not plain.output[0].content[0].logprobs


def test_previous_response_id_continues_the_conversation(client, model):
    first = client.responses.create(model=model, input="Name a colour.", instructions="Be brief.",
                                    max_output_tokens=6, temperature=0)
    second = client.responses.create(model=model, previous_response_id=first.id, input="And another?",
                                     max_output_tokens=6, temperature=0)
    # instructions are not carried over: the stored conversation is the items
    c = _chat(client, model, [{"role": "user", "content": "Name a colour."},
                              {"role": "assistant", "content": first.output_text},
                              {"role": "user", "content": "And another?"}], max_tokens=6)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == c.usage.prompt_tokens
    assert second.output_text == c.choices[0].message.content
    third = client.responses.create(model=model, previous_response_id=second.id, input="Thanks.",
                                    max_output_tokens=3, temperature=0)
    c3 = _chat(client, model, [{"role": "user", "content": "Name a colour."},
                               {"role": "assistant", "content": first.output_text},
                               {"role": "user", "content": "And another?"},
                               {"role": "assistant", "content": second.output_text},
                               {"role": "user", "content": "Thanks."}], max_tokens=3)
    assert third.usage.input_tokens == c3.usage.prompt_tokens

    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    items = client.responses.input_items.list(second.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "And another?")]
    page = client.responses.input_items.list(second.id, order="asc", limit=1)
    assert len(page.data) == 1 and not page.has_more


def test_stored_responses_are_per_key_and_deletable(stack, client, model):
    r = client.responses.create(model=model, input=INPUT, max_output_tokens=2, temperature=0)
    other = _client(stack, OTHER_KEY)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        other.responses.create(model=model, previous_response_id=r.id, input="x", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(r.id)
    assert client.responses.retrieve(r.id).id == r.id
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model=model, input=INPUT, max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.AuthenticationError):
        _client(stack, "sk-wrong").responses.create(model=model, input=INPUT, max_output_tokens=2)


def test_structured_output_follows_the_schema(client, model):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    for stream in (False, True):
        kw = dict(model=model, input=INPUT, max_output_tokens=40, temperature=0,
                  text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
        if stream:
            events = list(client.responses.create(stream=True, **kw))
            text = events[-1].response.output_text
            assert events[-1].response.text.format.type == "json_schema"
        else:
            text = client.responses.create(**kw).output_text
        jsonschema.validate(json.loads(text), schema)

    class Answer(pydantic.BaseModel):   # the client's own helper: a model's schema in, an instance out
        ok: bool

    parsed = client.responses.parse(model=model, input=INPUT, max_output_tokens=40, temperature=0, text_format=Answer)
    assert isinstance(parsed.output_parsed, Answer)


def test_forced_function_calls_and_their_outputs(client, model):
    r = client.responses.create(model=model, input=INPUT, tools=[PING], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    calls = [i for i in r.output if i.type == "function_call"]
    assert len(calls) == 1 and r.status == "completed"
    call = calls[0]
    assert call.name == "ping" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), PING["parameters"])
    # the same request as chat: the same call
    c = _chat(client, model, [{"role": "user", "content": INPUT}], max_tokens=60, parallel_tool_calls=False,
              tools=[{"type": "function", "function": {k: v for k, v in PING.items() if k != "type"}}],
              tool_choice="required")
    assert [(t.function.name, t.function.arguments) for t in c.choices[0].message.tool_calls] == \
        [(call.name, call.arguments)]
    assert r.usage.input_tokens == c.usage.prompt_tokens
    # the call's output, sent back as an item after the stored call: the prompt chat renders for the same turns
    follow = client.responses.create(model=model, previous_response_id=r.id, tools=[PING], max_output_tokens=4,
                                     temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                            "output": '{"pong": true}'}])
    tool_calls = [{"id": call.call_id, "type": "function",
                   "function": {"name": call.name, "arguments": call.arguments}}]
    c2 = _chat(client, model, [{"role": "user", "content": INPUT},
                               {"role": "assistant", "content": None, "tool_calls": tool_calls},
                               {"role": "tool", "tool_call_id": call.call_id, "content": '{"pong": true}'}],
               max_tokens=4, tools=[{"type": "function", "function": {k: v for k, v in PING.items() if k != "type"}}])
    assert follow.usage.input_tokens == c2.usage.prompt_tokens
    # streamed: the call as its own item, its arguments as deltas
    events = list(client.responses.create(model=model, input=INPUT, tools=[PING], max_output_tokens=60,
                                          tool_choice={"type": "function", "name": "ping"},
                                          parallel_tool_calls=False, temperature=0, stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["function_call"] and added[0].name == "ping"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert args == done.arguments == call.arguments
    assert events[-1].type == "response.completed"
    assert [i.type for i in events[-1].response.output] == ["function_call"]


def test_truncation_auto_drops_the_oldest_turns(client, model):
    long = "one two three four five six seven eight nine ten " * 12
    turns = []
    for k in range(8):
        turns += [{"role": "user", "content": f"{k}: {long}"}, {"role": "assistant", "content": "ok"}]
    turns.append({"role": "user", "content": "last question"})
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input=turns, max_output_tokens=4, temperature=0)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "input"
    r = client.responses.create(model=model, input=turns, max_output_tokens=4, temperature=0, truncation="auto",
                                instructions="Be brief.")
    assert r.truncation == "auto" and r.usage.input_tokens + 4 <= CONTEXT
    # what was kept: the instructions and the newest turns that fit, from a user turn on
    kept = None
    for start in range(0, len(turns), 2):
        c = _chat(client, model, [{"role": "system", "content": "Be brief."}, *turns[start:]], max_tokens=4) \
            if _fits(client, model, turns[start:]) else None
        if c is not None:
            kept = c
            break
    assert kept is not None and r.usage.input_tokens == kept.usage.prompt_tokens
    assert r.output_text == kept.choices[0].message.content


def test_truncation_keeps_the_opening_instructions():
    from splitgemma.services.gateway.responses import truncated
    for head in ("system", "developer"):
        conv = [{"role": head, "content": "rules"}, {"role": "user", "content": "a"}, {"role": "assistant",
                "content": "b"}, {"role": "tool", "content": "c"}, {"role": "user", "content": "d"}]
        assert truncated(conv) == [conv[0], conv[4]]
        assert truncated([conv[0], conv[4]]) is None
    assert truncated([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == \
        [{"role": "user", "content": "b"}]


def _fits(client, model, turns) -> bool:
    messages = [{"role": "system", "content": "Be brief."}, *turns]
    r = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"), json={"model": model, "messages": messages},
                   headers={"Authorization": f"Bearer {KEY}"})
    return r.json()["count"] + 4 <= CONTEXT


@pytest.mark.parametrize("extra, param", [
    (dict(background=True, store=False), "background"),
    (dict(tools=[{"type": "web_search"}]), "tools[0].type"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]),
     "input[0].content[0].type"),
    (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input[0].type"),
    (dict(input=[{"type": "function_call", "name": "ping", "arguments": "{}"}]), "input[0].call_id"),
    (dict(reasoning={"effort": "high", "summary": "auto", "context": "all_turns"}), "reasoning.context"),
    (dict(reasoning={"effort": "high", "mode": "pro"}), "reasoning.mode"),
    (dict(include=["no.such.thing"]), "include"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[PING], tool_choice={"type": "function", "name": "pong"}), "tool_choice"),
    (dict(text={"format": {"type": "json_schema", "name": "x"}}), "text.format.schema"),
    (dict(metadata={f"k{i}": "v" for i in range(17)}), "metadata"),
    (dict(conversation="conv_1", previous_response_id="resp_1"), "conversation"),
    (dict(extra_body={"n": 2}), "n"),
    (dict(extra_body={"max_tokens": 5}), "max_tokens"),
    (dict(extra_body={"response_format": {"type": "json_object"}}), "response_format"),
    (dict(max_output_tokens=0), "max_output_tokens"),
])
def test_what_is_not_served_is_refused_by_name(client, model, extra, param):
    kw = dict(model=model, input=INPUT, max_output_tokens=2)
    kw.update(extra)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**kw)
    assert e.value.body["param"] == param, e.value.body


# ---------------------------------------------------------------------------------------------------------------
# Background responses

def _until_done(client, rid: str, timeout: float = 60.0):
    import time

    end = time.monotonic() + timeout
    while True:
        r = client.responses.retrieve(rid)
        if r.status not in ("queued", "in_progress") or time.monotonic() > end:
            return r
        time.sleep(0.02)


def test_a_background_response_is_the_response_it_would_have_been(client, model):
    kw = dict(model=model, input=INPUT, instructions="Answer briefly.", max_output_tokens=40, temperature=0)
    queued = client.responses.create(**kw, background=True)
    assert queued.status in ("queued", "in_progress") and queued.background is True and queued.output == []
    done = _until_done(client, queued.id)
    now = client.responses.create(**kw)
    assert done.id == queued.id and done.background is True and now.background is False
    assert done.status == now.status and done.output_text == now.output_text
    assert done.usage.input_tokens == now.usage.input_tokens and done.usage.output_tokens == now.usage.output_tokens
    assert [i.content[0].text for i in client.responses.input_items.list(done.id).data] == [INPUT]
    nxt = client.responses.create(model=model, previous_response_id=done.id, input="And then?", max_output_tokens=4)
    assert nxt.status in ("completed", "incomplete")


def _events(stream) -> list[dict]:
    return [e.model_dump() for e in stream]


def test_a_background_stream_can_be_left_and_read_again(client, model):
    kw = dict(model=model, input=INPUT, max_output_tokens=30, temperature=0, background=True)
    events = _events(client.responses.create(**kw, stream=True))
    assert [e["type"] for e in events[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert events[0]["response"]["status"] == "queued" and events[0]["response"]["background"] is True
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    rid = events[0]["response"]["id"]
    assert _events(client.responses.retrieve(rid, stream=True, starting_after=5)) == events[6:]
    assert _events(client.responses.retrieve(rid, stream=True)) == events
    # Leaving the stream cancels nothing: the response runs to its end.
    stream = client.responses.create(**{**kw, "max_output_tokens": 200}, stream=True)
    first = [next(iter(stream)) for _ in range(4)]
    stream.close()
    done = _until_done(client, first[0].response.id)
    assert done.status in ("completed", "incomplete") and done.usage.output_tokens > 0
    whole = client.responses.create(**{**kw, "max_output_tokens": 200, "background": False})
    assert done.output_text == whole.output_text


def test_cancelling_a_background_response_frees_its_slot(stack, client, model):
    kw = dict(model=model, input=INPUT, max_output_tokens=CONTEXT - 40, temperature=0, background=True,
              extra_body={"ignore_eos": True})
    r = client.responses.create(**kw)
    while client.responses.retrieve(r.id).status == "queued":
        pass
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and cancelled.usage.output_tokens < CONTEXT - 40
    assert client.responses.retrieve(r.id).status == "cancelled"
    assert client.responses.cancel(r.id).status == "cancelled"   # idempotent
    stats = stack.wait_idle()
    assert stats.slots_leased == stats.slots_running == 0
    # A running one can be deleted (cancelled first), at any stage: even as its slot is being granted (the gateway
    # gives back a grant that comes after its caller left: Pipelines._abandon_reserve) no slot stays leased.
    for _ in range(12):
        gone = client.responses.create(**kw)
        client.responses.delete(gone.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone.id)
    assert stack.wait_idle(timeout=5).slots_leased == 0
    # A response not made in the background cannot be cancelled.
    plain = client.responses.create(model=model, input=INPUT, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(plain.id)
    assert e.value.body["param"] == "response_id"
    with pytest.raises(openai.BadRequestError) as e:
        list(client.responses.retrieve(plain.id, stream=True))
    assert e.value.body["param"] == "stream"


def test_a_running_background_response_cannot_be_continued_yet(client, model):
    r = client.responses.create(model=model, input=INPUT, max_output_tokens=CONTEXT - 40, temperature=0,
                                background=True, extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, previous_response_id=r.id, input="x", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    client.responses.cancel(r.id)


# ---------------------------------------------------------------------------------------------------------------
# Conversations

def test_a_conversation_carries_its_turns(stack, client, model):
    system = {"role": "system", "content": "Answer briefly."}
    conv = client.conversations.create(items=[system], metadata={"topic": "cats"})
    assert conv.object == "conversation" and conv.id.startswith("conv_") and conv.metadata == {"topic": "cats"}
    r1 = client.responses.create(model=model, conversation=conv.id, input=INPUT, max_output_tokens=6, temperature=0)
    c1 = _chat(client, model, [system, {"role": "user", "content": INPUT}], max_tokens=6)
    assert r1.conversation.id == conv.id and r1.output_text == c1.choices[0].message.content
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [(i.type, i.role) for i in items] == [("message", "system"), ("message", "user"), ("message", "assistant")]
    assert items[2].id == r1.output[0].id
    # The next response reads the conversation before its input: the chat of all the turns.
    r2 = client.responses.create(model=model, conversation={"id": conv.id}, input="And then?", max_output_tokens=6,
                                 temperature=0)
    c2 = _chat(client, model, [system, {"role": "user", "content": INPUT},
                               {"role": "assistant", "content": r1.output_text},
                               {"role": "user", "content": "And then?"}], max_tokens=6)
    assert r2.output_text == c2.choices[0].message.content and r2.usage.input_tokens == c2.usage.prompt_tokens
    assert len(client.conversations.items.list(conv.id).data) == 5
    # Items added, read and removed by the client; metadata replaced.
    [note] = client.conversations.items.create(conv.id, items=[{"role": "user", "content": "Note."}]).data
    assert client.conversations.items.retrieve(note.id, conversation_id=conv.id).id == note.id
    assert client.conversations.items.delete(note.id, conversation_id=conv.id).id == conv.id
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(note.id, conversation_id=conv.id)
    assert client.conversations.update(conv.id, metadata={"topic": "dogs"}).metadata == {"topic": "dogs"}
    assert client.conversations.retrieve(conv.id).metadata == {"topic": "dogs"}
    # Another key's: not found, to read or to continue.
    other = _client(stack, OTHER_KEY)
    with pytest.raises(openai.NotFoundError):
        other.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=model, conversation=conv.id, input="x", max_output_tokens=2)
    kept = httpx.get(stack.url + "/metrics").text
    assert 'splitgemma_gateway_kept{kind="conversations"}' in kept and 'kind="background_responses"' in kept
    assert client.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)


def test_conversation_refusals_name_the_parameter(client):
    for kw, param in ((dict(items=[{"role": "user", "content": "x"}] * 21), "items"),
                      (dict(items=[{"type": "item_reference", "id": "x"}]), "items[0].type"),
                      (dict(metadata={f"k{i}": "v" for i in range(17)}), "metadata"),
                      (dict(metadata={"k": 1}), "metadata")):
        with pytest.raises(openai.BadRequestError) as e:
            client.conversations.create(**kw)
        assert e.value.body["param"] == param, (kw, e.value.body)
    conv = client.conversations.create()
    assert client.conversations.update(conv.id, metadata=None).metadata == {}
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.delete("msg_nope", conversation_id=conv.id)


def test_background_runs_are_bounded():
    from splitgemma.services.gateway.background import BackgroundRuns

    with pytest.raises(ApiError) as e:
        BackgroundRuns(0).check_room()
    assert e.value.status == 429 and e.value.retry_after


def test_unknown_ids_are_404(client, model):
    for call in (lambda: client.responses.retrieve("resp_nope"), lambda: client.responses.delete("resp_nope"),
                 lambda: client.responses.input_items.list("resp_nope"),
                 lambda: client.responses.create(model=model, previous_response_id="resp_nope", input="x")):
        with pytest.raises(openai.NotFoundError):
            call()


# ---------------------------------------------------------------------------------------------------------------
# The store on its own


def _response(rid: str, text: str = "x") -> dict:
    return {"id": rid, "output": [{"id": "msg_" + rid, "type": "message", "role": "assistant",
                                   "content": [{"type": "output_text", "text": text}]}]}


def _items(text: str) -> list[dict]:
    return [{"id": "in_" + text, "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]


def test_store_chains_evicts_and_isolates():
    store = ResponseStore(StoreLimits(entries=3, megabytes=1))
    store.put("a", _response("r1"), _items("q1"), None)
    store.put("a", _response("r2"), _items("q2"), "r1")
    sizes = store.get("r1", "a").size + store.get("r2", "a").size
    conv, size = store.conversation("r2", "a")
    assert [i["id"] for i in conv] == ["in_q1", "msg_r1", "in_q2", "msg_r2"] and size == sizes
    assert store.conversation("r2", "b") is None and store.get("r1", "b") is None
    store.put("b", _response("r3"), _items("q3"), None)
    store.put("b", _response("r4"), _items("q4"), None)
    # 4 entries > 3: the least recently used goes; reading r2's conversation made r1 the more recent of the two
    assert len(store) == 3 and store.get("r2", "a") is None
    store.put("a", _response("r5"), _items("q5"), "r1")     # r1 goes now: r5 continues a conversation half gone
    with pytest.raises(ChainBroken):
        store.conversation("r5", "a")
    assert store.delete("r3", "b") and not store.delete("r3", "b") and not store.delete("r4", "a")
    big = ResponseStore(StoreLimits(entries=100, megabytes=1))
    text = "y" * (300 << 10)
    for k in range(5):
        assert big.put("", _response(f"b{k}", text), [], None)
    assert len(big) == 3       # 300 KB each in 1 MB
    assert not big.put("", _response("huge", "z" * (2 << 20)), [], None)
    off = ResponseStore(StoreLimits(entries=0))
    assert not off.enabled and not off.put("", _response("r"), [], None) and len(off) == 0


def test_conversations_are_bounded_and_isolated():
    store = ConversationStore(StoreLimits(entries=2, megabytes=1))
    store.create("c1", "a", {}, _items("q1"))
    store.create("c2", "b", {}, [])
    assert store.items("c1", "b") is None and not store.add("c1", "b", _items("x"))
    assert store.add("c1", "a", _items("q2"))     # c1 used last: c2 goes first
    store.create("c3", "a", {}, [])
    assert store.get("c2", "b") is None and [i["id"] for i in store.items("c1", "a")[0]] == ["in_q1", "in_q2"]
    assert store.remove_item("c1", "a", "in_q1") and not store.remove_item("c1", "a", "in_q1")
    items, size = store.items("c1", "a")
    assert [i["id"] for i in items] == ["in_q2"] and size == len(json.dumps(items[0], ensure_ascii=False))
    # A conversation that would outgrow the whole store refuses the items; the one written to is never evicted.
    with pytest.raises(ApiError) as e:
        store.add("c1", "a", [{"id": "big", "text": "z" * (2 << 20)}])
    assert e.value.param == "items" and store.get("c1", "a") is not None
    assert store.delete("c3", "a") and not store.delete("c3", "a")
    with pytest.raises(ApiError):
        ConversationStore(StoreLimits(entries=0)).create("c", "a", {}, [])


def test_a_worker_lost_mid_stream_fails_the_response(tmp_path):
    """The decode worker killed while a response streams: the stream ends with `error` and response.failed (what the
    client's own event models read), and nothing is stored."""
    from test_gateway import Stack

    s = Stack(tmp_path, model=model_folder(tmp_path / "model"), worker_args=("--max-context", "4096"),
              gateway_args=("--chat-template", str(TEMPLATE)))
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        events = []
        with client.responses.create(model=model, input=INPUT, max_output_tokens=4000, temperature=0,
                                     stream=True) as stream:
            for event in stream:
                events.append(event)
                if len(events) == 6:
                    s.kill("decode")
        assert [e.type for e in events[-2:]] == ["error", "response.failed"]
        failed = events[-1].response
        assert failed.status == "failed" and failed.error.code == "server_error" and failed.usage is None
        assert events[-2].message == failed.error.message
        assert [e.sequence_number for e in events] == list(range(len(events)))
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(failed.id)
    finally:
        s.stop()
