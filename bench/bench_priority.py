"""Priority scheduling under load: the time to first token of an interactive client while batch work keeps every
decode slot busy and the admission queue full, with --scheduling-policy priority against fcfs, and the same work as
one batch of the Batch API (docs/batches.md).

    python bench/bench_priority.py --model M.fgm [--tokenizer T.json] [--gguf M.gguf] [--slots 8]
                                   [--batch-clients 16] [--seconds 60] [--rounds 2]

Each round starts `splitgemma up` once per arm (the order reversed every round) and runs, for --seconds after a
--warmup, one interactive client sending short greedy completions (--prompt random tokens, --gen generated) back to
back at priority 0 beside the batch work: long greedy completions (--batch-prompt random tokens, --batch-gen
generated), --batch-clients of them at once — more than the slots, so requests queue. The arms: fcfs (the batch
work as --batch-clients clients looping requests, first come, first served), priority (the same clients at
priority --batch-priority under --scheduling-policy priority), batch-api (the work as one batch of --batch-requests
requests through /v1/files and /v1/batches, the gateway's --batch-concurrency --batch-concurrency: by default two
slots fewer than there are, the room it leaves to interactive requests; under fcfs) and, with --gguf,
llama-server on the same model's GGUF (the host's anchor, first come, first served, the clients' arm). Reported
per arm: the interactive TTFT (median, p90, max), its requests, and the batch work's aggregate tok/s (what the
interactive client's precedence costs it). The machine is shared: the load average is printed with each arm.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time

from bench_serving import add_arm_arguments, one_request, stack_up


def interactive(args, client, model: str, rng: random.Random) -> tuple[list[float], float]:
    """The interactive client's TTFTs over --seconds, and the wall time they took."""
    t0 = time.perf_counter()
    ttft = []
    while time.perf_counter() - t0 < args.seconds:
        prompt = [rng.randrange(10, 1000) for _ in range(args.prompt)]
        ttft.append(one_request(client, model, prompt, args.gen, priority=0)["ttft"])
    return ttft, time.perf_counter() - t0


def batch_api_arm(args, client, model: str, rng: random.Random) -> dict:
    """The batch work as one batch (the gateway runs --batch-concurrency of its requests at once, at the lowest
    priority); its rate from the output tokens its answered requests report."""
    lines = [json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions", "body": {
        "model": model, "prompt": [rng.randrange(10, 1000) for _ in range(args.batch_prompt)],
        "max_tokens": args.batch_gen, "temperature": 0, "ignore_eos": True}}) for i in range(args.batch_requests)]
    f = client.files.create(file=("work.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    time.sleep(args.warmup)
    before = client.batches.retrieve(batch.id).usage.output_tokens
    ttft, wall = interactive(args, client, model, rng)
    after = client.batches.retrieve(batch.id)
    client.batches.cancel(batch.id)
    if after.status != "in_progress":
        raise SystemExit(f"the batch ended ({after.status}) before the measurement did: raise --batch-requests")
    return {"ttft": ttft, "batch_tok_s": (after.usage.output_tokens - before) / wall, "load": os.getloadavg()[0]}


def run_arm(args, arm: str) -> dict:
    """arm: "fcfs" or "priority" (splitgemma's --scheduling-policy), "batch-api", or "llama-server" (first come,
    first served)."""
    server, extra = ("llama-server", ()) if arm == "llama-server" else \
        ("splitgemma", ("--batch-concurrency", str(args.batch_concurrency))) if arm == "batch-api" else \
        ("splitgemma", ("--scheduling-policy", arm))
    with stack_up(args, server, args.slots, extra) as (client, model):
        rng = random.Random(7)
        if arm == "batch-api":
            return batch_api_arm(args, client, model, rng)
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
        ttft, wall = interactive(args, client, model, rng)
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
    ap.add_argument("--batch-concurrency", type=int, help="the batch-api arm's gateway --batch-concurrency "
                    "(default: --slots - 2)")
    ap.add_argument("--batch-requests", type=int, default=2000, help="requests of the batch-api arm's batch (more "
                    "than the measurement can finish: it is cancelled after it)")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--warmup", type=float, default=10)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    args.lookup_k, args.model_name = 0, None  # plain decoding: the arms differ by their scheduling only
    args.batch_concurrency = args.batch_concurrency or max(1, args.slots - 2)
    arms = ["fcfs", "priority", "batch-api"] + (["llama-server"] if args.gguf else [])
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
          f"priority {args.batch_priority} under the priority arm; one batch at the lowest, {args.batch_concurrency} "
          f"at once, under batch-api), "
          f"one interactive client ({args.prompt}+{args.gen} "
          f"tokens, priority 0), {args.seconds:g} s per arm, {args.rounds} rounds:")
    print("| arm | interactive TTFT median | p90 | requests | batch tok/s |\n|---|---:|---:|---:|---:|")
    for arm, rs in results.items():
        t = sorted(x for r in rs for x in r["ttft"])
        print(f"| {arm} | {statistics.median(t) * 1e3:.0f} ms | {t[int(0.9 * (len(t) - 1))] * 1e3:.0f} ms | "
              f"{len(t)} | {statistics.median(r['batch_tok_s'] for r in rs):.1f} |")


if __name__ == "__main__":
    main()
