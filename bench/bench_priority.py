"""Priority scheduling under load: the time to first token of an interactive client while batch clients keep every
decode slot busy and the admission queue full, with --scheduling-policy priority against fcfs.

    python bench/bench_priority.py --model M.fgm [--tokenizer T.json] [--gguf M.gguf] [--slots 8]
                                   [--batch-clients 16] [--seconds 60] [--rounds 2]

Each round starts `splitgemma up` once per arm (fcfs, priority; with --gguf also llama-server on the same model's
GGUF, the host's anchor, which serves first come, first served; the order reversed every round) and runs, for --seconds after a --warmup: --batch-clients clients looping long greedy completions (--batch-prompt
random tokens, --batch-gen generated; priority --batch-priority under the priority arm) — more than the slots, so
requests queue — and one interactive client sending short ones (--prompt / --gen) back to back at priority 0.
Reported per arm: the interactive TTFT (median, p90, max), its requests, and the batch clients' aggregate tok/s
(what priority costs them). The machine is shared: the load average is printed with each arm.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time

from bench_serving import add_arm_arguments, one_request, stack_up


def run_arm(args, arm: str) -> dict:
    """arm: "fcfs" or "priority" (splitgemma's --scheduling-policy), or "llama-server" (first come, first served)."""
    server, extra = ("llama-server", ()) if arm == "llama-server" else \
        ("splitgemma", ("--scheduling-policy", arm))
    with stack_up(args, server, args.slots, extra) as (client, model):
        rng = random.Random(7)
        batch_priority = args.batch_priority if arm == "priority" else 0
        stop = threading.Event()
        measuring = threading.Event()
        batch_tokens = [0]
        lock = threading.Lock()

        def batch(k: int):
            while not stop.is_set():
                prompt = [rng.randrange(10, 1000) for _ in range(args.batch_prompt)]
                r = one_request(client, model, prompt, args.batch_gen, priority=batch_priority)
                if measuring.is_set():
                    with lock:
                        batch_tokens[0] += r["tokens"]

        threads = [threading.Thread(target=batch, args=(k,), daemon=True) for k in range(args.batch_clients)]
        for t in threads:
            t.start()
        time.sleep(args.warmup)
        measuring.set()
        t0 = time.perf_counter()
        ttft = []
        while time.perf_counter() - t0 < args.seconds:
            prompt = [rng.randrange(10, 1000) for _ in range(args.prompt)]
            ttft.append(one_request(client, model, prompt, args.gen, priority=0)["ttft"])
        wall = time.perf_counter() - t0
        measuring.clear()
        stop.set()
        for t in threads:
            t.join(timeout=600)
        return {"ttft": ttft, "batch_tok_s": batch_tokens[0] / wall, "load": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arm_arguments(ap, "the same model as a GGUF: llama-server (bench/peer_llamacpp.py's build, --parallel = "
                          "--slots) runs as a third arm, the host's anchor")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--batch-clients", type=int, default=16)
    ap.add_argument("--batch-prompt", type=int, default=512)
    ap.add_argument("--batch-gen", type=int, default=128)
    ap.add_argument("--batch-priority", type=int, default=10)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--warmup", type=float, default=10)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    args.lookup_k, args.model_name = 0, None  # plain decoding: the arms differ by their scheduling only
    arms = ["fcfs", "priority"] + (["llama-server"] if args.gguf else [])
    results: dict[str, list[dict]] = {a: [] for a in arms}
    for r in range(args.rounds):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            res = run_arm(args, arm)
            results[arm].append(res)
            t = sorted(res["ttft"])
            print(f"round {r + 1} {arm:12s}: interactive TTFT median {statistics.median(t) * 1e3:7.0f} ms, "
                  f"p90 {t[int(0.9 * (len(t) - 1))] * 1e3:7.0f} ms, max {t[-1] * 1e3:7.0f} ms over {len(t)} "
                  f"requests; batch {res['batch_tok_s']:6.1f} tok/s; load {res['load']:.2f}", flush=True)
    print(f"\n{args.slots} slots, {args.batch_clients} batch clients ({args.batch_prompt}+{args.batch_gen} tokens, "
          f"priority {args.batch_priority} under the priority arm), one interactive client ({args.prompt}+{args.gen} "
          f"tokens, priority 0), {args.seconds:g} s per arm, {args.rounds} rounds:")
    print("| arm | interactive TTFT median | p90 | requests | batch tok/s |\n|---|---:|---:|---:|---:|")
    for arm, rs in results.items():
        t = sorted(x for r in rs for x in r["ttft"])
        print(f"| {arm} | {statistics.median(t) * 1e3:.0f} ms | {t[int(0.9 * (len(t) - 1))] * 1e3:.0f} ms | "
              f"{len(t)} | {statistics.median(r['batch_tok_s'] for r in rs):.1f} |")


if __name__ == "__main__":
    main()
