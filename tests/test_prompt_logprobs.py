"""Prompt logprobs through the real gateway, prefill and decode processes with the official openai client: OpenAI's
legacy completions `echo` (with logprobs, and with max_tokens 0 to score a prompt), vLLM's `prompt_logprobs`, and
`best_of`. The prompt's logprobs are checked against transformers' logits for the same prompt (the fastgemma
fixture's reference.npz: transformers run on the weights decoded from the .fgm) and, exactly, against the
in-process engine (test_gateway.Reference: the workers' engine, weights policy and geometry)."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from splitgemma.services.gateway.prompt_logprobs import best_of

from test_gateway import MODEL, MODEL_NAME, TEMPLATE, Reference, Stack

REF = np.load(MODEL.parent / "reference.npz")
PROMPT = [int(t) for t in REF["prompt_ids"]]  # 40 ids, <bos> first


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("prompt-logprobs"), gateway_args=("--chat-template", str(TEMPLATE)))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack):
    return stack.client()


@pytest.fixture(scope="module")
def ref():
    return Reference()


def log_softmax(z):
    z = np.asarray(z, dtype=np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def token_texts(ref, ids):
    return [ref.tokenizer.decode([t], skip_special_tokens=False) for t in ids]


@pytest.fixture(scope="module")
def engine_lp(ref):
    """The workers' engine on the prompt: log-softmax of every position's logits."""
    return log_softmax(ref.prefill_model.prefill(ref.arena, 0, PROMPT, all_logits=True))


def test_echo_with_max_tokens_0_scores_the_prompt(client, ref, engine_lp, report):
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=3)
    c = got.choices[0]
    assert c.text == ref.tokenizer.decode(PROMPT, skip_special_tokens=True) and c.finish_reason == "length"
    assert got.usage.completion_tokens == 0 and got.usage.prompt_tokens == len(PROMPT)
    lp = c.logprobs
    assert lp.tokens == token_texts(ref, PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    scored = np.array(lp.token_logprobs[1:])
    # exactly the engine's: position i's distribution at the prompt's token i + 1
    want_engine = engine_lp[np.arange(len(PROMPT) - 1), PROMPT[1:]]
    np.testing.assert_allclose(scored, want_engine, atol=1e-4)
    # and transformers' within what int8 activations move (the engine's logits are ~0.1 from transformers')
    want_hf = log_softmax(REF["fgm_int8_logits"])[np.arange(len(PROMPT) - 1), PROMPT[1:]]
    diff = np.abs(scored - want_hf)
    report(f"echo prompt logprobs vs transformers (fgm int8): max |d| {diff.max():.4f}, mean {diff.mean():.4f}")
    assert diff.max() < 0.3 and diff.mean() < 0.05
    for i, top in enumerate(lp.top_logprobs[1:]):
        best = np.argsort(-engine_lp[i], kind="stable")[:3]
        assert list(top) == token_texts(ref, best)
        np.testing.assert_allclose(list(top.values()), engine_lp[i][best], atol=1e-4)
    # offsets: each token's text starts where the texts before it end (<bos> has no text in the echo)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_echo_puts_the_prompt_before_the_completion(client, ref):
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    echo = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                     echo=True)
    prompt_text = ref.tokenizer.decode(PROMPT, skip_special_tokens=True)
    assert echo.choices[0].text == prompt_text + plain.choices[0].text
    lp, tail = echo.choices[0].logprobs, plain.choices[0].logprobs
    assert lp.tokens == token_texts(ref, PROMPT) + tail.tokens
    # The K/V are the same, so every later token is; the first token's row went through the KV-shared layers with
    # every other row instead of alone, which the fixture's auto:16 policy runs with int8 instead of int4 weights.
    assert lp.token_logprobs[len(PROMPT) + 1:] == tail.token_logprobs[1:]
    assert lp.token_logprobs[len(PROMPT)] == pytest.approx(tail.token_logprobs[0], abs=0.3)
    assert lp.text_offset[len(PROMPT):] == [o + len(prompt_text) for o in tail.text_offset]
    # a text prompt is echoed as sent
    text = client.completions.create(model=MODEL_NAME, prompt="The sea", max_tokens=2, temperature=0, echo=True)
    assert text.choices[0].text.startswith("The sea") and text.choices[0].logprobs is None


def test_vllm_prompt_logprobs(client, ref, engine_lp):
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    pl = got.choices[0].model_extra["prompt_logprobs"]
    assert len(pl) == len(PROMPT) and pl[0] is None
    for i, entry in enumerate(pl[1:]):
        row, tok = engine_lp[i], PROMPT[i + 1]
        best = [int(t) for t in np.argsort(-row, kind="stable")[:2]]
        assert set(entry) == {str(t) for t in [tok, *best]}
        mine = entry[str(tok)]
        assert mine["logprob"] == pytest.approx(row[tok], abs=1e-4)
        assert mine["rank"] == 1 + int((row > row[tok]).sum())
        assert mine["decoded_token"] == token_texts(ref, [tok])[0]
        for rank, t in enumerate(best, 1):
            assert entry[str(t)]["logprob"] == pytest.approx(row[t], abs=1e-4)
            if t != tok:
                assert entry[str(t)]["rank"] == rank
    # The prefix cache holds this prompt's blocks by now; prompt logprobs read every position all the same.
    again = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0,
                                      extra_body={"prompt_logprobs": 2})
    assert again.choices[0].model_extra["prompt_logprobs"] == pl


def test_chat_prompt_logprobs(client):
    messages = [{"role": "user", "content": "Name a colour."}]
    got = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2, temperature=0,
                                         extra_body={"prompt_logprobs": 0})
    pl = got.model_extra["prompt_logprobs"]
    assert len(pl) == got.usage.prompt_tokens and pl[0] is None
    assert all(len(e) == 1 for e in pl[1:])  # top 0: only the prompt's own token


def test_best_of_returns_the_n_candidates_with_the_highest_cumulative_logprob(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=1234, logprobs=0)
    every = client.completions.create(n=4, **kw)  # the same candidates: choice j samples with seed + j
    best = client.completions.create(n=2, best_of=4, **kw)
    sums = [sum(c.logprobs.token_logprobs) for c in sorted(every.choices, key=lambda c: c.index)]
    texts = [c.text for c in sorted(every.choices, key=lambda c: c.index)]
    want = best_of(sums, 1, 4, 2)
    assert [c.text for c in sorted(best.choices, key=lambda c: c.index)] == [texts[i] for i in want]
    assert [c.index for c in best.choices] == [0, 1]
    # without logprobs asked for, the ranking is the same and none are returned
    quiet = client.completions.create(n=2, best_of=4, **{**kw, "logprobs": None})
    assert [c.text for c in quiet.choices] == [texts[i] for i in want] and quiet.choices[0].logprobs is None


@pytest.mark.parametrize("kw,param", [
    (dict(best_of=1, n=2), "best_of"),
    (dict(best_of=3, n=2, stream=True), "best_of"),
    (dict(echo=True, stream=True), "echo"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(extra_body={"prompt_logprobs": 21}), "prompt_logprobs"),
    (dict(extra_body={"prompt_logprobs": 1}, stream=True), "prompt_logprobs"),
])
def test_refused_with_the_parameter_named(client, kw, param):
    kw = {"max_tokens": 2, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, **kw)
    assert e.value.body["param"] == param, e.value.body
