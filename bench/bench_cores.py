"""How the prefill and decode workers of one `splitgemma up` should share the host's CPUs (`up --cores`): for each
rule, N greedy streams decode while one long prompt arrives; it reports the long prompt's time to first token and
the streams' aggregate decode rate while that prompt is prefilled and after.

    python bench/bench_cores.py --model /tmp/e2b.fgm --tokenizer tok.json [--streams 8] [--long-prompt 1024]
                                [--gen-tokens 80] [--repeats 2] [--rules shared,split]

Each round starts `splitgemma up --cores RULE`, warms both workers up, starts the streams (random-id prompts of
--prompt-tokens, ignore_eos, one token per SSE chunk), waits until every stream has its third token, then sends the
long prompt (max_tokens 1) and times it. Decode rate = stream tokens that arrived in the window / its length: the
window from sending the long prompt to its answer ("during prefill"), and a window as long right after it
("after"). The rules alternate over --repeats rounds; medians are printed with the load average (a shared machine).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import tempfile
import threading
import time

import openai

from bench_serving import one_request, start_stack


def stream(client, model: str, prompt: list[int], gen: int, stamps: list[float]) -> None:
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=gen, temperature=0, stream=True,
                                           logprobs=0, extra_body={"ignore_eos": True}):
        if chunk.choices:
            stamps.append(time.perf_counter())


def one_round(args, rule: str, prompts, long_prompt) -> dict:
    shm = tempfile.mkdtemp(prefix="sg-bench-", dir="/dev/shm")
    args.concurrency = [args.streams + 1]
    proc, url = start_stack(args, shm, ("--cores", rule))
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        one_request(client, args.model_name, prompts[0], 4)  # first touch of the weights in both workers
        one_request(client, args.model_name, long_prompt[: args.prompt_tokens], 1)
        stamps = [[] for _ in range(args.streams)]
        threads = [threading.Thread(target=stream, args=(client, args.model_name, prompts[i], args.gen_tokens,
                                                          stamps[i])) for i in range(args.streams)]
        for t in threads:
            t.start()
        while min(len(s) for s in stamps) < 3:
            time.sleep(0.01)
        t0 = time.perf_counter()
        client.completions.create(model=args.model_name, prompt=long_prompt, max_tokens=1, temperature=0)
        t1 = time.perf_counter()
        for t in threads:
            t.join()
        end = t1 + (t1 - t0)
        if max(s[-1] for s in stamps) < end:
            raise SystemExit("the streams ended before the window after the prefill: raise --gen-tokens")
        during = sum(t0 <= x < t1 for s in stamps for x in s) / (t1 - t0)
        after = sum(t1 <= x < end for s in stamps for x in s) / (t1 - t0)
        return {"ttft": t1 - t0, "during": during, "after": after}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        os.rmdir(shm)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer")
    ap.add_argument("--model-name", help="model id to request (default: the file name without .fgm)")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--long-prompt", type=int, default=1024)
    ap.add_argument("--gen-tokens", type=int, default=80)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rules", default="shared,split")
    args = ap.parse_args()
    args.threads = None
    args.model_name = args.model_name or os.path.basename(args.model).removesuffix(".fgm")
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 1024) for _ in range(args.prompt_tokens)] for _ in range(args.streams)]
    long_prompt = [rng.randrange(4, 1024) for _ in range(args.long_prompt)]
    rules = args.rules.split(",")
    print(f"model {args.model}: {args.streams} streams, long prompt {args.long_prompt} tokens; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    got = {r: [] for r in rules}
    for k in range(args.repeats):
        for rule in rules if k % 2 == 0 else rules[::-1]:
            res = one_round(args, rule, prompts, long_prompt)
            print(f"  {rule}: TTFT {res['ttft']:.2f} s, decode {res['during']:.1f} tok/s during the prefill, "
                  f"{res['after']:.1f} after", flush=True)
            got[rule].append(res)
    print(f"{'rule':<8} {'long-prompt TTFT s':>19} {'decode tok/s during':>20} {'after':>7}")
    for rule, rs in got.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("ttft", "during", "after")}
        print(f"{rule:<8} {med['ttft']:>19.2f} {med['during']:>20.1f} {med['after']:>7.1f}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
