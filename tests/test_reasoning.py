"""Thinking (docs/reasoning.md): Gemma 4's thought channel read apart from the answer, on chat and the Responses API.

The references are ones this code did not write: Gemma 4's own chat template (a past turn's thought, replayed by the
template, reads back as the same thought), llguidance (the grammar that admits a thought before the answer), and
over the API the raw text of the same request through /v1/completions (special tokens kept, the thought-then-JSON
grammar written here in plain Lark), split at its markers with string operations. The random-weight fixture model
never thinks by itself: a logit bias on `<|channel>` opens a thought, one on `<channel|>` ends it after a few
tokens, and a JSON schema holds the answer after it.
"""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import numpy as np
import openai
import pytest

from splitgemma.serving.chat_template import ChatTemplate, special_token_strings
from splitgemma.serving.detokenize import TextStream
from splitgemma.serving.grammar import Grammars
from splitgemma.serving.thinking import CHANNEL_CLOSE, CHANNEL_NAME, CHANNEL_OPEN, ThoughtMarkers, ThoughtSplitter
from splitgemma.services.gateway.protocol import ApiError, ChatCompletionRequest
from splitgemma.services.gateway.reasoning import (ANY_ANSWER, ReasoningFormat, ReasoningPlan, plan_reasoning,
                                                    template_kwargs)
from splitgemma.services.gateway.responses import chat_messages, input_items
from splitgemma.v1 import serving_pb2 as pb
from tools.tool_fixture import (TEMPLATE, accepts, chat_tokenizer, gemma4_stack, ll_tokenizer, matcher,
                                openai_tools, tokenizer_json)

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
# The gateway's JSON options (splitgemma/serving/grammar.py), for the oracle's grammar to admit the same answers.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MESSAGES = [{"role": "user", "content": "Is the sky blue?"}]
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


@pytest.fixture(scope="module")
def markers(tok):
    return ThoughtMarkers.from_tokenizer(tok, TEMPLATE.read_text())


def _template(tok) -> ChatTemplate:
    return ChatTemplate(TEMPLATE.read_text(), tok, special_token_strings(tok))


def _split(raw: str) -> tuple[str | None, str]:
    """The reference split of a raw output (special tokens as text): (thought, answer), thought None when the
    output opens none."""
    if not raw.startswith(CHANNEL_OPEN):
        return None, raw
    body, closed, answer = raw[len(CHANNEL_OPEN):].partition(CHANNEL_CLOSE)
    if body.startswith(CHANNEL_NAME):
        body = body[len(CHANNEL_NAME):]
    elif CHANNEL_NAME.startswith(body):
        body = ""
    if closed and body.endswith("\n"):
        body = body[:-1]
    return body, answer


def _tokens(tok, raw: str, stops=()) -> list[tuple[int, str]]:
    """(id, text) per token of `raw` (markers as their special tokens) as the decode worker sends them for a request
    with a thought channel: decoded incrementally, special tokens' text kept."""
    stream = TextStream(tok, stops=stops, skip_special_tokens=False)
    ids = tok.encode(raw, add_special_tokens=False).ids
    out = [(i, stream.push(i)[0]) for i in ids]
    out[-1] = (out[-1][0], out[-1][1] + stream.flush())
    return out


def _run(markers, tokens, cuts: list[int]) -> tuple[str, str, ThoughtSplitter]:
    """Feeds `tokens` to a splitter in events cut at `cuts`; (thought, answer, splitter)."""
    s = ThoughtSplitter(markers)
    thought = answer = ""
    bounds = [0, *cuts, len(tokens)]
    for a, b in zip(bounds, bounds[1:]):
        for token_id, text in tokens[a:b]:
            for kind, piece in s.push(token_id, text):
                thought, answer = (thought + piece, answer) if kind == "thought" else (thought, answer + piece)
    for _, piece in s.finish():
        thought += piece
    return thought, answer, s


@pytest.mark.parametrize("raw", [
    "<|channel>thought\nThe sky is blue because\nof scattering.\n<channel|>Yes, it is blue.",
    "<|channel>thought\n<channel|>Yes.",                       # an empty thought
    "<|channel>thought<channel|>Yes.",                         # only the name
    "<|channel>Hmm, blue.\n\n<channel|>\nYes.",                # no name line; a blank line kept, one newline dropped
    "<|channel>thought\nstill thinking\n",                     # cut off inside the thought: nothing dropped
    "<|channel>tho",                                           # cut off inside the name
    "Yes, it is blue.",                                        # no thought
])
def test_the_split_is_the_markers_split(tok, markers, raw):
    tokens = _tokens(tok, raw)
    raw = "".join(text for _, text in tokens)  # as this tokenizer spells it
    want_thought, want_answer = _split(raw)
    for cut in range(len(tokens) + 1):  # every way of cutting the output into two events
        thought, answer, s = _run(markers, tokens, [cut])
        assert answer == want_answer
        assert s.seen == (want_thought is not None)
        if want_thought is not None:
            assert thought == want_thought
            closed = CHANNEL_CLOSE in raw
            end = raw.index(CHANNEL_CLOSE) + len(CHANNEL_CLOSE) if closed else len(raw)
            assert s.tokens == len(tok.encode(raw[:end], add_special_tokens=False).ids)
    rng = random.Random(3)
    cuts = sorted(rng.sample(range(len(tokens) + 1), min(5, len(tokens))))
    assert _run(markers, tokens, cuts)[:2] == (want_thought or "", want_answer)


def test_text_held_back_for_a_stop_string_stays_with_its_part(tok, markers):
    """The decode worker holds back text that may begin a stop string and releases it with a later token — here
    the marker after it: it still belongs to the part before the marker."""
    raw = "Sure.\n<|channel>thought\nthe sky\n<channel|>\nYes, it is."
    tokens = _tokens(tok, raw, stops=["\nnever"])
    assert any(i == markers.close and text == "\n" + CHANNEL_CLOSE for i, text in tokens)  # released with it
    decoded = "".join(text for _, text in tokens)
    thought, answer, _ = _run(markers, tokens, [])
    want_thought, want_answer = _split(decoded[decoded.index(CHANNEL_OPEN):])
    assert thought == want_thought == "the sky"
    assert answer == decoded[:decoded.index(CHANNEL_OPEN)] + want_answer


def test_a_spelled_marker_is_text(tok, markers):
    """Ordinary tokens whose text spells a marker open nothing: the split is on token ids."""
    ordinary = tok.encode("a", add_special_tokens=False).ids[-1]
    spelled = [(ordinary, CHANNEL_OPEN), (ordinary, "x"), (ordinary, CHANNEL_CLOSE)]
    thought, answer, s = _run(markers, spelled, [])
    assert not s.seen and thought == "" and answer == CHANNEL_OPEN + "x" + CHANNEL_CLOSE


def test_special_tokens_are_hidden_from_the_parts_that_hide_them(tok, markers):
    """A request that skips special tokens gets none in its thought, nor in its answer unless the tool parser reads
    the answer (it drops them itself)."""
    quote = tok.token_to_id('<|"|>')
    raw = '<|channel>thought\nha<|"|>ky<channel|>se<|"|>at'
    for hide_answer, answer in (({quote: '<|"|>'}, "seat"), ({}, 'se<|"|>at')):
        s = ThoughtSplitter(markers, {quote: '<|"|>'}, hide_answer)
        pieces = [p for i, t in _tokens(tok, raw) for p in s.push(i, t)]
        assert "".join(p for k, p in pieces if k == "thought") == "haky"
        assert "".join(p for k, p in pieces if k == "answer") == answer
        assert s.tokens == len(tok.encode(raw[:raw.index("se")], add_special_tokens=False).ids)


def test_a_replayed_thought_reads_back_the_same(tok, markers):
    """Gemma 4's template writes a past turn's thought before its calls; that text, as the model would write it,
    splits back into the same thought."""
    thought = "The user wants the weather.\nCall the tool."
    messages = [{"role": "user", "content": "Weather in Tokyo?"},
                {"role": "assistant", "reasoning_content": thought,
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "get", "arguments": {"what": "Tokyo"}}}]}]
    rendered = _template(tok).render(messages, add_generation_prompt=False,
                                                        tools=openai_tools())
    turn = rendered[rendered.index("<|turn>model\n") + len("<|turn>model\n"):]
    block = turn[:turn.index(CHANNEL_CLOSE) + len(CHANNEL_CLOSE)]
    got, answer, s = _run(markers, _tokens(tok, block), [])
    assert (got, answer) == (thought, "") and s.seen


def test_the_format_is_gemma_4s_only(tok):
    fmt = ReasoningFormat.of(tok, TEMPLATE.read_text())
    assert fmt.markers is not None and fmt.can_think
    other = ReasoningFormat.of(tok, "{{ messages }}")
    assert other.markers is None and not other.can_think


def _chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **kw})


@pytest.mark.parametrize("kw, thinks", [
    ({}, False), ({"reasoning_effort": "none"}, False), ({"reasoning_effort": "low"}, True),
    ({"reasoning_effort": "max"}, True), ({"chat_template_kwargs": {"enable_thinking": True}}, True),
    ({"chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": "high"}, True),
])
def test_thinking_is_turned_on(tok, kw, thinks):
    fmt = ReasoningFormat.of(tok, TEMPLATE.read_text())
    plan = plan_reasoning(_chat(**kw), fmt, False)
    assert plan.thinks == thinks
    assert bool(template_kwargs(_chat(**kw), fmt).get("enable_thinking")) == thinks
    ids = _template(tok).encode(MESSAGES, add_generation_prompt=True,
                                                   **template_kwargs(_chat(**kw), fmt))
    assert (tok.token_to_id("<|think|>") in ids) == thinks


@pytest.mark.parametrize("kw, template, param", [
    ({"reasoning_effort": "high"}, "{{ messages }}", "reasoning_effort"),   # a model that cannot think
    ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}, None, "reasoning_effort"),
    ({"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}}, None, "reasoning_effort"),
])
def test_thinking_that_cannot_be_is_refused(tok, kw, template, param):
    fmt = ReasoningFormat.of(tok, template or TEMPLATE.read_text())
    with pytest.raises(ApiError) as e:
        plan_reasoning(_chat(**kw), fmt, False)
    assert e.value.status == 400 and e.value.param == param
    assert plan_reasoning(_chat(reasoning_effort="none"), ReasoningFormat.of(tok, "{{ messages }}"), False) is None


# ---------------------------------------------------------------------------------------------------------------
# The grammar: a thought, then what the constraint admits


@pytest.fixture(scope="module")
def grammars(tmp_path_factory, tok):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(tokenizer_json())
    return Grammars(path, [tok.token_to_id("<eos>")], tok.get_vocab_size())


@pytest.mark.parametrize("constraint, good, bad", [
    (pb.Constraint(json_schema=json.dumps(SCHEMA)), '{"ok": true}', '{"ok": 1}'),
    (pb.Constraint(json_object=True), '{"a": [1]}', "[1]"),
    (pb.Constraint(regex="ye+s"), "yeees", "no"),
    (pb.Constraint(lark='start: "yes" | "no"'), "no", "maybe"),
])
def test_a_thinking_constraint_admits_a_thought_first(grammars, markers, constraint, good, bad):
    lltok = ll_tokenizer()
    thinking = pb.Constraint()
    thinking.CopyFrom(constraint)
    thinking.thought.open, thinking.thought.close = markers.open, markers.close
    grammar = grammars.check(thinking)
    thought = "<|channel>thought\nlet me see: {no} [json] here.\n<channel|>"
    assert accepts(lltok, grammar, good) and accepts(lltok, grammar, thought + good)
    assert accepts(lltok, grammar, "<|channel><channel|>" + good)
    assert not accepts(lltok, grammar, bad) and not accepts(lltok, grammar, thought + bad)
    assert not accepts(lltok, grammar, thought + thought + good)             # one thought
    assert not accepts(lltok, grammar, good + thought)                       # before the answer only
    assert not accepts(lltok, grammar, "<|channel>thought\nx<|channel>y<channel|>" + good)
    plain = grammars.check(constraint)  # without the thought field: the answer alone
    assert accepts(lltok, plain, good) and not accepts(lltok, plain, thought + good)


@pytest.mark.parametrize("budget", [0, 1, 4])
def test_a_budget_bounds_the_thought(grammars, markers, tok, budget):
    """thinking_token_budget: at most `budget` tokens between the markers, and once they are spent the close
    marker is the only token llguidance allows; any answer after it (a request with no constraint of its own)."""
    lltok = ll_tokenizer()
    plan = ReasoningPlan(markers, True, True, {}, {}, budget)
    grammar = grammars.check(plan.constrain(None))
    text = tok.encode("thought\nlet me see what the weather is", add_special_tokens=False).ids
    answer = tok.encode("It is clear.", add_special_tokens=False).ids

    def allowed(m) -> np.ndarray:
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return np.flatnonzero(bits[:lltok.vocab_size])

    def admits(ids) -> bool:
        """Each token is in the mask when it comes (the mask is what the decode worker samples from; the token
        count of a lexeme is the mask's business, not validate_tokens')."""
        m = matcher(lltok, grammar)
        for t in ids:
            if t not in allowed(m):
                return False
            assert m.consume_token(t), m.get_error()
        return True

    for k in range(budget + 3):
        assert admits([markers.open, *text[:k], markers.close, *answer]) == (k <= budget), k
    m = matcher(lltok, grammar)
    assert m.consume_tokens([markers.open, *text[:budget]])
    assert list(allowed(m)) == [markers.close]
    assert admits(answer) and plan.constrain(None).lark == ANY_ANSWER
    # Without a budget nothing is added to a request that has no constraint.
    assert ReasoningPlan(markers, True, True, {}, {}).constrain(None) is None


# ---------------------------------------------------------------------------------------------------------------
# Responses: reasoning items in the input


def test_reasoning_items_become_the_next_assistant_turns_thought():
    items = input_items([
        {"role": "user", "content": "Weather in Tokyo?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call."}]},
        {"type": "function_call", "call_id": "c1", "name": "get", "arguments": '{"what": "Tokyo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Sum."}], "encrypted_content": "x"},
        {"role": "assistant", "content": "It is sunny."},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "lost"}]},
        {"role": "user", "content": "Thanks"},
    ])
    assert items[1]["id"] == "rs_1" and items[4]["id"].startswith("rs_")
    messages = chat_messages(None, items)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "user"]
    assert messages[1]["reasoning_content"] == "Call." and messages[1]["tool_calls"][0]["id"] == "c1"
    assert messages[3]["reasoning_content"] == "Sum."
    assert "reasoning_content" not in messages[4]
    with pytest.raises(ApiError) as e:
        input_items([{"type": "reasoning", "content": [{"type": "output_text", "text": "x"}]}])
    assert e.value.param == "input[0].content[0].type"


# ---------------------------------------------------------------------------------------------------------------
# Over the API


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = gemma4_stack(tmp_path_factory.mktemp("reasoning"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _bias(markers) -> dict[str, float]:
    # <|channel> first (the grammar allows it only there), then <channel|> about one token in seven
    return {str(markers.open): 100, str(markers.close): 4}


def _raw(stack, client, model, markers, seed: int, n: int) -> list[str]:
    """The reference: the same prompt, sampling and bias through /v1/completions, with the thought-then-JSON
    grammar written in plain Lark and special tokens kept in the text."""
    prompt = httpx.post(stack.url + "/tokenize", json={"model": model, "messages": MESSAGES,
                                                       "chat_template_kwargs": {"enable_thinking": True}}).json()
    lark = (f"start: thought? body\nthought: <[{markers.open}]> THOUGHT <[{markers.close}]>\n"
            f"THOUGHT: /(?s:.*)/\nbody: %json {json.dumps({**SCHEMA, 'x-guidance': JSON_OPTIONS})}\n")
    r = client.completions.create(model=model, prompt=prompt["tokens"], max_tokens=MAX_TOKENS, temperature=1.0,
                                  seed=seed, n=n, logit_bias=_bias(markers),
                                  extra_body={"guided_grammar": lark, "skip_special_tokens": False})
    return [c.text for c in sorted(r.choices, key=lambda c: c.index)]


def _thinking_chat(client, model, markers, seed: int, n: int, **kw):
    return client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, n=n,
        logit_bias=_bias(markers), reasoning_effort="high",
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}, **kw)


def test_chat_returns_the_thought_apart(stack, client, model, markers):
    raws = _raw(stack, client, model, markers, seed=11, n=4)
    r = _thinking_chat(client, model, markers, seed=11, n=4)
    closed = 0
    for choice, raw in zip(sorted(r.choices, key=lambda c: c.index), raws):
        thought, answer = _split(raw)
        assert thought is not None, raw  # the bias opens one
        msg = choice.message
        assert msg.reasoning_content == thought and (msg.content or "") == answer
        assert msg.reasoning == thought  # vLLM's name for it, beside llama-server's
        if CHANNEL_CLOSE in raw and choice.finish_reason == "stop":
            jsonschema.validate(json.loads(msg.content), SCHEMA)
            closed += 1
    assert closed, "no thought ended in this many tokens"
    assert 0 < r.usage.completion_tokens_details.reasoning_tokens <= r.usage.completion_tokens
    # include_reasoning false: the same answer, no thought
    quiet = _thinking_chat(client, model, markers, seed=11, n=4, extra_body={"include_reasoning": False})
    for a, b in zip(sorted(quiet.choices, key=lambda c: c.index), sorted(r.choices, key=lambda c: c.index)):
        assert a.message.content == b.message.content and getattr(a.message, "reasoning_content", None) is None
    assert quiet.usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens_details.reasoning_tokens


def test_the_stream_carries_the_thought_in_its_deltas(client, model, markers):
    whole = _thinking_chat(client, model, markers, seed=5, n=2)
    chunks = list(_thinking_chat(client, model, markers, seed=5, n=2, stream=True,
                                 stream_options={"include_usage": True}))
    for choice in whole.choices:
        deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].index == choice.index]
        for name in ("reasoning_content", "reasoning"):
            assert "".join(getattr(d, name, None) or "" for d in deltas) == choice.message.reasoning_content
        assert "".join(d.content or "" for d in deltas) == (choice.message.content or "")
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == \
        whole.usage.completion_tokens_details.reasoning_tokens


def _thinking_response(client, model, markers, seed: int, **kw):
    return client.responses.create(
        model=model, input=MESSAGES[0]["content"], max_output_tokens=MAX_TOKENS, temperature=1.0,
        reasoning={"effort": "medium", "summary": "auto"},
        text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}},
        extra_body={"seed": seed, "logit_bias": _bias(markers)}, **kw)


def test_a_response_has_a_reasoning_item(client, model, markers):
    """The thought as a reasoning item before the message; the message's logprobs are the answer's tokens (chat's
    logprobs have every token)."""
    completion = _thinking_chat(client, model, markers, seed=21, n=1, logprobs=True)
    chat = completion.choices[0]
    assert len(chat.logprobs.content) == completion.usage.completion_tokens
    r = _thinking_response(client, model, markers, seed=21, include=["message.output_text.logprobs"])
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"] and r.reasoning.effort == "medium"
    assert r.output[0].summary == [] and r.output[0].content[0].text == chat.message.reasoning_content
    assert r.output_text == (chat.message.content or "")
    reasoning = r.usage.output_tokens_details.reasoning_tokens
    assert reasoning == completion.usage.completion_tokens_details.reasoning_tokens > 0
    logprobs = r.output[1].content[0].logprobs
    assert len(logprobs) == r.usage.output_tokens - reasoning and "".join(lp.token for lp in logprobs) == r.output_text
    with client.responses.stream(model=model, input=MESSAGES[0]["content"], max_output_tokens=MAX_TOKENS,
                                 temperature=1.0, reasoning={"effort": "medium"},
                                 text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}},
                                 extra_body={"seed": 21, "logit_bias": _bias(markers)}) as stream:
        events = list(stream)
        done = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == r.output[0].content[0].text == done.output[0].content[0].text
    assert [e.type for e in events if e.type.startswith("response.reasoning_text")][-1] == \
        "response.reasoning_text.done"
    assert done.output_text == r.output_text
    # The stored thought goes back as the assistant turn's; without calls the template leaves it out.
    follow = client.responses.input_tokens.count(model=model, input="And the sea?", previous_response_id=r.id)
    plain = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"), json={"model": model, "messages": [
        MESSAGES[0], {"role": "assistant", "content": r.output_text}, {"role": "user", "content": "And the sea?"}]})
    assert follow.input_tokens == plain.json()["count"]


PING = {"name": "ping", "description": "Pings.",
        "parameters": {"type": "object", "properties": {"twice": {"type": "boolean"}}, "required": ["twice"]}}


def test_thinking_before_a_forced_call(client, model, markers):
    """tool_choice required with thinking: the thought, then a well-formed call (streamed: the thought's deltas
    first); on the next turn the template replays the thought before the call, as it does for a chat message with
    reasoning_content."""
    kw = dict(model=model, messages=MESSAGES, tools=openai_tools([PING]), tool_choice="required",
              parallel_tool_calls=False, reasoning_effort="low", logit_bias=_bias(markers), temperature=1.0,
              max_tokens=MAX_TOKENS)
    for seed in range(2):
        choice = client.chat.completions.create(seed=seed, **kw).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content is not None
        assert json.loads(choice.message.tool_calls[0].function.arguments)["twice"] in (True, False)
        deltas = [c.choices[0].delta for c in client.chat.completions.create(seed=seed, stream=True, **kw)
                  if c.choices]
        kinds = [k for d in deltas for k in ("reasoning_content", "tool_calls") if getattr(d, k, None)]
        assert kinds[0] == "reasoning_content" and "reasoning_content" not in kinds[kinds.index("tool_calls"):]
        assert "".join(d.reasoning_content or "" for d in deltas if getattr(d, "reasoning_content", None)) == \
            choice.message.reasoning_content
    r = client.responses.create(model=model, input=MESSAGES[0]["content"], tools=[{"type": "function", **PING}],
                                tool_choice="required", parallel_tool_calls=False, reasoning={"effort": "low"},
                                temperature=1.0, max_output_tokens=MAX_TOKENS,
                                extra_body={"seed": 1, "logit_bias": _bias(markers)})
    assert [item.type for item in r.output] == ["reasoning", "function_call"]
    call = r.output[1]
    follow = client.responses.input_tokens.count(model=model, previous_response_id=r.id, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "pong"}])
    messages = [MESSAGES[0], {"role": "assistant", "content": None, "reasoning_content": r.output[0].content[0].text,
                              "tool_calls": [{"id": call.call_id, "type": "function",
                                              "function": {"name": "ping", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "pong"}]
    prompt = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"),
                        json={"model": model, "messages": messages, "tools": openai_tools([PING])}).json()
    assert follow.input_tokens == prompt["count"]
    assert markers.open in prompt["tokens"]  # the thought is in the prompt


def test_thinking_token_budget_closes_the_thought(client, model, markers):
    """A bias that never lets the model close its thought: without a budget the thought takes every token; with
    thinking_token_budget B it holds B tokens (reasoning_tokens counts the markers too), then the answer comes."""
    bias = {str(markers.open): 100, str(markers.close): -100}
    kw = dict(model=model, messages=MESSAGES, max_tokens=40, temperature=1.0, seed=5, logit_bias=bias,
              reasoning_effort="high")
    endless = client.chat.completions.create(**kw)
    assert endless.choices[0].finish_reason == "length" and not endless.choices[0].message.content
    assert endless.usage.completion_tokens_details.reasoning_tokens == 40
    for budget in (0, 6):
        r = client.chat.completions.create(**kw, extra_body={"thinking_token_budget": budget})
        assert r.usage.completion_tokens_details.reasoning_tokens == budget + 2
        assert r.choices[0].message.content, "the answer follows the closed thought"
        if budget:
            assert r.choices[0].message.reasoning_content
    # Not thinking: the budget changes nothing.
    plain = dict(kw, logit_bias={}, reasoning_effort="none", temperature=0)
    assert client.chat.completions.create(**plain, extra_body={"thinking_token_budget": 3}).choices[0].message \
        .content == client.chat.completions.create(**plain).choices[0].message.content


def test_refusals_name_their_parameter(client, model):
    for kw, param in [(dict(reasoning_effort="none", extra_body={"chat_template_kwargs": {"enable_thinking": True}}),
                       "reasoning_effort"),
                      (dict(reasoning_effort="extreme"), "reasoning_effort")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, **kw)
        assert e.value.body["param"] == param
