"""tool_choice required and named on the random-weight fixture model (a model that would never call a tool by itself)
through the real stack with the openai client: every answer is a well-formed call to a declared tool with arguments
that its schema validates, streamed or not. These need the workers to enforce SamplingParams.constraint
(splitgemma/serving/grammar.py).

The tools here have no free-text or numeric parameters: under a uniform-ish random model a free string ends only when
the delimiter happens to be drawn (about 1 token in 400 of the fixture vocabulary), and a number only when a
non-digit is, far beyond a test's max_tokens (numbers are covered by test_tools.py's walks of the grammars). Their
names and keys use only letters the fixture vocabulary has: a byte that no token holds cannot be forced.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tools.tool_fixture import gemma4_stack, openai_tools

SETTINGS = {"name": "set_thermostat", "description": "Sets the thermostat.",
            "parameters": {"type": "object", "properties": {
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "level": {"type": "string", "enum": ["low", "high"]},
                "eco": {"type": "boolean"},
                "area": {"type": "object", "properties": {"upper": {"type": "boolean"},
                                                          "wing": {"type": "string", "enum": ["east", "west"]}},
                         "required": ["wing"]}},
                "required": ["unit", "eco"]}}
PING = {"name": "ping", "description": "Pings.", "parameters": {"type": "object", "properties": {
    "twice": {"type": "boolean"}}, "required": ["twice"]}}
FUNCTIONS = {f["name"]: f for f in (SETTINGS, PING)}
MESSAGES = [{"role": "user", "content": "Hello! How can I help?"}]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = gemma4_stack(tmp_path_factory.mktemp("tools-constrained"))
    yield s
    s.stop()


def _check_calls(calls, allowed: set[str]):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert c.function.name in allowed
        jsonschema.validate(json.loads(c.function.arguments), FUNCTIONS[c.function.name]["parameters"])


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_are_well_formed(stack, choice):
    client = stack.client()
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "ping"}}
    allowed = set(FUNCTIONS) if choice == "required" else {"ping"}
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=MESSAGES, tools=openai_tools([SETTINGS, PING]),
                                       tool_choice=tool_choice, parallel_tool_calls=False, temperature=1.0, seed=7,
                                       n=6, max_tokens=MAX_TOKENS)
    for choice_ in r.choices:
        assert choice_.finish_reason == "tool_calls", choice_
        assert len(choice_.message.tool_calls) == 1
        _check_calls(choice_.message.tool_calls, allowed)
    # Parallel calls: this random model goes on calling with odds that differ per context, so a choice may run
    # out of tokens; every call it completed is still well formed, and the one cut off is not a call.
    many = client.chat.completions.create(model=model, messages=MESSAGES, tools=openai_tools([SETTINGS, PING]),
                                          tool_choice=tool_choice, temperature=1.0, seed=8, n=4,
                                          max_tokens=MAX_TOKENS)
    for choice_ in many.choices:
        assert choice_.finish_reason in ("tool_calls", "length"), choice_
        _check_calls(choice_.message.tool_calls, allowed)
    assert any(len(c.message.tool_calls) > 1 for c in many.choices)


def test_forced_calls_stream_and_assemble(stack):
    client = stack.client()
    model = client.models.list().data[0].id
    for seed in range(3):
        with client.chat.completions.stream(model=model, messages=MESSAGES, tools=openai_tools([SETTINGS, PING]),
                                            tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                            seed=seed,
                                            max_tokens=MAX_TOKENS) as stream:
            done = stream.get_final_completion()
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message.tool_calls, set(FUNCTIONS))
