"""Every field the gateway accepts on /v1/completions and /v1/chat/completions is implemented (and has a test that
sends it) or refused with a 400 that names it (docs/sampling.md): nothing accepted is ignored. A field added to
services/gateway/protocol.py without a place in this table fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

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
    "add_generation_prompt": ["test_surface"], "chat_template_kwargs": ["test_sampling_params"],
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
    # the field's name as a request key or keyword in each listed module (not just in a comment)
    pattern = re.compile(rf"""["']{field}["']\s*:|\b{field}\s*=|extra_body=\{{["']{field}["']""")
    for module in IMPLEMENTED[field]:
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
