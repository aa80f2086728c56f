"""The model's recommended sampling (splitgemma/serving/generation_config.py): generation_config.json beside the model
gives the sampling fields a request leaves unset, on completions, chat and the Responses API; a request's own value
wins; `--generation-config none` keeps the API's defaults; a bad file stops the gateway with a message naming it.

Over the API the fixture model's folder says top_k 1: a request at temperature 1 then samples the likeliest token
every step, so its answer is the greedy one (temperature 0) — which a top_k the request sets itself undoes.
"""

from __future__ import annotations

import json

import openai
import pytest

from splitgemma.serving.generation_config import GenerationConfigError, SamplingDefaults, load_sampling_defaults
from splitgemma.services.gateway.server import build_config
from tools.tool_fixture import TEMPLATE, model_folder

GOOGLE = {"do_sample": True, "temperature": 1.0, "top_p": 0.95, "top_k": 64, "eos_token_id": [1, 106, 50],
          "max_new_tokens": 100}


def _folder(tmp_path, config) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return str(tmp_path / "model.fgm")


def test_the_sampling_keys_are_read(tmp_path):
    model = _folder(tmp_path, GOOGLE)
    d = load_sampling_defaults("auto", model)
    assert d.given() == {"temperature": 1.0, "top_p": 0.95, "top_k": 64} and d.source.endswith("generation_config.json")
    assert load_sampling_defaults(str(tmp_path), None) == d                      # a folder
    assert load_sampling_defaults(d.source, None) == d                           # the file
    assert load_sampling_defaults("none", model) == SamplingDefaults()
    assert load_sampling_defaults("auto", str(tmp_path / "elsewhere" / "m.fgm")) == SamplingDefaults()   # none there
    assert load_sampling_defaults("auto", None) == SamplingDefaults()
    other = _folder(tmp_path, {"min_p": 0.05, "repetition_penalty": 1.1, "eos_token_id": 1})
    assert load_sampling_defaults("auto", other).given() == {"min_p": 0.05, "repetition_penalty": 1.1}


@pytest.mark.parametrize("config, words", [
    ({"top_p": 0}, "top_p must be a number in (0, 1]"),
    ({"top_k": 1.5}, "top_k must be an integer"),
    ({"temperature": "1"}, "temperature must be a number"),
    ({"min_p": True}, "min_p must be a number"),
    ({"repetition_penalty": -1}, "repetition_penalty must be a number above 0"),
    ([1, 2], "is not a JSON object"),
])
def test_a_bad_config_is_refused_by_key(tmp_path, config, words):
    with pytest.raises(GenerationConfigError) as e:
        load_sampling_defaults("auto", _folder(tmp_path, config))
    assert words in str(e.value) and "generation_config.json" in str(e.value)


def test_a_missing_or_broken_file_is_refused(tmp_path):
    with pytest.raises(GenerationConfigError, match="cannot read"):
        load_sampling_defaults(str(tmp_path / "nothing.json"), None)
    (tmp_path / "generation_config.json").write_text("{nope")
    with pytest.raises(GenerationConfigError, match="is not JSON"):
        load_sampling_defaults(str(tmp_path), None)
    # the gateway's configuration stops on it (a ValueError: the CLI says it and exits)
    model = model_folder(tmp_path / "model")
    with pytest.raises(ValueError, match="is not JSON"):
        build_config(model_name=None, model=str(model), tokenizer=None, chat_template=str(TEMPLATE),
                     prefill="127.0.0.1:1", decode="127.0.0.1:2", max_body_bytes=1 << 20,
                     generation_config=str(tmp_path))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from test_gateway import Stack

    folder = tmp_path_factory.mktemp("generation-config")
    model = model_folder(folder / "model")
    config = json.loads((model.parent / "generation_config.json").read_text())
    (model.parent / "generation_config.json").write_text(json.dumps({**config, "top_k": 1, "top_p": 0.9}))
    s = Stack(folder, model=model, gateway_args=("--chat-template", str(TEMPLATE)))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=60)


MESSAGES = [{"role": "user", "content": "Tell me a story about a cat"}]


def test_unset_fields_take_the_models_defaults(client):
    model = client.models.list().data[0].id
    greedy = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0)
    sampled = [client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=1.0,
                                              seed=seed) for seed in range(3)]
    assert all(s.choices[0].message.content == greedy.choices[0].message.content for s in sampled)
    own = [client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=seed,
                                          extra_body={"top_k": -1}) for seed in range(3)]
    assert any(o.choices[0].message.content != greedy.choices[0].message.content for o in own)
    # completions too
    text = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0)
    drawn = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, seed=4)
    assert drawn.choices[0].text == text.choices[0].text
    # the Responses API runs them and says so
    r = client.responses.create(model=model, input=MESSAGES[0]["content"], max_output_tokens=12,
                                extra_body={"seed": 2})
    assert r.output_text == greedy.choices[0].message.content and r.top_p == 0.9 and r.temperature == 1.0
    assert client.responses.create(model=model, input="x", max_output_tokens=1, top_p=0.5).top_p == 0.5
