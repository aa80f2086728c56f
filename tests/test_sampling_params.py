"""Logits processing end to end (the native RowSampler, splitgemma/serving/logits.py): logit_bias,
presence/frequency penalties, repetition_penalty, min_p, min_tokens, include_stop_str_in_output, top_k and
chat_template_kwargs, through the official openai client against real gateway, prefill and decode processes; each
checked against its definition applied with numpy to the engine's raw logits (the same engine and weights policy
in-process, test_gateway.Reference). The fixture model's 1,024 tokens decode to distinct texts, so the logprobs'
token texts name the ids. The native sampler itself against transformers' processors: tests/test_row_sampler.py."""

from __future__ import annotations

import numpy as np
import openai
import pytest


from test_gateway import MODEL_NAME, STOP_IDS, TEMPLATE, Reference, Stack

PROMPT = [2, *range(40, 72)]  # <bos> and 32 ordinary ids


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("sampling"), gateway_args=("--chat-template", str(TEMPLATE)))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ref():
    return Reference()


@pytest.fixture(scope="module")
def client(stack):
    return stack.client()


@pytest.fixture(scope="module")
def ids_of(ref):
    inverse = {ref.tokenizer.decode([i], skip_special_tokens=False): i for i in range(ref.tokenizer.get_vocab_size())}
    assert len(inverse) == ref.tokenizer.get_vocab_size()
    return lambda texts: [inverse[t] for t in texts]


def first_logits(ref, ids) -> np.ndarray:
    return np.asarray(ref.prefill_model.prefill(ref.arena, 0, ids), dtype=np.float64)


def greedy_processed(ref, ids, steps, process) -> list[int]:
    """Greedy decoding through the reference engine with process(row, generated) applied to every raw row."""
    logits, out, pos = ref.prefill_model.prefill(ref.arena, 0, ids), [], len(ids)
    while len(out) < steps:
        out.append(int(np.argmax(process(np.asarray(logits, dtype=np.float64), out))))
        logits = ref.decode_model.decode(ref.arena, [0], [out[-1]], [pos])[0]
        pos += 1
    return out


def log_softmax(z):
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def complete(client, **kw):
    extra = {k: kw.pop(k) for k in ("min_p", "min_tokens", "repetition_penalty", "ignore_eos", "stop_token_ids",
                                    "include_stop_str_in_output", "prompt_logprobs", "use_beam_search", "top_k")
             if k in kw}
    kw.setdefault("temperature", 0)
    return client.completions.create(model=MODEL_NAME, prompt=kw.pop("prompt", PROMPT), extra_body=extra, **kw)


def test_logit_bias_makes_a_token_the_greedy_choice(client, ref, ids_of):
    raw = first_logits(ref, PROMPT)
    unlikely = int(next(t for t in np.argsort(raw) if t not in STOP_IDS))
    got = complete(client, max_tokens=4, logprobs=0, logit_bias={str(unlikely): 100})
    assert ids_of(got.choices[0].logprobs.tokens) == [unlikely] * 4
    # -100 on the greedy token: the runner-up is chosen instead
    best, second = np.argsort(-raw, kind="stable")[:2]
    got = complete(client, max_tokens=1, logprobs=0, logit_bias={str(best): -100})
    assert ids_of(got.choices[0].logprobs.tokens) == [second]
    # chat too
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, temperature=0, logit_bias={str(unlikely): 100},
                                          logprobs=True)
    assert ids_of([t.token for t in chat.choices[0].logprobs.content]) == [unlikely] * 3


def test_repetition_penalty_divides_the_logits_of_prompt_tokens(client, ref, ids_of):
    prompt = [2, *np.random.default_rng(5).integers(4, 1024, 600).tolist()]
    p = 1.1  # mild, so that repeated tokens stay among the top 20 reported
    raw = first_logits(ref, prompt)
    want = raw.copy()
    seen = np.unique(prompt)
    want[seen] = np.where(raw[seen] > 0, raw[seen] / p, raw[seen] * p)
    want_lp = log_softmax(want)
    got = complete(client, prompt=prompt, max_tokens=1, logprobs=20, repetition_penalty=p)
    tops = got.choices[0].logprobs.top_logprobs[0]
    ids = dict(zip(ids_of(list(tops)), tops.values()))
    assert set(ids) == set(np.argsort(-want_lp, kind="stable")[:20].tolist())
    for t, lp in ids.items():
        assert lp == pytest.approx(want_lp[t], abs=2e-3), t
    # the defined factor, on a repeated token against one that is not in the prompt
    a = next(t for t in ids if t in seen and raw[t] > 0)
    b = next(t for t in ids if t not in seen)
    assert ids[a] - ids[b] == pytest.approx(raw[a] / p - raw[b], abs=2e-3)
    assert ids_of(got.choices[0].logprobs.tokens) == [int(np.argmax(want))]


@pytest.mark.parametrize("p", [1.3, 3.0])
def test_repetition_penalty_over_prompt_and_generated_tokens_in_the_decode_worker(client, ref, ids_of, p):
    prompt = [2, *range(700, 1024)]  # many distinct ids, some of them the greedy continuation's
    steps = 12

    def penalised(row, generated, over_prompt=True):
        seen = np.unique([*(prompt if over_prompt else []), *generated]).astype(np.int64)
        row = row.copy()
        row[seen] = np.where(row[seen] > 0, row[seen] / p, row[seen] * p)
        return row

    want = greedy_processed(ref, prompt, steps, penalised)
    assert want != greedy_processed(ref, prompt, steps, lambda row, _: row), "the case must be one p changes"
    # and one where the prompt's ids (sent to the decode worker for this) count
    assert want != greedy_processed(ref, prompt, steps, lambda row, g: penalised(row, g, over_prompt=False))
    got = complete(client, prompt=prompt, max_tokens=steps, logprobs=0, repetition_penalty=p, ignore_eos=True)
    assert ids_of(got.choices[0].logprobs.tokens) == want


@pytest.mark.parametrize("presence,frequency", [(1.5, 0.0), (0.0, 0.8), (-0.5, 2.0)])
def test_presence_and_frequency_penalties_follow_openai(client, ref, ids_of, presence, frequency):
    steps = 12

    def penalised(row, generated):
        counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=len(row))
        return row - frequency * counts - presence * (counts > 0)

    want = greedy_processed(ref, PROMPT, steps, penalised)
    plain = greedy_processed(ref, PROMPT, steps, lambda row, _: row)
    assert want != plain, "the case must be one the penalty changes"
    got = complete(client, max_tokens=steps, logprobs=0, presence_penalty=presence, frequency_penalty=frequency,
                   ignore_eos=True)
    assert ids_of(got.choices[0].logprobs.tokens) == want


def test_min_tokens_holds_off_the_stop_tokens(client, ref, ids_of):
    eos = min(STOP_IDS)
    n = 5

    def forced(row, generated):
        row = row.copy()
        row[eos] += 100
        if len(generated) < n:
            row[sorted(STOP_IDS)] = -np.inf
        return row

    want = greedy_processed(ref, PROMPT, n + 1, forced)
    assert want[-1] == eos and not STOP_IDS.intersection(want[:-1])
    got = complete(client, max_tokens=20, logprobs=0, logit_bias={str(eos): 100}, min_tokens=n)
    assert got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens == n + 1
    assert ids_of(got.choices[0].logprobs.tokens)[:n] == want[:n]
    # a stop_token_ids entry is held off the same way (under ignore_eos too)
    other = int(want[0])
    got = complete(client, max_tokens=20, logprobs=0, logit_bias={str(other): 100}, min_tokens=3,
                   stop_token_ids=[other], ignore_eos=True)
    assert got.usage.completion_tokens == 4 and got.choices[0].finish_reason == "stop"
    assert other not in ids_of(got.choices[0].logprobs.tokens)[:3]
    # without min_tokens the forced stop token ends the choice at once
    got = complete(client, max_tokens=20, logit_bias={str(eos): 100})
    assert got.usage.completion_tokens == 1


def test_min_p_never_samples_below_the_threshold(client, ref, ids_of):
    min_p = 0.6  # the fixture model's logits are flat (±2.5): this keeps a few tokens
    raw = first_logits(ref, PROMPT)
    prob = np.exp(log_softmax(raw))
    kept = np.flatnonzero(prob >= min_p * prob.max())
    assert 1 < len(kept) < 20, "the case must keep some tokens and drop others"
    want_lp = np.log(prob[kept] / prob[kept].sum())
    got = complete(client, max_tokens=6, logprobs=20, temperature=1.0, min_p=min_p, n=8, seed=11,
                   ignore_eos=True)
    for choice in got.choices:
        first = choice.logprobs.top_logprobs[0]
        # the first token's alternatives are exactly the kept set, renormalised over it
        assert sorted(ids_of(list(first))) == kept.tolist()
        assert sorted(first.values()) == pytest.approx(sorted(want_lp), abs=2e-3)
        assert ids_of(choice.logprobs.tokens)[0] in kept
        for step, tok_lp in zip(choice.logprobs.top_logprobs, choice.logprobs.token_logprobs):
            # every later step draws only among tokens within min_p of that step's most likely one
            assert len(step) < 20 and tok_lp >= max(step.values()) + np.log(min_p) - 1e-4


def test_include_stop_str_in_output(client):
    text = complete(client, max_tokens=16, ignore_eos=True).choices[0].text
    stop = text[6:9]
    at = text.find(stop)
    kept = complete(client, max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert kept.choices[0].text == text[:at + len(stop)] and kept.choices[0].finish_reason == "stop"
    dropped = complete(client, max_tokens=16, ignore_eos=True, stop=[stop])
    assert dropped.choices[0].text == text[:at]
    # streamed: the pieces held back for a possible match come out with it
    stream = complete(client, max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True,
                      stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == text[:at + len(stop)]


@pytest.mark.parametrize("extra,param", [
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"allowed_token_ids": [5]}, "allowed_token_ids"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"7": 101}}, "logit_bias[7]"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5000": 1}}, "logit_bias"),
    ({"min_tokens": 9}, "min_tokens"),
])
def test_out_of_range_or_unimplemented_is_refused(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body


def test_top_k_1_is_greedy(client):
    # top_k (vLLM, llama-server) at the gateway: one id kept, whatever the temperature.
    greedy = complete(client, max_tokens=6, temperature=0)
    cut = complete(client, max_tokens=6, temperature=1.5, seed=3, top_k=1)
    assert cut.choices[0].text == greedy.choices[0].text


def test_chat_template_kwargs_reach_the_template(client):
    messages = [{"role": "user", "content": "Hi"}]
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1, temperature=0)
    thinking = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1, temperature=0,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert thinking.usage.prompt_tokens != plain.usage.prompt_tokens
