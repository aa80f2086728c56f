#!/usr/bin/env python3
"""Prompt-lookup speculation through the service on copy-heavy chat requests, greedy and sampled: one stream's
decode rate with the decode worker's prompt lookup on (`splitgemma up`'s default) and off (`--lookup-k 0`), the two
stacks alternated over --passes, and every output compared: the same seed must give the same text either way
(docs/speculation.md).

    python bench/bench_lookup.py [--model m.fgm --tokenizer tok.json] [--passes 2] [--max-tokens 200]
    python bench/bench_lookup.py --clients 8        # batched: the aggregate rate of 8 concurrent clients

The requests are chat turns whose answer repeats much of the prompt (repeat a passage; rename a function in a
piece of code), the case prompt lookup is for, at temperature 0, 0.7 and 1.0, two seeds each. Per request: decode
rate = (chunks - 1) / (last chunk - first chunk), one token a chunk; per arm and setting, the median over seeds and
passes; the lookup counters of the decode worker (drafted, accepted) per pass. Without --model, the default model
(Gemma 3 270M).

With --clients N (N > 1) the stack has N slots and N clients each send every request of the list above, one after
the other (client c starts at request c and seeds its requests c·100 + seed), so the decode worker runs batches of
up to N sequences: the figure is the aggregate rate, completion tokens over the wall time of all N·12 requests,
per arm and pass (the drafts of a batch are chosen for the whole step: docs/speculation.md).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_serving import start_stack  # noqa: E402

PASSAGE = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly quick "
           "daft zebras jump! The five boxing wizards jump quickly. Sphinx of black quartz, judge my vow. Two driven "
           "jocks help fax my big quiz.")
CODE = '''def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list."""
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out
'''
TASKS = {"repeat": "Repeat the following text exactly, twice:\n\n" + PASSAGE,
         "rename": "Rename the function below to merge_lists and return the whole code:\n\n" + CODE}
TEMPERATURES = (0.0, 0.7, 1.0)
SEEDS = (1, 2)


def one(client, model: str, prompt: str, temperature: float, seed: int, max_tokens: int) -> tuple[str, float]:
    stamps, text = [], ""
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=temperature, seed=seed, stream=True)
    for chunk in stream:
        stamps.append(time.perf_counter())
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 2 else float("nan")
    return text, rate


def batched(client, model: str, clients: int, max_tokens: int) -> tuple[dict, float]:
    """Every client sends every request once, in turn; the texts by (client, task, temperature, seed) and the
    aggregate completion tokens per second."""
    requests = [(task, t, seed) for task in TASKS for t in TEMPERATURES for seed in SEEDS]
    texts = {}

    def run(c: int) -> int:
        tokens = 0
        for i in range(len(requests)):
            task, t, seed = requests[(c + i) % len(requests)]
            r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": TASKS[task]}],
                                               max_tokens=max_tokens, temperature=t, seed=c * 100 + seed)
            texts[(c, task, t, seed)] = r.choices[0].message.content
            tokens += r.usage.completion_tokens
        return tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        try:
            tokens = sum(pool.map(run, range(clients)))
        except Exception as e:  # noqa: BLE001 - any failed request voids the run
            raise SystemExit(f"a request failed: {e!r}") from e
    return texts, tokens / (time.perf_counter() - t0)


def lookup_counters(metrics_url: str) -> tuple[float, float]:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    got = [float(re.search(rf"^splitgemma_decode_lookup_{k}_tokens_total (\S+)$", text, re.M).group(1))
           for k in ("drafted", "accepted")]
    return got[0], got[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="the .fgm (default: the default model)")
    ap.add_argument("--tokenizer")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--clients", type=int, default=1,
                    help="concurrent clients; more than 1 measures the aggregate rate of batched decoding")
    args = ap.parse_args()
    import openai

    from splitgemma.serving.ports import free_ports

    if args.model is None:
        from splitgemma.default_model import resolve_default_model
        fgm, tok, _ = resolve_default_model(progress=True)
        args.model, args.tokenizer = str(fgm), args.tokenizer or str(tok)
    args.concurrency = [args.clients]  # start_stack gives the stack a slot per concurrent stream
    rates: dict[tuple, list[float]] = {}
    texts: dict[tuple, str] = {}
    mismatches = []
    for p in range(args.passes):
        for arm, extra in (("lookup on", ()), ("lookup off", ("--lookup-k", "0"))):
            with tempfile.TemporaryDirectory() as shm:
                [metrics_port] = free_ports(1)  # the decode worker's metrics: its lookup counters
                proc, url = start_stack(args, shm, extra + ("--decode-metrics-port", str(metrics_port)))
                try:
                    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
                    model = client.models.list().data[0].id
                    if args.clients > 1:
                        got, rate = batched(client, model, args.clients, args.max_tokens)
                        rates.setdefault((arm,), []).append(rate)
                        print(f"pass {p + 1} {arm:10s} {rate:.1f} tok/s aggregate", flush=True)
                    else:
                        got = {}
                        for task, prompt in TASKS.items():
                            for t in TEMPERATURES:
                                for seed in SEEDS:
                                    got[(task, t, seed)], rate = one(client, model, prompt, t, seed, args.max_tokens)
                                    rates.setdefault((arm, task, t), []).append(rate)
                    for key, text in got.items():
                        if key in texts and texts[key] != text:
                            mismatches.append((arm, p) + key)
                        texts.setdefault(key, text)
                    drafted, accepted = lookup_counters(f"http://127.0.0.1:{metrics_port}/metrics")
                    print(f"pass {p + 1} {arm:10s} drafted {drafted:.0f}, accepted {accepted:.0f}", flush=True)
                finally:
                    proc.terminate()
                    proc.wait(60)
    if args.clients > 1:
        off, on = (statistics.median(rates[(arm,)]) for arm in ("lookup off", "lookup on"))
        print(f"\n{args.clients} clients, aggregate tok/s (median of {args.passes} passes): lookup off {off:.1f}, "
              f"lookup on {on:.1f}, {on / off:.2f}x")
    else:
        print(f"\n{'task':8s} {'temperature':>11s} {'lookup off':>11s} {'lookup on':>10s} {'ratio':>6s}  "
              "(tok/s, one stream)")
        for task in TASKS:
            for t in TEMPERATURES:
                off = statistics.median(rates[("lookup off", task, t)])
                on = statistics.median(rates[("lookup on", task, t)])
                print(f"{task:8s} {t:11.1f} {off:11.1f} {on:10.1f} {on / off:5.2f}x")
    print("outputs: " + ("identical with lookup on and off (every seed, every pass)" if not mismatches
                         else f"{len(mismatches)} DIFFER: {mismatches}"))
    if mismatches:
        sys.exit(1)


if __name__ == "__main__":
    main()
