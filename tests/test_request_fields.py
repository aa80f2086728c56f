"""Every field the gateway accepts on /v1/completions, /v1/chat/completions and /v1/responses is implemented (and has
a test that sends it) or refused with a 400 that names it (docs/sampling.md, docs/responses.md): nothing accepted is
ignored but what by its definition changes no output. A field added to services/gateway/protocol.py or
responses.py without a place in these tables fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from splitgemma.services.gateway import responses
from splitgemma.services.gateway.protocol import (REFUSED, ApiError, ChatCompletionRequest, CompletionRequest,
                                                  parse_request)

TESTS = Path(__file__).parent

# field -> the test modules whose requests send it, checked for what it does
IMPLEMENTED = {
    "model": ["test_gateway"], "prompt": ["test_gateway"], "messages": ["test_gateway"],
    "max_tokens": ["test_gateway", "test_prompt_logprobs"], "max_completion_tokens": ["test_gateway"],
    "temperature": ["test_gateway"], "top_p": ["test_gateway"], "top_k": ["test_sampling_params"],
    "seed": ["test_gateway"], "n": ["test_gateway"], "stream": ["test_gateway"], "stream_options": ["test_gateway"],
    "stop": ["test_gateway", "test_sampling_params"], "stop_token_ids": ["test_sampling_params"],
    "ignore_eos": ["test_gateway"], "skip_special_tokens": ["test_gateway"],
    "logprobs": ["test_gateway", "test_prompt_logprobs"], "top_logprobs": ["test_gateway"],
    "presence_penalty": ["test_sampling_params"], "frequency_penalty": ["test_sampling_params"],
    "logit_bias": ["test_sampling_params"], "repetition_penalty": ["test_sampling_params"],
    "min_p": ["test_sampling_params"], "min_tokens": ["test_sampling_params"],
    "include_stop_str_in_output": ["test_sampling_params"],
    "prompt_logprobs": ["test_prompt_logprobs"], "echo": ["test_prompt_logprobs"],
    "best_of": ["test_prompt_logprobs"],
    "response_format": ["test_structured_output"], "guided_json": ["test_structured_output"],
    "guided_regex": ["test_structured_output"], "guided_choice": ["test_structured_output"],
    "guided_grammar": ["test_structured_output"], "grammar": ["test_structured_output"],
    "structured_outputs": ["test_structured_output"],
    "tools": ["test_tools"], "tool_choice": ["test_tools"], "parallel_tool_calls": ["test_tools"],
    "add_generation_prompt": ["test_surface"], "continue_final_message": ["test_surface"],
    "chat_template_kwargs": ["test_sampling_params"],
    "reasoning_effort": ["test_reasoning"], "include_reasoning": ["test_reasoning"],
    "thinking_token_budget": ["test_reasoning"], "priority": ["test_admission"],
    "prediction": ["test_speculation"], "service_tier": ["test_batches"],
}
# OpenAI's end-user identifier: metadata for abuse monitoring, which by its definition changes no output.
METADATA = {"user"}
# Refused whatever its value (every value but "nothing" asks for something unimplemented); REFUSED's are refused
# unless they hold the value that asks for nothing.
ALWAYS_REFUSED = {"suffix": "x"}
REFUSED_VALUES = {"use_beam_search": True, "bad_words": ["x"], "allowed_token_ids": [5],
                  "truncate_prompt_tokens": 8, "length_penalty": 0.5}


def all_fields() -> set[str]:
    return set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)


def test_every_field_has_a_place():
    placed = set(IMPLEMENTED) | METADATA | set(ALWAYS_REFUSED) | set(REFUSED)
    assert all_fields() == placed, (all_fields() - placed, placed - all_fields())
    assert set(REFUSED) == set(REFUSED_VALUES)


@pytest.mark.parametrize("field", sorted(IMPLEMENTED))
def test_an_implemented_field_is_sent_by_its_tests(field):
    _sent_by(field, IMPLEMENTED[field])


def _sent_by(field: str, modules: list[str]) -> None:
    """The field's name as a request key or keyword in each listed module (not just in a comment)."""
    pattern = re.compile(rf"""["']{field}["']\s*:|\b{field}\s*=|extra_body=\{{["']{field}["']""")
    for module in modules:
        assert pattern.search((TESTS / f"{module}.py").read_text()), f"{module}.py never sends {field}"


@pytest.mark.parametrize("field,value", sorted({**ALWAYS_REFUSED, **REFUSED_VALUES}.items()))
@pytest.mark.parametrize("model,base", [(CompletionRequest, {"prompt": "x"}),
                                        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})])
def test_a_refused_field_is_a_400_naming_it(model, base, field, value):
    if field not in model.model_fields:
        pytest.skip(f"{model.__name__} has no {field}")
    with pytest.raises(ApiError) as e:
        parse_request(model, json.dumps({"model": "m", **base, field: value}).encode())
    assert e.value.status == 400 and e.value.param == field


# /v1/responses: its own fields, tested in test_responses; the sampling fields it shares with chat go over to the chat
# request as they are (responses._CARRIED: what they do is tested above, through chat).
RESPONSES_IMPLEMENTED = {name: ["test_responses"] for name in (
    "input", "instructions", "max_output_tokens", "top_logprobs", "include", "tools", "tool_choice",
    "parallel_tool_calls", "text", "store", "previous_response_id", "truncation", "background", "conversation")}
RESPONSES_IMPLEMENTED["reasoning"] = ["test_reasoning"]
# Echoed or accepted with nothing to do here: metadata, identifiers, hints for OpenAI's own cache and accounts,
# bounds on hosted tools (none run here), stream_options' obfuscation padding (none is added).
RESPONSES_ACCEPTED = {"metadata", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                      "prompt_cache_options", "service_tier", "max_tool_calls", "image", "access_programs",
                      "stream_options"}
RESPONSES_REFUSED_VALUES = {"background_options": {"completion_window": "2h"}, "prompt": {"id": "pmpt_1"},
                            "context_management": [{"type": "compaction"}], "moderation": {"model": "omni"},
                            "n": 2, "max_tokens": 5,
                            "response_format": {"type": "json_object"}, "prompt_logprobs": 1, **REFUSED_VALUES}


def test_every_responses_field_has_a_place():
    fields = set(responses.ResponsesRequest.model_fields)
    placed = set(RESPONSES_IMPLEMENTED) | RESPONSES_ACCEPTED | set(RESPONSES_REFUSED_VALUES) | responses._CARRIED
    assert fields == placed, (fields - placed, placed - fields)
    assert responses._CARRIED <= set(IMPLEMENTED) | METADATA | set(REFUSED)
    assert set(responses.REFUSED) <= set(RESPONSES_REFUSED_VALUES)


@pytest.mark.parametrize("field", sorted(RESPONSES_IMPLEMENTED))
def test_a_responses_field_is_sent_by_its_tests(field):
    _sent_by(field, RESPONSES_IMPLEMENTED[field])


@pytest.mark.parametrize("field,value", sorted(RESPONSES_REFUSED_VALUES.items()))
def test_a_refused_responses_field_is_a_400_naming_it(field, value):
    with pytest.raises(ApiError) as e:
        parse_request(responses.ResponsesRequest, json.dumps({"model": "m", "input": "x", field: value}).encode())
    assert e.value.status == 400 and e.value.param == field
