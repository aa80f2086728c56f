"""Predicted outputs: decode speed of one chat stream with and without OpenAI's `prediction`.

    python bench/bench_prediction.py --model M.fgm [--tokenizer T.json] [--tokens 256] [--rounds 5]
                                     [--lookup-k 4]

Starts `splitgemma up` (prompt lookup as configured by --lookup-k, the adaptive draft policy), takes the greedy
answer of --tokens tokens (ignore_eos) to each of a few prompts, then alternates, per prompt and round, the same
request with no prediction, with the answer itself as the prediction, and with the answer edited (one region of
--edit-share of its words replaced; every --edit-every-th word replaced): the tokens are the same in every arm (checked); the decode rate (tokens after the
first over the time from the first to the last) differs. Reported: the median rate per arm, its ratio to no
prediction, and usage's accepted_prediction_tokens share. The machine is shared: the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench_serving import add_arm_arguments, stack_up

PROMPTS = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n",
           "The history of the printing press begins"]


def stream(client, model, prompt: str, tokens: int, prediction: str | None) -> tuple[str, float, float | None]:
    """(text, decode tok/s, accepted share of the prediction)."""
    extra = {"ignore_eos": True}
    kw = {} if prediction is None else {"prediction": {"type": "content", "content": prediction}}
    first = last = None
    text, usage = "", None
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=tokens, temperature=0, stream=True,
                                                stream_options={"include_usage": True}, extra_body=extra, **kw):
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            first = first or now
            last = now
        if chunk.usage is not None:
            usage = chunk.usage
    n = usage.completion_tokens
    share = None
    d = usage.completion_tokens_details
    if prediction is not None and d is not None and d.accepted_prediction_tokens is not None:
        share = d.accepted_prediction_tokens / max(1, d.accepted_prediction_tokens + d.rejected_prediction_tokens)
    return text, (n - 1) / (last - first), share


def scattered(text: str, every: int) -> str:
    """Every `every`-th word replaced (edits all through the text)."""
    words = text.split(" ")
    return " ".join("banana" if i % every == every - 1 else w for i, w in enumerate(words))


def one_region(text: str, share: float) -> str:
    """A run of `share` of the words, in the middle, replaced (one edit: the common case of a file changed in one
    place)."""
    words = text.split(" ")
    a = int(len(words) * (0.5 - share / 2))
    b = a + max(1, int(len(words) * share))
    return " ".join(words[:a] + ["banana"] * (b - a) + words[b:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arm_arguments(ap, "the same model as a GGUF: llama-server's single-stream rate on the same prompts (no "
                          "prediction: it has none) is printed beside, the host's anchor")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lookup-k", type=int, default=4)
    ap.add_argument("--edit-every", type=int, default=10)
    ap.add_argument("--edit-share", type=float, default=0.1)
    args = ap.parse_args()
    args.max_context, args.model_name = 2048, None
    anchor = None
    if args.gguf:
        with stack_up(args, "llama-server", 1) as (client, model):
            rates = [stream(client, model, p, args.tokens, None)[1] for _ in range(args.rounds) for p in PROMPTS]
            anchor = statistics.median(rates)
    with stack_up(args, "splitgemma", 1) as (client, model):
        answers = {p: stream(client, model, p, args.tokens, None)[0] for p in PROMPTS}
        arms = {"none": lambda a: None, "the answer": lambda a: a,
                f"one region edited ({args.edit_share:.0%} of the words)": lambda a: one_region(a, args.edit_share),
                f"edited all through (1 word in {args.edit_every})": lambda a: scattered(a, args.edit_every)}
        rates: dict[str, list[float]] = {a: [] for a in arms}
        shares: dict[str, list[float]] = {a: [] for a in arms}
        for r in range(args.rounds):
            for prompt, answer in answers.items():
                order = list(arms) if r % 2 == 0 else list(reversed(arms))
                for arm in order:
                    text, rate, share = stream(client, model, prompt, args.tokens, arms[arm](answer))
                    assert text == answer, f"{arm}: the tokens differ"
                    rates[arm].append(rate)
                    if share is not None:
                        shares[arm].append(share)
            print(f"round {r + 1}: " + ", ".join(f"{a} {statistics.median(rates[a]):.1f}" for a in arms)
                  + f" tok/s; load {os.getloadavg()[0]:.2f}", flush=True)
        base = statistics.median(rates["none"])
        print(f"\none stream, {args.tokens} greedy tokens, {len(PROMPTS)} prompts x {args.rounds} rounds, "
              f"--lookup-k {args.lookup_k}:")
        print("| prediction | decode tok/s (median) | vs none | accepted share of the prediction |\n|---|---:|---:|---:|")
        for arm in arms:
            m = statistics.median(rates[arm])
            share = f"{statistics.median(shares[arm]):.2f}" if shares[arm] else "–"
            print(f"| {arm} | {m:.1f} | {m / base:.2f}× | {share} |")
        if anchor is not None:
            print(f"| llama-server, same prompts, no prediction | {anchor:.1f} | {anchor / base:.2f}× | – |")


if __name__ == "__main__":
    main()
