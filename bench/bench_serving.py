"""Serving benchmark: time to first token and tokens/s through the gateway (the official openai client, SSE
streaming) for 1 and N concurrent clients, beside the in-process engine on the same prompt and batch sizes.

    python bench/bench_serving.py --model m.fgm [--tokenizer tokenizer.json] [--concurrency 1,8]
                                  [--prompt-tokens 128] [--gen-tokens 64] [--requests 2] [--threads 2]
    python bench/bench_serving.py --url http://127.0.0.1:8000/v1 --model m.fgm ...   (a stack already running)

Without --url the stack is started with `splitgemma up` (decode + prefill + gateway on loopback) and stopped at
the end. With --gguf FILE beside --model, llama.cpp's llama-server serves the same request profile as a second
arm, the two alternated over --passes, each started for its turn and stopped after it, and the medians over the
passes are printed with their ratios (bench/peer_llamacpp.py builds llama-server and starts it on a free loopback
port: --parallel = the largest concurrency, its prompt cache on, unified KV, --threads threads). Give it the GGUF
the .fgm was converted from (the default model's Q4_K_M file) and both serve the same weights. --peer llama-server
--gguf FILE runs that arm alone (no engine rows):

    python bench/bench_serving.py --model m.fgm --gguf m.gguf --concurrency 1,8,32 --passes 2
    python bench/bench_serving.py --peer llama-server --gguf ~/.cache/splitgemma/peer/models/.../x-q4_0.gguf

The stack runs with prompt-lookup speculation as `splitgemma up` does by default (in steps of up to 8 sequences):
on these repetitive greedy outputs it accepts many drafts and lifts the decode rate far above the engine's;
--lookup-k 0 gives plain decoding, as llama-server runs.

Prompts are random token ids (any model's vocabulary will do; the gateway still needs the model's tokenizer to start:
--tokenizer, or a tokenizer.json beside the .fgm; the random E2B of bench/peer_llamacpp.py has one in its hf/ folder);
every request generates exactly --gen-tokens tokens (ignore_eos), greedy, with per-token logprobs so that each token
arrives as its own chunk.

--profile seed runs the seed's serving profile instead (fastgemma's model card: 8 concurrent requests sharing a
tool-declaration prefix, long prompts, long outputs; TTFT first 70.1 s / last 342.1 s, 191.6 prefill and 46.8
decode tok/s aggregate on 4 cores with 8192-token prompts), scaled to 2 cores so that both engines finish in about
ten minutes: 8 clients at once, each prompt a shared 512-token prefix + 1,536 tokens of its own (2,048 in all,
a quarter of the seed's), 128 generated tokens each. Arms, alternated over --passes: splitgemma (`up --slots 8`,
once per --policies prefill policy) and, with --gguf, llama-server (--parallel 8, its prompt cache on). Per arm:
TTFT first / median / last (and last/first), aggregate prefill tok/s (prompt tokens / time to the last first
token), aggregate decode tok/s (tokens after each request's first / the span from the first first-token to the
last token; and "all running": the streams' summed rates between the last first token and the first stream's end,
when all 8 decode and no prefill is left — the figure to hold against the engine at batch 8) and the prefix hit rate (usage.prompt_tokens_details.cached_tokens / prompt tokens):

    python bench/bench_serving.py --profile seed --model e2b.fgm --gguf e2b-q4_0.gguf [--passes 2]

Per request: TTFT = request sent → first token chunk; decode rate = (tokens − 1) / (last chunk − first chunk).
Aggregate = all tokens generated / wall time of the whole round. The engine rows run the same model in this
process: TTFT = prefill of the prompt + sampling; decode = Model.decode steps at batch 1 and N. The machine is
shared: the load average is printed, and a loaded machine lowers every figure.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path


def start_stack(args, shm_dir: str, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`splitgemma up` for args.model with slots for max(args.concurrency) streams (and `extra` options); its
    process and /v1 URL once it is ready."""
    argv = [sys.executable, "-m", "splitgemma", "up", "--model", args.model, "--port", "0",
            "--slots", str(max(args.concurrency)), "--max-context", str(args.max_context),
            "--shm-dir", shm_dir, "--log-level", "WARNING", *extra]
    if args.tokenizer:
        argv += ["--tokenizer", args.tokenizer]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE)
    line, deadline = b"", time.monotonic() + 600
    while not line.endswith(b"\n"):
        if p.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"splitgemma up did not start (status {p.poll()})")
        if select.select([p.stdout], [], [], 0.5)[0]:
            line += os.read(p.stdout.fileno(), 4096)
    m = re.search(rb"at (http://\S+/v1)", line)
    if not m:
        raise SystemExit(f"unexpected output from splitgemma up: {line!r}")
    return p, m.group(1).decode()


def add_arm_arguments(ap: argparse.ArgumentParser, gguf_help: str) -> None:
    """The options stack_up's arms read: the model (.fgm), its tokenizer, threads, and the GGUF of llama-server's."""
    ap.add_argument("--model", required=True, help="the .fgm file splitgemma serves")
    ap.add_argument("--tokenizer", help="tokenizer.json (default: beside the model)")
    ap.add_argument("--threads", type=int, help="compute threads per worker (default: the usable CPUs)")
    ap.add_argument("--gguf", help=gguf_help)


@contextmanager
def stack_up(args, arm: str, slots: int, extra: tuple[str, ...] = ()):
    """start_arm's server ("splitgemma" with `slots` slots and `extra` options, or "llama-server" with `slots`
    parallel slots): yields (an openai client of it, its model id); stopped after."""
    import openai
    args.concurrency = [slots]
    stop, url, _ = start_arm(args, arm, slots, extra)
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        yield client, client.models.list().data[0].id
    finally:
        stop()


def one_request(client, model: str, prompt: list[int], gen: int, priority: int = 0) -> dict:
    """One streamed greedy completion of exactly `gen` tokens (`priority`: vLLM's field, sent when not 0)."""
    t0 = time.perf_counter()
    first = last = None
    tokens = chunks = cached = 0
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=gen, temperature=0, stream=True,
                                       logprobs=0, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True, **({"priority": priority} if priority else {})})
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices:
            if first is None:
                first = now
            last = now
            chunks += 1
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
            details = getattr(chunk.usage, "prompt_tokens_details", None)
            cached = (getattr(details, "cached_tokens", None) or 0) if details is not None else 0
    tokens = tokens or chunks  # a server that sends no usage: one token per chunk (logprobs asks for that)
    return {"ttft": first - t0, "e2e": last - t0, "tokens": tokens, "cached": cached, "sent": t0, "first": first,
            "last": last, "prompt_tokens": len(prompt),
            "decode_tok_s": (tokens - 1) / (last - first) if tokens > 1 and last > first else float("nan")}


def gateway_round(url: str, model: str, concurrency: int, requests: int, prompts, gen: int) -> dict:
    import openai
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    results: list[dict] = []
    lock = threading.Lock()

    def worker(k: int):
        for r in range(requests):
            res = one_request(client, model, prompts[(k * requests + r) % len(prompts)], gen)
            with lock:
                results.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"ttft": [r["ttft"] for r in results], "decode": [r["decode_tok_s"] for r in results],
            "aggregate": sum(r["tokens"] for r in results) / wall, "n": len(results)}


def engine_figures(args, prompts, batch: int, gen: int) -> dict:
    from splitgemma.engine import Model, open_arena, sample
    kw = dict(max_context=args.max_context, chunk=256, max_batch=max(args.concurrency), threads=args.threads)
    prefill_model = Model(args.model, weights="auto:16", **kw)
    decode_model = Model(args.model, weights="int4", **kw)
    arena = open_arena(prefill_model, batch)
    prefill_model.prefill(arena, 0, prompts[0])  # warm-up, as the gateway rows have
    decode_model.decode(arena, [0], [5], [len(prompts[0])])
    ttft, toks = [], []
    for slot in range(batch):
        t0 = time.perf_counter()
        logits = prefill_model.prefill(arena, slot, prompts[slot % len(prompts)])
        toks.append(sample(logits, temperature=0).token)
        ttft.append(time.perf_counter() - t0)
    pos = [len(prompts[s % len(prompts)]) for s in range(batch)]
    t0 = time.perf_counter()
    for _ in range(gen - 1):
        logits = decode_model.decode(arena, list(range(batch)), toks, pos)
        toks = [sample(logits[b], temperature=0).token for b in range(batch)]
        pos = [p + 1 for p in pos]
    dt = time.perf_counter() - t0
    return {"ttft": ttft, "decode_per_seq": (gen - 1) / dt, "aggregate": batch * (gen - 1) / dt}


# The seed's profile (docs/benchmarks.md, "Serving: the seed profile"), scaled to 2 cores.
SEED = {"clients": 8, "shared": 512, "unique": 1536, "gen": 128}
SEED_PUBLISHED = "fastgemma (4 cores, 8192-token prompts): TTFT first 70.1 s, last 342.1 s; prefill 191.6, decode 46.8 tok/s"


def seed_prompts(vocab: int, seed: int) -> list[list[int]]:
    """8 prompts: one shared prefix (the tool declarations), then each its own tokens. A new prefix per pass, so
    no pass finds the previous pass's prefix cached."""
    rng = random.Random(seed)
    shared = [rng.randrange(4, vocab) for _ in range(SEED["shared"])]
    return [shared + [rng.randrange(4, vocab) for _ in range(SEED["unique"])] for _ in range(SEED["clients"])]


def seed_round(url: str, model: str, prompts: list[list[int]]) -> dict:
    import openai
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=1800)
    results: list[dict] = [None] * len(prompts)
    errors: list[str] = []

    def worker(k: int):
        try:
            results[k] = one_request(client, model, prompts[k], SEED["gen"])
        except Exception as e:  # noqa: BLE001 - a failed request is a result of the run
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [r for r in results if r is not None]
    if not ok:
        return {"ok": 0, "errors": errors}
    start = min(r["sent"] for r in ok)
    ttft = sorted(r["ttft"] for r in ok)
    first_token, last_token = max(r["first"] for r in ok), max(r["last"] for r in ok)
    # Decode with every stream running and no prefill left: from the last first token to the first stream's end,
    # each stream at its own mean rate (they are decoded in one batch, one token a step each).
    window = min(r["last"] for r in ok) - first_token
    steady = sum((r["tokens"] - 1) / (r["last"] - r["first"]) for r in ok if r["last"] > r["first"]) \
        if window > 0 and len(ok) == len(prompts) else float("nan")
    return {"ok": len(ok), "errors": errors, "ttft_first": ttft[0], "ttft_median": statistics.median(ttft),
            "ttft_last": ttft[-1], "prefill_tok_s": sum(r["prompt_tokens"] for r in ok) / (first_token - start),
            "decode_tok_s": sum(r["tokens"] - 1 for r in ok) / (last_token - min(r["first"] for r in ok)),
            "decode_all_running": steady,
            "hit_rate": sum(r["cached"] for r in ok) / sum(r["prompt_tokens"] for r in ok)}


def seed_profile(args) -> None:
    """Alternate the arms over args.passes passes; print each pass and the medians."""
    arms = [("splitgemma " + pol, pol) for pol in args.policies.split(",")]
    if args.gguf:
        arms.append(("llama-server", None))
    args.concurrency = [SEED["clients"]]
    args.max_context = max(args.max_context, SEED["shared"] + SEED["unique"] + SEED["gen"])
    print(f"seed profile: {SEED['clients']} clients, prompts {SEED['shared']} shared + {SEED['unique']} own tokens, "
          f"{SEED['gen']} generated; model {args.model}" + (f", peer {args.gguf}" if args.gguf else ""))
    print(f"published: {SEED_PUBLISHED}")
    runs: dict[str, list[dict]] = {label: [] for label, _ in arms}
    for p in range(args.passes):
        order = arms[p % len(arms):] + arms[:p % len(arms)]  # rotate, so no arm always runs first
        for label, policy in order:
            prompts = seed_prompts(args.vocab, 1000 * p + len(runs[label]) + 1 + 97 * arms.index((label, policy)))
            load = os.getloadavg()[0]
            stop, url, name = start_arm(args, "llama-server" if policy is None else "splitgemma", SEED["clients"],
                                        extra=() if policy is None else ("--prefill-policy", policy))
            try:
                one_request(__import__("openai").OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600),
                            name, prompts[0][:16], 4)  # warm-up: first touch of the weights
                r = seed_round(url, name, prompts)
            finally:
                stop()
            r["load"] = load
            runs[label].append(r)
            print(f"pass {p + 1} {label:22} " + _seed_line(r), flush=True)
    print(f"\n{'median over passes':34} {'ok':>3} {'TTFT first':>10} {'median':>8} {'last':>8} {'last/first':>10} "
          f"{'prefill tok/s':>13} {'decode tok/s':>12} {'all running':>11} {'prefix hits':>11}")
    for label, rs in runs.items():
        good = [r for r in rs if r["ok"]]
        if not good:
            print(f"{label:34} every pass failed: {rs[-1]['errors'][:1]}")
            continue
        med = {k: statistics.median(r[k] for r in good) for k in ("ttft_first", "ttft_median", "ttft_last",
                                                                   "prefill_tok_s", "decode_tok_s",
                                                                   "decode_all_running", "hit_rate")}
        print(f"{label:34} {min(r['ok'] for r in good):3d} {med['ttft_first']:9.1f}s {med['ttft_median']:7.1f}s "
              f"{med['ttft_last']:7.1f}s {med['ttft_last'] / med['ttft_first']:10.2f} {med['prefill_tok_s']:13.1f} "
              f"{med['decode_tok_s']:12.1f} {med['decode_all_running']:11.1f} {100 * med['hit_rate']:10.1f}%")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


def _seed_line(r: dict) -> str:
    if not r["ok"]:
        return f"failed: {r['errors'][:1]} (load before {r['load']:.2f})"
    return (f"ok {r['ok']}/{SEED['clients']}  TTFT {r['ttft_first']:.1f} / {r['ttft_median']:.1f} / "
            f"{r['ttft_last']:.1f} s  prefill {r['prefill_tok_s']:.1f}  decode {r['decode_tok_s']:.1f} "
            f"(all running {r['decode_all_running']:.1f}) tok/s  "
            f"hits {100 * r['hit_rate']:.1f}%  load before {r['load']:.2f}" + (f"  errors {r['errors'][:1]}"
                                                                              if r["errors"] else ""))


def start_arm(args, arm: str, parallel: int, extra: tuple[str, ...] = ()):
    """Start one arm's server: "splitgemma" (`splitgemma up`, with the speculation options and `extra`) or
    "llama-server" (bench/peer_llamacpp.py's build, --parallel `parallel`). Returns (stop, url, model name)."""
    if arm == "llama-server":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from peer_llamacpp import start_llama_server, stop_llama_server
        proc, url = start_llama_server(args.gguf, parallel=parallel, threads=args.threads or 2,
                                       ctx_per_slot=args.max_context)
        return (lambda: stop_llama_server(proc)), url, Path(args.gguf).stem
    shm = tempfile.mkdtemp(prefix="sg-bench-", dir="/dev/shm")
    try:
        lookup = ("--lookup-k", str(args.lookup_k)) if args.lookup_k is not None else ()
        proc, url = start_stack(args, shm, extra=(*extra, *lookup))
    except BaseException:
        os.rmdir(shm)
        raise

    def stop():
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        os.rmdir(shm)
    return stop, url, args.model_name or Path(args.model).stem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="the .fgm file (served, and run in process for comparison); not with --peer")
    ap.add_argument("--peer", choices=("llama-server",), help="serve with llama.cpp's llama-server instead "
                                                              "(bench/peer_llamacpp.py's build)")
    ap.add_argument("--gguf", help="the GGUF llama-server serves: with --peer alone, else (with --model) as a second "
                                   "arm alternated with splitgemma's over --passes")
    ap.add_argument("--tokenizer", help="tokenizer.json for the stack (default: beside the model)")
    ap.add_argument("--url", help="an already running gateway's /v1 URL (default: start splitgemma up)")
    ap.add_argument("--model-name", help="model id to request (default: the file name without .fgm)")
    ap.add_argument("--concurrency", default="1,8", help="comma-separated client counts (default: 1,8)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2, help="requests per client per round (default: 2)")
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=1024, help="prompt ids are drawn from [4, vocab) (default: 1024)")
    ap.add_argument("--threads", type=int, default=None, help="compute threads per worker and in process")
    ap.add_argument("--lookup-k", type=int, default=None,
                    help="the stack's prompt-lookup draft length (splitgemma up --lookup-k; 0 = plain decoding, as "
                         "llama-server runs by default; default: up's own)")
    ap.add_argument("--no-engine", action="store_true", help="skip the in-process engine rows")
    ap.add_argument("--profile", choices=("seed",), help="run the seed's serving profile (module doc) instead")
    ap.add_argument("--policies", default="srf,rr",
                    help="with --profile seed: the splitgemma arms' --prefill-policy values (default: srf,rr)")
    ap.add_argument("--passes", type=int, default=1, help="passes over the arms, alternated (default: 1)")
    args = ap.parse_args()
    if args.profile == "seed":
        if not args.model:
            ap.error("--profile seed needs --model FILE.fgm (and --gguf FILE for the llama-server arm)")
        args.vocab = max(args.vocab, 4096)
        return seed_profile(args)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.peer:
        if not args.gguf:
            ap.error("--peer llama-server needs --gguf FILE")
        args.no_engine = True
        args.model = None
        arms = ["llama-server"]
    elif not args.model:
        ap.error("--model is required (or --peer llama-server --gguf FILE)")
    else:
        arms = ["splitgemma"] + (["llama-server"] if args.gguf and not args.url else [])
    rng = random.Random(0)
    prompts = [[rng.randrange(4, args.vocab) for _ in range(args.prompt_tokens)] for _ in range(16)]

    print(f"model {args.model or args.gguf}" + (f", peer {args.gguf}" if len(arms) > 1 else "") +
          f"; prompt {args.prompt_tokens} tokens, {args.gen_tokens} generated per request; stack --lookup-k "
          f"{'up default' if args.lookup_k is None else args.lookup_k}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    runs: dict[tuple[str, int], list[dict]] = {(arm, c): [] for arm in arms for c in args.concurrency}
    for p in range(args.passes):
        for arm in arms[p % len(arms):] + arms[:p % len(arms)]:  # rotated: no arm always runs first
            load = os.getloadavg()[0]
            if args.url and arm == "splitgemma":
                stop, url, name = (lambda: None), args.url, args.model_name or Path(args.model).stem
            else:
                stop, url, name = start_arm(args, arm, max(args.concurrency))
            try:
                one_request(__import__("openai").OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600),
                            name, prompts[0], 4)  # warm-up: first touch of the weights in every process
                for c in args.concurrency:
                    r = gateway_round(url, name, c, args.requests, prompts, args.gen_tokens)
                    runs[(arm, c)].append(r)
                    print(f"pass {p + 1} {arm:12} {c:3d} client{'s' if c > 1 else ' '}  TTFT mean "
                          f"{statistics.mean(r['ttft']) * 1e3:7.1f} ms  decode {statistics.mean(r['decode']):6.1f} "
                          f"tok/s/seq  aggregate {r['aggregate']:6.1f} tok/s  load before {load:.2f}", flush=True)
            finally:
                stop()
    rows = []
    for (arm, c), rs in runs.items():
        med = lambda f: statistics.median(f(r) for r in rs)  # noqa: E731 - medians over the passes
        rows.append((f"{'gateway' if arm == 'splitgemma' else arm}, {c} client{'s' if c > 1 else ''}",
                     sum(r["n"] for r in rs), med(lambda r: statistics.mean(r["ttft"])),
                     med(lambda r: statistics.median(r["ttft"])), med(lambda r: statistics.mean(r["decode"])),
                     med(lambda r: r["aggregate"])))
    if not args.no_engine:
        for c in args.concurrency:
            e = engine_figures(args, prompts, c, args.gen_tokens)
            rows.append((f"engine in process, batch {c}", c, statistics.mean(e["ttft"]), statistics.median(e["ttft"]),
                         e["decode_per_seq"], e["aggregate"]))
    print(f"{'':32} {'requests':>8} {'TTFT mean':>10} {'TTFT p50':>9} {'decode tok/s/seq':>17} {'aggregate tok/s':>16}")
    for label, n, mean, p50, dec, agg in rows:
        print(f"{label:32} {n:8d} {mean * 1000:8.1f}ms {p50 * 1000:7.1f}ms {dec:17.1f} {agg:16.1f}")
    if len(arms) > 1:
        def med(arm: str, c: int, f) -> float:
            return statistics.median(f(r) for r in runs[(arm, c)])
        aggregate, ttft = (lambda r: r["aggregate"]), (lambda r: statistics.mean(r["ttft"]))
        print("splitgemma against llama-server, medians over the passes: " + "; ".join(
            f"{c} client{'s' if c > 1 else ''}: aggregate {med('splitgemma', c, aggregate) / med('llama-server', c, aggregate):.2f}x, "
            f"TTFT mean {med('splitgemma', c, ttft) / med('llama-server', c, ttft):.2f}x" for c in args.concurrency))
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
