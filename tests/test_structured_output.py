"""Structured outputs (docs/structured-outputs.md) with the official openai client against real processes: the
random-weight fixture model, constrained by a JSON schema, a regex, a choice or json_object, returns output that
matches in every sampled completion, streaming and not; bad constraints are 400s; constrained and unconstrained
rows share a batch without changing the unconstrained ones' tokens."""

from __future__ import annotations

import json
import re
import threading

import httpx
import jsonschema
import openai
import pytest
from tools.procs import free_ports

from test_gateway import CHAT, MODEL, TEMPLATE, Stack

# Bounded everywhere (maxLength, maxItems, multipleOf for the fraction digits): a random-weight model at temperature
# 1 otherwise fills max_tokens with string characters or digits now and then, which is a length finish, not a bug.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.25},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 6},
                                   "code": {"type": "string", "pattern": "^[0-9]{3}$"}},
                    "required": ["city", "code"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
MAX_TOKENS = 160


def gemma_style_stack(folder, decode_args=()) -> Stack:
    """The fixture model with a Gemma-style BPE tokenizer beside it: the chat fixture's vocabulary (it has the
    characters JSON needs) with Gemma 4's normalizer and decoder (space = U+2581, byte fallback), which
    llguidance reads as it reads the real one; <eos> is its only stop token. s.metrics_url: the decode worker's."""
    model = folder / MODEL.name
    model.symlink_to(MODEL)
    tok = json.loads((CHAT / "tokenizer.json").read_text())
    tok["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
    tok["pre_tokenizer"] = None
    tok["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}]}
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    (metrics,) = free_ports(1)
    s = Stack(folder, model=model, gateway_args=("--chat-template", str(TEMPLATE)),
              decode_args=("--metrics-port", str(metrics), *decode_args))
    s.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
    return s


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = gemma_style_stack(tmp_path_factory.mktemp("structured"))
    try:
        yield s
    finally:
        s.stop()


def _completions(client, n_requests: int, stream: bool, n: int = 4, **kw) -> list[tuple[str, str]]:
    """(text, finish_reason) of every choice of n_requests requests with seeds 0, n, 2n, … (choice j: seed + j)."""
    out = []
    for i in range(n_requests):
        args = dict(model="mini-e2b-tame", prompt="Hello", max_tokens=MAX_TOKENS, temperature=1.0, seed=i * n, n=n,
                    **kw)
        if stream:
            texts, reasons = {}, {}
            for chunk in client.completions.create(stream=True, **args):
                for c in chunk.choices:
                    texts[c.index] = texts.get(c.index, "") + c.text
                    if c.finish_reason:
                        reasons[c.index] = c.finish_reason
            out += [(texts[i], reasons[i]) for i in sorted(texts)]
        else:
            r = client.completions.create(**args)
            out += [(c.text, c.finish_reason) for c in r.choices]
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_holds_in_every_sample(stack, stream):
    client = stack.client()
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    results = _completions(client, 7, stream, extra_body={"response_format": rf})
    assert len(results) >= 28
    for text, reason in results:
        assert reason == "stop", (text, reason)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_schema_on_chat_and_guided_json(stack):
    client = stack.client()
    r = client.chat.completions.create(model="mini-e2b-tame", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=MAX_TOKENS, temperature=1.0, seed=3, n=8,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "p", "schema": SCHEMA}})
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    r = client.completions.create(model="mini-e2b-tame", prompt="x", max_tokens=MAX_TOKENS, seed=5, n=8,
                                  extra_body={"guided_json": SCHEMA})
    for c in r.choices:
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_json_object(stack):
    r = stack.client().chat.completions.create(
        model="mini-e2b-tame", messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_TOKENS, seed=1, n=8,
        response_format={"type": "json_object"})
    done = [c for c in r.choices if c.finish_reason == "stop"]
    for c in r.choices:
        assert c.message.content.startswith("{")
    for c in done:
        assert isinstance(json.loads(c.message.content), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_regex_and_choice(stack, stream):
    client = stack.client()
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    got = _completions(client, 7, stream, extra_body={"guided_regex": pattern})
    assert len(got) >= 28
    for text, reason in got:
        assert reason == "stop" and re.fullmatch(pattern, text), (text, reason)
    choices = ["yes", "no", "maybe so"]
    got = _completions(client, 7, stream, extra_body={"structured_outputs": {"choice": choices}})
    assert all(reason == "stop" and text in choices for text, reason in got), got
    grammar = 'root ::= "a" [0-9] "b"'  # GBNF, as llama-server takes it
    for text, reason in _completions(client, 1, stream, extra_body={"grammar": grammar}):
        assert re.fullmatch(r"a[0-9]b", text), text


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: nothing_defined"}, "guided_grammar"),
    ({"guided_json": {"type": "string", "format": "no-such-format"}}, "guided_json"),
    ({"guided_regex": "a", "guided_json": {"type": "object"}}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs.regex"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
    ({"grammar": "root ::= (("}, "grammar"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
])
def test_bad_constraints_are_400(stack, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        stack.client().completions.create(model="mini-e2b-tame", prompt="x", max_tokens=4, extra_body=body)
    assert e.value.body["param"] == param, e.value.body


def test_unconstrained_rows_unchanged_beside_constrained(stack):
    client = stack.client()

    def free(seed: int) -> list[str]:
        r = client.completions.create(model="mini-e2b-tame", prompt=f"story {seed}", max_tokens=24,
                                      temperature=0, seed=seed, logprobs=0)
        return r.choices[0].logprobs.tokens

    alone = [free(s) for s in range(3)]
    together: dict[int, list[str]] = {}
    errors: list[BaseException] = []

    def run(fn):
        try:
            fn()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(lambda s=s: together.__setitem__(s, free(s)),)) for s in range(3)]
    # 3 + 2 × 2 rows: all fit in the decode worker's 8 slots at once.
    threads += [threading.Thread(target=run, args=(lambda: _completions(
        client, 1, False, n=2, extra_body={"guided_json": SCHEMA}),)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert [together[s] for s in range(3)] == alone
    stats = stack.stats()
    assert stats.max_batch_seen >= 2


def test_mask_time_is_a_metric(stack):
    _completions(stack.client(), 1, False, extra_body={"guided_regex": "[a-c]{4}"})
    text = httpx.get(stack.metrics_url, timeout=10).text
    count = re.search(r"^splitgemma_decode_grammar_mask_seconds_count (\S+)$", text, re.M)
    rows = re.search(r"^splitgemma_decode_grammar_rows_total (\S+)$", text, re.M)
    assert count and float(count.group(1)) > 0, text[-2000:]
    assert rows and float(rows.group(1)) >= float(count.group(1))


def test_forced_tokens(stack):
    # One choice: every token is forced (the mask admits one id), so sampling at temperature 1 yields exactly that
    # text, and each token's logprob, from the masked distribution, is 0.
    r = stack.client().completions.create(model="mini-e2b-tame", prompt="x", max_tokens=32, temperature=1.0,
                                          seed=11, n=3, logprobs=2,
                                          extra_body={"guided_choice": ["the value is 12"]})
    for c in r.choices:
        assert c.text == "the value is 12" and c.finish_reason == "stop"
        assert all(lp == 0.0 for lp in c.logprobs.token_logprobs), c.logprobs
