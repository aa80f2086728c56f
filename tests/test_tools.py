"""Tool calling (docs/tools.md): Gemma 4's call syntax parsed into OpenAI calls (whole and streamed, split anywhere),
the grammars that admit exactly well-formed calls (checked with llguidance on the fixture tokenizer, by accepting and
refusing outputs and by random walks under the mask), the renders of tool conversations against transformers', and
the API over real processes with the openai client.

The constrained end-to-end tests (tool_choice required / named on the random-weight model) are in
tests/test_tools_constrained.py: they need the workers to enforce SamplingParams.constraint.
"""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitgemma.serving.chat_template import ChatTemplate, special_token_strings
from splitgemma.serving.tool_calls import (CALL_CLOSE, CALL_OPEN, STRING_DELIM, GemmaCallParser, MarkerIds,
                                           ToolSyntaxError, collect, gemma_to_json, gemma_tools_lark,
                                           json_convention_lark, json_convention_schema, parse_gemma_output,
                                           parse_json_convention, render_gemma_value)
from splitgemma.services.gateway.protocol import ApiError, ChatCompletionRequest, parse_request
from splitgemma.services.gateway.tools import ToolFormat, plan_tools, template_messages, tool_message
from tools.tool_fixture import (EVENT, FIX, GET, TEMPLATE, TOOLS, accepts, chat_tokenizer, gemma4_stack,
                                ll_tokenizer, openai_tools, sample, schema_of)

D = STRING_DELIM
CALL = f"{CALL_OPEN}call:get_current_weather{{location:{D}Tokyo, JP{D},unit:{D}celsius{D}}}{CALL_CLOSE}"
EVENT_CALL = (f"{CALL_OPEN}call:create_event{{attendees:[{D}ann{D},{D}bo{D}],hours:1.5,place:{{floor:-2,"
              f"room:{D}A{D}}},private:false,title:{D}sync{D}}}{CALL_CLOSE}")


# ---------------------------------------------------------------------------------------------------------------
# The syntax

@pytest.mark.parametrize("gemma, value", [
    ("{}", {}),
    (f"{{location:{D}Tokyo, JP{D},unit:{D}celsius{D}}}", {"location": "Tokyo, JP", "unit": "celsius"}),
    (f"{{s:{D}a \"quoted\" \\ back\nline\t<|x <tool_call|>{D}}}", {"s": 'a "quoted" \\ back\nline\t<|x <tool_call|>'}),
    ("{n:-3,x:1.5e-3,z:0,t:true,f:false,u:null}", {"n": -3, "x": 1.5e-3, "z": 0, "t": True, "f": False, "u": None}),
    (f"{{o:{{k:[1,[],{{}},{D}{D}]}},l:[]}}", {"o": {"k": [1, [], {}, ""]}, "l": []}),
    ("{ a : 1 , b: [ 2 , 3 ] }", {"a": 1, "b": [2, 3]}),                       # spaces the model may add
    (f"{{{D}two words{D}:1}}", {"two words": 1}),                                 # a quoted key
])
def test_gemma_values_become_json(gemma, value):
    out = gemma_to_json(gemma)
    assert json.loads(out) == value


@pytest.mark.parametrize("gemma", [
    "{a:1.}", "{a:.5}", "{a:1..2}", "{a:-}", "{a:01}", "{a:Tokyo}", "{a:1,}", "{a:[1,]}", "{,}", "{a 1}",
    "{a:1", f"{{a:{D}open}}", "[1]", "{a:1}}", "{a:tru}", "{:1}",
])
def test_malformed_values_are_refused(gemma):
    with pytest.raises(ToolSyntaxError):
        gemma_to_json(gemma)


_KEYS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)
_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12).filter(lambda s: D not in s)
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | _TEXT
                     | st.floats(allow_nan=False, allow_infinity=False, width=32),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS, inner, max_size=4),
                     max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(_KEYS, _JSON, max_size=5))
def test_rendered_arguments_parse_back(args):
    """What the chat template writes for past calls (render_gemma_value is its format_argument) parses back into the
    same arguments."""
    assert json.loads(gemma_to_json(render_gemma_value(args))) == args


def test_output_with_content_and_calls():
    msg = parse_gemma_output("Let me check." + CALL + EVENT_CALL)
    assert msg.content == "Let me check." and not msg.incomplete
    assert [c.name for c in msg.calls] == ["get_current_weather", "create_event"]
    assert json.loads(msg.calls[0].arguments) == {"location": "Tokyo, JP", "unit": "celsius"}
    assert json.loads(msg.calls[1].arguments)["place"] == {"floor": -2, "room": "A"}
    assert parse_gemma_output("no call here").calls == []


@pytest.mark.parametrize("text", [
    f"{CALL_OPEN}call:get_current_weather{{a:1}}",                     # never closed (cut by max_tokens)
    f"{CALL_OPEN}call:get weather{{a:1}}{CALL_CLOSE}",                # not a name
    f"{CALL_OPEN}cal:x{{a:1}}{CALL_CLOSE}",
    f"{CALL_OPEN}call:x{{a:1}}tail{CALL_CLOSE}",
    f"{CALL_OPEN}call:x{{a:bare}}{CALL_CLOSE}",
])
def test_malformed_calls_go_to_content(text):
    msg = parse_gemma_output("Hi " + text)
    assert msg.calls == [] and msg.content == "Hi " + text


def test_special_tokens_are_hidden_from_content_only():
    msg = parse_gemma_output(f"a<eos>b<|channel>c{CALL}", hide=["<eos>", "<|channel>"])
    assert msg.content == "abc" and msg.calls[0].name == "get_current_weather"


def _events_split(text: str, cuts: list[int], hide=()):
    p = GemmaCallParser(hide)
    events, last = [], 0
    for c in [*cuts, len(text)]:
        events += p.push(text[last:c])
        last = c
    return events + p.finish()


def test_streaming_split_at_every_boundary():
    text = "Sure <eos>thing: " + CALL + " " + EVENT_CALL + "<tool_call"
    whole = collect(_events_split(text, [], hide=["<eos>"]))
    for cut in range(len(text) + 1):
        got = collect(_events_split(text, [cut], hide=["<eos>"]))
        assert got == whole, cut
    one_by_one = _events_split(text, list(range(1, len(text))), hide=["<eos>"])
    assert collect(one_by_one) == whole
    # Each call's name comes once, before its arguments, which arrive in pieces.
    assert [e for e in one_by_one if e[0] == "call"] == [("call", "get_current_weather"), ("call", "create_event")]
    assert sum(1 for e in one_by_one if e[0] == "args") > 10
    assert whole.content == "Sure thing:  <tool_call"


def test_json_convention_parse():
    call = {"tool_calls": [{"name": "get", "arguments": {"what": "x"}}]}
    msg = parse_json_convention(" " + json.dumps(call))
    assert msg.content == "" and msg.calls[0].name == "get" and json.loads(msg.calls[0].arguments) == {"what": "x"}
    for text in ["plain", '{"tool_calls": []}', '{"tool_calls": [{"name": 1, "arguments": {}}]}', '{"x": 1}', "{"]:
        assert parse_json_convention(text).calls == [] and parse_json_convention(text).content == text


# ---------------------------------------------------------------------------------------------------------------
# The grammars, with llguidance on the fixture tokenizer

@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


@pytest.fixture(scope="module")
def lltok():
    return ll_tokenizer()


@pytest.fixture(scope="module")
def markers(tok):
    return MarkerIds.from_tokenizer(tok)


RESPONSE = "<|tool_response>"


def test_required_grammar_accepts_well_formed_calls(lltok, markers):
    g = gemma_tools_lark(TOOLS, markers, required=True, parallel=True)
    for text in [CALL, EVENT_CALL, CALL + EVENT_CALL,
                 f"{CALL_OPEN}call:get_current_weather{{location:{D}Tokyo{D}}}{CALL_CLOSE}",
                 f"{CALL_OPEN}call:get_current_weather{{location: {D}T{D}, unit: {D}fahrenheit{D}}}{CALL_CLOSE}",
                 f"{CALL_OPEN}call:get{{what:{D}{D}}}{CALL_CLOSE}",
                 f"{CALL_OPEN}call:create_event{{hours:-1,title:{D}a{D}}}{CALL_CLOSE}"]:
        assert accepts(lltok, g, text + RESPONSE), text


@pytest.mark.parametrize("text", [
    "Hello",                                                                               # no call
    f"Hi{CALL}",                                                                           # text first
    f"{CALL_OPEN}call:get_time{{}}{CALL_CLOSE}",                                           # not declared
    f"{CALL_OPEN}call:get_current_weather{{unit:{D}celsius{D}}}{CALL_CLOSE}",              # required missing
    f"{CALL_OPEN}call:get_current_weather{{location:{D}T{D},unit:{D}kelvin{D}}}{CALL_CLOSE}",   # not in enum
    f"{CALL_OPEN}call:get_current_weather{{unit:{D}celsius{D},location:{D}T{D}}}{CALL_CLOSE}",  # not sorted
    f"{CALL_OPEN}call:get_current_weather{{location:{D}T{D},x:1}}{CALL_CLOSE}",              # undeclared key
    f"{CALL_OPEN}call:get_current_weather{{location:15}}{CALL_CLOSE}",                       # number for string
    f"{CALL_OPEN}call:create_event{{hours:1.,title:{D}a{D}}}{CALL_CLOSE}",                  # trailing dot
    f"{CALL_OPEN}call:create_event{{hours:1,place:{{floor:1.5,room:{D}a{D}}},title:{D}a{D}}}{CALL_CLOSE}",  # int
    f"{CALL_OPEN}call:create_event{{hours:1,private:yes,title:{D}a{D}}}{CALL_CLOSE}",        # bool
    f'{CALL_OPEN}call:get{{what:"x"}}{CALL_CLOSE}',                                          # JSON quotes
    f"{CALL_OPEN}call:get{{what:{D}a<|\"|>b{D}}}{CALL_CLOSE}",                                # delimiter spelled out
])
def test_required_grammar_refuses_malformed_calls(lltok, markers, text):
    g = gemma_tools_lark(TOOLS, markers, required=True, parallel=True)
    assert not accepts(lltok, g, text + RESPONSE)


def test_one_call_unless_parallel(lltok, markers):
    assert not accepts(lltok, gemma_tools_lark(TOOLS, markers, required=True, parallel=False),
                       CALL + EVENT_CALL + RESPONSE)
    assert accepts(lltok, gemma_tools_lark(TOOLS, markers, required=True, parallel=False), CALL + RESPONSE)


def test_auto_grammar_admits_text_or_calls(lltok, markers):
    g = gemma_tools_lark(TOOLS, markers, required=False, parallel=True)
    assert accepts(lltok, g, "Hello, it is 15 C.")
    assert accepts(lltok, g, "Hello! How can I help?" + CALL + RESPONSE)
    assert not accepts(lltok, g, f"Let me see.{CALL_OPEN}call:get{{what:15}}{CALL_CLOSE}")


def _closing(tok) -> set[int]:
    ids = {tok.token_to_id(t) for t in (CALL_CLOSE, D, RESPONSE, "<eos>")}
    return ids | {i for s in ("}", "]", ",") for i in tok.encode("\n" + s, add_special_tokens=False).ids[1:]}


@pytest.mark.parametrize("tools, parallel", [(TOOLS, True), (TOOLS, False), ([EVENT], False), ([GET], True)])
def test_random_walks_under_the_mask_are_valid_calls(tok, lltok, markers, tools, parallel):
    """Whatever the sampler picks among the allowed tokens, the output parses into calls to the given tools with
    schema-valid arguments; every tool is reached."""
    g = gemma_tools_lark(tools, markers, required=True, parallel=parallel)
    rng = random.Random(12)
    seen = set()
    for _ in range(40):
        ids = sample(lltok, g, rng, _closing(tok))
        assert ids[-1] == markers.tool_response   # the stop token that ends the calls (its text is not sent)
        text = tok.decode(ids[:-1], skip_special_tokens=False)
        msg = parse_gemma_output(text)
        assert msg.calls and msg.content == "", text
        assert parallel or len(msg.calls) == 1
        for c in msg.calls:
            jsonschema.validate(json.loads(c.arguments), next(t["parameters"] for t in tools if t["name"] == c.name))
            seen.add(c.name)
    assert seen == {t["name"] for t in tools}


def test_json_convention_grammars(tok, lltok):
    rng = random.Random(3)
    schema = json.dumps(json_convention_schema(TOOLS, parallel=True))
    import llguidance
    g = llguidance.LLMatcher.grammar_from_json_schema(schema)
    prefer = {i for s in ("}", "]", '"') for i in tok.encode("\n" + s, add_special_tokens=False).ids[1:]}
    for _ in range(15):
        text = tok.decode(sample(lltok, g, rng, prefer, max_steps=1500), skip_special_tokens=False)
        msg = parse_json_convention(text)
        assert msg.calls, text
        for c in msg.calls:
            jsonschema.validate(json.loads(c.arguments), schema_of(c.name))
    auto = json_convention_lark(TOOLS, parallel=True)
    assert accepts(lltok, auto, "It is 15 C.")
    assert accepts(lltok, auto, json.dumps({"tool_calls": [{"name": "get", "arguments": {"what": "a"}}]}))
    assert not accepts(lltok, auto, json.dumps({"tool_calls": [{"name": "nope", "arguments": {}}]}))


# ---------------------------------------------------------------------------------------------------------------
# The prompt: tool conversations render as transformers renders them

def _renders():
    return json.loads((FIX / "tools" / "renders.json").read_text())["cases"]


def _request(case: dict, **extra) -> tuple[ChatCompletionRequest, dict]:
    body = {"model": "m", "messages": case["messages"], "tools": case["tools"], **extra}
    return parse_request(ChatCompletionRequest, json.dumps(body).encode())


@pytest.mark.parametrize("name", sorted(_renders()))
def test_tool_conversations_render_as_transformers(name, tok):
    case = _renders()[name]
    template = ChatTemplate(TEMPLATE.read_text(), tok, special_token_strings(tok))
    req, raw = _request(case)
    plan = plan_tools(req, ToolFormat.of(tok, template.source))
    assert plan.native
    messages, tools = template_messages(req, raw["messages"], True, plan)
    assert template.render(messages, tools=tools) == case["text"]


def test_tool_choice_none_leaves_the_tools_out(tok):
    case = _renders()["round_trip"]
    template = ChatTemplate(TEMPLATE.read_text(), tok, special_token_strings(tok))
    req, raw = _request(case, tool_choice="none")
    assert plan_tools(req, ToolFormat.of(tok, template.source)) is None
    messages, tools = template_messages(req, raw["messages"], True, None)
    text = template.render(messages, tools=tools)
    assert "<|tool>" not in text and text.endswith(case["text"].split("<turn|>\n", 1)[1])


def test_json_convention_prompt(tok):
    """A template without the native syntax (here a minimal one) gets the tools as text, past calls as JSON answers
    and results as user turns."""
    case = _renders()["parallel"]
    req, raw = _request(case)
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    plan = plan_tools(req, ToolFormat.of(tok, template))
    assert not plan.native
    messages, tools = template_messages(req, raw["messages"], False, plan)
    assert tools is None and [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant",
                                                               "user"]
    assert '"name": "create_event"' in messages[0]["content"]
    assert json.loads(messages[2]["content"])["tool_calls"][1]["arguments"]["place"] == {"room": "A", "floor": -2}
    assert messages[3]["content"] == "Result of get_current_weather:\n15 C\n\nResult of create_event:\nbooked"
    assert messages[5]["content"] == "Thanks"


def test_answers_map_to_openai_messages(tok):
    req, _ = _request(_renders()["declarations"])
    plan = plan_tools(req, ToolFormat.of(tok, TEMPLATE.read_text()))
    msg, finish = tool_message(plan, "Checking." + CALL, "stop")
    assert finish == "tool_calls" and msg["content"] == "Checking."
    call = msg["tool_calls"][0]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_current_weather"
    assert json.loads(call["function"]["arguments"]) == {"location": "Tokyo, JP", "unit": "celsius"}
    msg, finish = tool_message(plan, CALL, "stop")
    assert msg["content"] is None
    msg, finish = tool_message(plan, CALL[:-3], "length")   # cut off: no call, the text stays
    assert finish == "length" and "tool_calls" not in msg and msg["content"] == CALL[:-3]


def _assemble(deltas: list[dict], finish: str):
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    state = ChatCompletionStreamState()
    for i, delta in enumerate([{"role": "assistant", "content": ""}, *deltas, {}]):
        state.handle_chunk(ChatCompletionChunk.model_validate({
            "id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish if i == len(deltas) + 1 else None}]}))
    return state.get_final_completion().choices[0]


def test_streamed_deltas_assemble_with_the_openai_client(tok):
    """The chunks of a streamed answer, split at every character, assemble (with the openai package's own
    accumulator) into the same message as the whole answer."""
    req, _ = _request(_renders()["declarations"])
    plan = plan_tools(req, ToolFormat.of(tok, TEMPLATE.read_text()))
    text = "Checking." + CALL + EVENT_CALL
    stream = plan.stream()
    deltas = [d for ch in text for d in stream.push(ch)] + stream.finish()
    done = _assemble(deltas, stream.finish_reason("stop"))
    whole, _ = tool_message(plan, text, "stop")
    assert done.finish_reason == "tool_calls" and done.message.content == whole["content"] == "Checking."
    calls = done.message.tool_calls
    assert [c.function.name for c in calls] == [c["function"]["name"] for c in whole["tool_calls"]]
    assert [json.loads(c.function.arguments) for c in calls] == \
        [json.loads(c["function"]["arguments"]) for c in whole["tool_calls"]]
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": "required"}, "tool_choice"),                                            # no tools
    ({"tools": openai_tools(), "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": openai_tools(), "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": openai_tools([GET, GET])}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "a", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": openai_tools(), "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_tool_request_validation(extra, param):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}
    with pytest.raises(ApiError) as e:
        parse_request(ChatCompletionRequest, json.dumps(body).encode())
    assert e.value.status == 400 and e.value.param == param


# ---------------------------------------------------------------------------------------------------------------
# Over real processes


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = gemma4_stack(tmp_path_factory.mktemp("tools"))
    yield s
    s.stop()


def test_tools_over_the_api(stack, tok):
    """A request with tools is served (the random model answers whatever it answers: text or a call, either well
    formed); its prompt is the transformers render, token for token."""
    client = stack.client()
    case = _renders()["round_trip"]
    r = client.chat.completions.create(model=stack_model(stack), messages=case["messages"], tools=case["tools"],
                                       max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens == len(tok.encode(case["text"], add_special_tokens=False).ids)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
    none = client.chat.completions.create(model=stack_model(stack), messages=case["messages"], tools=case["tools"],
                                          tool_choice="none", max_tokens=2, temperature=0)
    assert none.usage.prompt_tokens < r.usage.prompt_tokens and none.choices[0].message.tool_calls is None
    chunks = list(client.chat.completions.create(model=stack_model(stack), messages=case["messages"],
                                                 tools=case["tools"], max_tokens=8, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_bad_tool_requests_over_the_api(stack):
    client = stack.client()
    bad_args = [{"role": "user", "content": "x"},
                {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                      "function": {"name": "get", "arguments": "{not json"}}]}]
    deep = [bad_args[0], {**bad_args[1], "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get", "arguments": '{"a": ' + "[" * 5000 + "]" * 5000 + "}"}}]}]
    arguments = "messages[1].tool_calls[0].function.arguments"
    for kwargs, param in [(dict(messages=bad_args, tools=openai_tools()), arguments),
                          (dict(messages=deep, tools=openai_tools()), arguments),
                          (dict(messages=bad_args[:1], tool_choice="required"), "tool_choice"),
                          (dict(messages=bad_args[:1], tools=[{"type": "function", "function": {
                              "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "foo"}}}}}]),
                           "tools")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=stack_model(stack), max_tokens=2, **kwargs)
        assert e.value.body["param"] == param
    r = httpx.get(stack.url + "/ready")
    assert r.status_code == 200


def stack_model(stack) -> str:
    return stack.client().models.list().data[0].id


def test_json_convention_streams(tok):
    req, _ = _request(_renders()["declarations"])
    plan = plan_tools(req, ToolFormat.of(tok, "{{ messages }}"))
    answer = json.dumps({"tool_calls": [{"name": "get", "arguments": {"what": "x"}},
                                        {"name": "create_event", "arguments": {"title": "t", "hours": 2}}]})
    for text, calls in [("  " + answer, 2), ("It is 15 C.", 0), ("{not a call", 0)]:
        stream = plan.stream()
        deltas = [d for ch in text for d in stream.push(ch)] + stream.finish()
        done = _assemble(deltas, stream.finish_reason("stop"))
        assert len(done.message.tool_calls or []) == calls
        if calls:
            assert done.finish_reason == "tool_calls" and not done.message.content
            assert json.loads(done.message.tool_calls[1].function.arguments) == {"title": "t", "hours": 2}
        else:
            assert done.finish_reason == "stop" and done.message.content == text
