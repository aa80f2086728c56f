"""Forced-token runs and prompt-lookup speculation in the decode worker (docs/speculation.md), with the official
openai client against real processes: a stack with both on and a stack with both off return the same tokens, texts,
logprobs and finish reasons, greedy, sampled and constrained, with stop strings, max_tokens and concurrency; the on stack
reports what it forced, drafted and accepted (Stats and Prometheus), the off stack nothing.

The oracle is plain decoding (the off stack): the engine's one-token steps, checked against transformers' logits
in test_engine.py.
"""

from __future__ import annotations

import json
import re
import threading

import httpx
import pytest
from test_structured_output import SCHEMA, gemma_style_stack

from splitgemma.services.decode.speculation import NgramIndex, StepCosts, choose_drafts

MODEL_NAME = "mini-e2b-tame"
# Prompts that repeat themselves, so prompt lookup finds n-grams to draft from, and one that does not.
PROMPTS = ["the cat sat on the mat and the cat sat on the mat and the cat",
           "a b c d a b c d a b c d a b",
           "one two three four five six seven eight nine ten",
           "red green blue red green blue red"]


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    # The fixed draft policy: the adaptive one decides from measured step times, so what it drafts depends on the host.
    on = gemma_style_stack(tmp_path_factory.mktemp("spec-on"), ("--lookup-max-batch", "8", "--lookup-policy", "fixed"))
    try:
        off = gemma_style_stack(tmp_path_factory.mktemp("spec-off"), ("--forced-tokens", "off", "--lookup-k", "0"))
    except BaseException:
        on.stop()
        raise
    try:
        yield on, off
    finally:
        on.stop()
        off.stop()


def _complete(stack, **kw):
    r = stack.client().completions.create(model=MODEL_NAME, **kw)
    return [(c.text, c.finish_reason, c.logprobs and c.logprobs.tokens, c.logprobs and c.logprobs.token_logprobs,
             c.logprobs and c.logprobs.top_logprobs) for c in r.choices]


def _stream(stack, **kw):
    text, finish = "", None
    for chunk in stack.client().completions.create(model=MODEL_NAME, stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 60])
def test_greedy_outputs_are_identical(stacks, max_tokens):
    on, off = stacks
    for prompt in PROMPTS:
        kw = dict(prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=2)
        assert _complete(on, **kw) == _complete(off, **kw), prompt
        kw = dict(prompt=prompt, max_tokens=max_tokens, temperature=0)
        assert _stream(on, **kw) == _stream(off, **kw), prompt


@pytest.mark.parametrize("max_tokens", [2, 60])
def test_sampled_outputs_are_identical(stacks, max_tokens):
    """Sampled rows speculate too: each draft row is sampled with the random state plain decoding has at that
    position (one draw per sampled token), so a seeded request returns the off stack's tokens, logprobs and text."""
    on, off = stacks
    drafted, accepted = on.stats().lookup_drafted, on.stats().lookup_accepted
    for seed, prompt in enumerate(PROMPTS):
        for sampling in (dict(temperature=0.8),
                         dict(temperature=1.0, top_p=0.9, extra_body={"top_k": 40, "repetition_penalty": 1.1}),
                         dict(temperature=0.7, extra_body={"min_p": 0.05})):
            kw = dict(prompt=prompt, max_tokens=max_tokens, seed=seed, n=2, logprobs=2, **sampling)
            assert _complete(on, **kw) == _complete(off, **kw), (prompt, sampling)
        kw = dict(prompt=prompt, max_tokens=max_tokens, seed=seed, temperature=0.8)
        assert _stream(on, **kw) == _stream(off, **kw), prompt
    if max_tokens > 2:  # the sampled rows drafted, and took drafts (68 and 41 here)
        assert on.stats().lookup_drafted > drafted and on.stats().lookup_accepted > accepted


def test_greedy_rows_with_logits_processing_are_speculated_and_identical(stacks):
    # The penalties and min_tokens depend on the tokens taken so far: each draft row is sampled only after the one
    # before it was taken, so they see what plain decoding shows them.
    on, off = stacks
    drafted = on.stats().lookup_drafted
    processing = [{"repetition_penalty": 1.3}, {"presence_penalty": 0.6, "frequency_penalty": 0.4},
                  {"min_tokens": 20, "logit_bias": {"7": 3.0}}]
    for prompt in PROMPTS:
        for extra in processing:
            kw = dict(prompt=prompt, max_tokens=40, temperature=0, logprobs=1)
            if "logit_bias" in extra:
                kw["logit_bias"] = extra["logit_bias"]
            body = {k: v for k, v in extra.items() if k != "logit_bias"}
            assert _complete(on, **kw, extra_body=body) == _complete(off, **kw, extra_body=body), (prompt, extra)
    assert on.stats().lookup_drafted > drafted


def test_stop_strings_and_stop_tokens_behave_alike(stacks):
    on, off = stacks
    for prompt in PROMPTS:
        text = _complete(off, prompt=prompt, max_tokens=60, temperature=0)[0][0]
        if len(text) < 20:
            continue
        for stop in (text[12:15], text[-4:]):
            for extra in ({}, {"include_stop_str_in_output": True}):
                kw = dict(prompt=prompt, max_tokens=60, temperature=0, stop=[stop], extra_body=extra or None)
                got = _complete(on, **kw)
                assert got == _complete(off, **kw), (prompt, stop, extra)
                assert got[0][1] == "stop"
        # a stop token id the greedy output emits (vLLM's stop_token_ids)
        kw = dict(prompt=prompt, max_tokens=60, temperature=0, logprobs=1)
        tokens = _complete(off, **kw)[0][2]
        kw = dict(prompt=prompt, max_tokens=60, temperature=0, extra_body={"stop_token_ids": [5, 9, 13]})
        assert _complete(on, **kw) == _complete(off, **kw)
        assert tokens


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_constrained_outputs_are_identical(stacks, temperature):
    """Forced runs apply to sampled rows too (a forced token draws nothing): the same seeds give the same output."""
    on, off = stacks
    constraints = [{"extra_body": {"response_format": {"type": "json_schema",
                                                       "json_schema": {"name": "x", "schema": SCHEMA}}}},
                   {"extra_body": {"guided_choice": ["the value is 12", "the value is 13", "nothing"]}},
                   {"extra_body": {"guided_regex": "[0-9]{3}-[0-9]{3}-[0-9]{4} (ok|not ok)"}}]
    for c in constraints:
        for seed in (1, 2):
            kw = dict(prompt=PROMPTS[seed], max_tokens=160, temperature=temperature, seed=seed, n=2, logprobs=1, **c)
            got = _complete(on, **kw)
            assert got == _complete(off, **kw), c
    out = _complete(on, prompt="x", max_tokens=160, temperature=temperature, seed=3, **constraints[0])
    if out[0][1] == "stop":
        json.loads(out[0][0])


def test_concurrent_requests_match_plain_decoding(stacks):
    """Several speculating rows in one batch (--lookup-max-batch 8) give what each gives through plain decoding."""
    on, off = stacks
    want = {p: _complete(off, prompt=p, max_tokens=40, temperature=0, logprobs=1) for p in PROMPTS}
    got, errors = {}, []

    def run(p):
        try:
            got[p] = _complete(on, prompt=p, max_tokens=40, temperature=0, logprobs=1)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert got == want


def test_counters(stacks):
    on, off = stacks
    # Make sure both paths ran at least once in this module, whatever order the tests ran in.
    _complete(on, prompt=PROMPTS[1], max_tokens=30, temperature=0)
    _complete(on, prompt="x", max_tokens=32, temperature=0, extra_body={"guided_choice": ["the value is 12"]})
    st = on.stats()
    assert st.forced_tokens > 0
    assert st.lookup_drafted > 0 and 0 < st.lookup_accepted <= st.lookup_drafted
    assert st.lookup_acceptance == pytest.approx(st.lookup_accepted / st.lookup_drafted)
    text = httpx.get(on.metrics_url, timeout=10).text

    def metric(name):
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        assert m, name
        return float(m.group(1))

    assert metric("splitgemma_decode_forced_tokens_total") == st.forced_tokens
    assert metric("splitgemma_decode_lookup_drafted_tokens_total") == st.lookup_drafted
    assert metric("splitgemma_decode_lookup_accepted_tokens_total") == st.lookup_accepted
    assert metric("splitgemma_decode_lookup_acceptance_rate") == pytest.approx(st.lookup_acceptance)
    so = off.stats()
    assert (so.forced_tokens, so.lookup_drafted, so.lookup_accepted) == (0, 0, 0)


def test_a_prediction_drafts_and_changes_no_token(stacks):
    """OpenAI's predicted outputs (chat's `prediction`): the on stack drafts from the prediction first, the tokens
    are plain decoding's whatever the prediction says, greedy and seeded; a prediction that is the answer is mostly
    accepted (the decode worker's counters), and usage says how much of each prediction the answer repeats."""
    on, off = stacks
    messages = [{"role": "user", "content": "Tell me a story about a cat"}]
    kw = dict(model=MODEL_NAME, messages=messages, max_tokens=40)
    answer = off.client().chat.completions.create(temperature=0, **kw).choices[0].message.content
    sampled = off.client().chat.completions.create(temperature=1.0, seed=3, **kw).choices[0].message.content

    def accepted_drafts(**extra):
        before = on.stats().lookup_accepted
        r = on.client().chat.completions.create(**kw, **extra)
        return r, on.stats().lookup_accepted - before

    plain, without = accepted_drafts(temperature=0)
    assert plain.choices[0].message.content == answer
    assert plain.usage.completion_tokens_details is None or \
        plain.usage.completion_tokens_details.accepted_prediction_tokens is None
    counts = {}
    for name, text in (("whole", answer), ("half", answer[:len(answer) // 2] + " and then the end"),
                       ("other", "one two three four five six seven eight nine ten")):
        r, drafted = accepted_drafts(temperature=0, prediction={"type": "content", "content": text})
        assert r.choices[0].message.content == answer, name
        d = r.usage.completion_tokens_details
        ids = httpx.post(on.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
        assert d.accepted_prediction_tokens + d.rejected_prediction_tokens == len(ids)
        counts[name] = (d.accepted_prediction_tokens / len(ids), drafted)
        again = on.client().chat.completions.create(temperature=1.0, seed=3, prediction={
            "type": "content", "content": [{"type": "text", "text": text}]}, **kw)
        assert again.choices[0].message.content == sampled, name
    assert counts["whole"][0] > 0.9 and counts["whole"][0] > counts["half"][0] > counts["other"][0]
    assert counts["whole"][1] > without  # the prediction's drafts are accepted where the prompt's and output's fail


def test_accepted_prediction_tokens_are_the_longest_common_subsequence():
    import random

    from splitgemma.services.gateway.render import predicted_in

    def lcs(a, b):  # the textbook table, row by row
        prev = [0] * (len(b) + 1)
        for x in a:
            cur = [0]
            for j, y in enumerate(b):
                cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
            prev = cur
        return prev[-1]

    rng = random.Random(5)
    for _ in range(300):
        a = [rng.randrange(5) for _ in range(rng.randrange(0, 40))]
        b = [rng.randrange(5) for _ in range(rng.randrange(0, 40))]
        assert predicted_in(a, b) == predicted_in(b, a) == lcs(a, b), (a, b)


def test_a_prediction_is_looked_up_at_its_place():
    """An n-gram that repeats in the prediction is drafted from its occurrence at or after the place the last draft
    came from, so an answer that follows the prediction drafts its continuation, not an earlier repeat's."""
    idx = NgramIndex([7, 8], prediction=[1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3, 6])
    for t in (1, 2, 3):
        idx.append(t)
    assert idx.draft(2) == [9, 1]            # the first occurrence: nothing was drafted from it yet
    for t in (9, 1, 2, 3):
        idx.append(t)
    assert idx.draft(3) == [4, 5, 1]         # at or after where the last draft came from
    for t in (4, 5, 1, 2, 3):
        idx.append(t)
    assert idx.draft(2) == [6]               # the prediction's end
    assert NgramIndex([5, 5], prediction=[0, 1]).draft(2) == []      # no match there: the prompt lookup's (none)
    assert NgramIndex([1, 2, 7, 1, 2], prediction=[0, 1]).draft(2) == [7, 1]
    # a draft from the prediction may be longer than the prompt lookup's (the decode worker asks for MAX_DRAFT)
    assert NgramIndex([4, 1, 2], prediction=[1, 2, 3, 4, 5, 6, 7]).draft(2, 4) == [3, 4, 5, 6]
    assert NgramIndex([1, 2, 7, 1, 2], prediction=[0, 1]).draft(2, 4) == [7, 1]


def test_ngram_index_drafts_what_followed_the_last_occurrence():
    idx = NgramIndex([1, 2, 3, 4, 5, 1, 2, 3])
    assert idx.draft(4) == [4, 5, 1, 2]  # the trigram (1, 2, 3) was followed by 4 5 1 2 ...
    idx.append(9)
    assert idx.draft(4) == []  # (2, 3, 9) and (3, 9) never occurred before
    idx.append(4)
    assert idx.draft(4) == []  # nor (3, 9, 4) and (9, 4)
    idx.append(5)
    assert idx.draft(3) == [1, 2, 3]  # (9, 4, 5) is new; the bigram (4, 5) was followed by 1 2 3
    idx.append(1)
    assert idx.draft(8) == [2, 3, 9, 4, 5, 1]  # (4, 5, 1): its first occurrence; the draft stops at the end


def test_ngram_index_built_at_its_first_draft_equals_one_built_token_by_token():
    """The table is built at the first draft() (admission only keeps the ids): whenever that happens, the drafts are
    those of an index that recorded every token as it came."""
    import random
    for trial in range(300):
        rnd = random.Random(trial)
        prompt = [rnd.randrange(5) for _ in range(rnd.randrange(0, 60))]
        late, early = NgramIndex(prompt), NgramIndex([])
        early.draft(1)  # builds the empty table: from here on every append records its n-grams
        for t in prompt:
            early.append(t)
        output = [rnd.randrange(5) for _ in range(rnd.randrange(0, 10))]
        first = rnd.randrange(0, len(output) + 1)
        for i, t in enumerate(output):
            if i == first:
                assert late.draft(4) == early.draft(4)
            late.append(t)
            early.append(t)
        assert late.draft(8) == early.draft(8), (prompt, output)


def observe(costs, ms_by_rows: dict[int, float]) -> None:
    """Steps of these costs, each count as often as StepCosts needs to trust it."""
    for _ in range(costs.min_samples):
        for rows, ms in ms_by_rows.items():
            costs.observe(rows, ms / 1000)


def test_step_costs_are_robust_medians():
    """A count's cost is trusted only after min_samples steps, and it is their median: one step slowed by a
    prefill beside it neither prices a draft length out nor makes it look cheap."""
    costs = StepCosts(window=8, min_samples=3)
    costs.observe(2, 0.230)  # beside a prefill
    assert costs.cost(2) is None
    costs.observe(2, 0.115), costs.observe(2, 0.117)
    assert costs.cost(2) == 0.117
    for _ in range(8):
        costs.observe(2, 0.200)  # the window holds the last 8: the host got slower
    assert costs.cost(2) == 0.200


def test_draft_length_follows_acceptance_and_measured_cost():
    costs = StepCosts()
    # Logits rows 1..9 of one sequence's step (E2B's ratios in docs/speculation.md up to 5 rows, then steeper).
    observe(costs, {1: 100, 2: 116, 3: 153, 4: 190, 5: 234, 6: 280, 7: 320, 8: 360, 9: 400})
    assert choose_drafts([0.5], [8], costs, 1) == [1]  # 1.5 tokens at 1.16 beat 1.75 at 1.53
    assert choose_drafts([0.1], [8], costs, 1) == [0]  # 1.1 tokens for 1.16: not worth a row
    assert choose_drafts([0.9], [8], costs, 1) == [3]  # long drafts pay while they are accepted
    assert choose_drafts([0.9], [1], costs, 1) == [1]  # never past the draft the index offered


def test_draft_lengths_are_explored():
    """A count of rows not measured yet is tried when it could pay at the cost of the largest measured count below
    it, smallest first; nothing is drafted before a plain step is measured."""
    costs = StepCosts()
    assert choose_drafts([0.5], [8], costs, 1) == [0]  # a plain step first
    observe(costs, {1: 100})
    assert choose_drafts([0.5], [8], costs, 1) == [1]
    observe(costs, {2: 116})
    assert choose_drafts([0.5], [8], costs, 1) == [2]  # 1.75 tokens for at least 1.16: try it
    observe(costs, {3: 153})
    assert choose_drafts([0.5], [4], costs, 1) == [1]  # 4 draft rows cost at least what 2 do: 1.94 / 1.53 < 1.5 / 1.16
    # Eight sequences, one draft row measured dear (1.32x: a block boundary, or a busy host): 2 rows cannot pay at
    # that cost (9.8 / 1.32 < 8), 3 could (10.7 / 1.32 > 8), so the search goes on to 3.
    costs = StepCosts()
    observe(costs, {8: 25.0, 9: 33.0})
    assert choose_drafts([0.9] * 8, [4] * 8, costs, 8) == [1, 1, 1, 0, 0, 0, 0, 0]


def test_drafts_are_chosen_for_the_whole_step():
    """In a batch every draft row is paid by the whole step: the rows go to the most likely draft tokens, whichever
    sequence they belong to, and only as many as raise the step's expected tokens per unit of time."""
    costs = StepCosts()
    observe(costs, {4: 100, 5: 104, 6: 108, 7: 112, 8: 140, 9: 175})
    # Four sequences: the rows 5-7 cost 4% each, the 8th 25%: the three best draft tokens are 0.9, 0.81 (the same
    # sequence's second) and 0.8; 0.729 more for 25% more time does not pay (6.51 at 1.12 against 7.24 at 1.4), nor
    # could any longer draft at the 9th row's cost or more.
    assert choose_drafts([0.9, 0.8, 0.3, 0.0], [4, 4, 4, 0], costs, 4) == [2, 1, 0, 0]
    # Equal drafts: the cheap rows take one token each (the first sequences' on a tie); the 8th row's 25% buys 0.3.
    assert choose_drafts([0.3, 0.3, 0.3, 0.3], [4, 4, 4, 4], costs, 4) == [1, 1, 1, 0]
    assert choose_drafts([0.9, 0.9], [0, 0], costs, 2) == [0, 0]  # no draft offered
