#!/usr/bin/env python3
"""What a prefix-cache hit saves: the prefill worker's prompt run (services/prefill/server.py: restore, then chunks
with capture) on one model, in process, for a prompt of SHARED tokens seen before plus SUFFIX new ones.

    python bench/bench_prefix_cache.py --model tests/fixtures/fastgemma/mini-e2b-tame/mini-e2b-tame.fgm
    python bench/bench_prefix_cache.py --model e2b.fgm --shared 3584 --suffix 64 --kv-dtype int8

Rows (median of --repeats, seconds): the uncached run (the worker without a cache), the same run capturing its
blocks (a miss), the run after a hit (restore + the suffix), and the restore alone; the K/V bytes a hit copies.
Check the load first (uptime): on a shared machine another job can halve a figure.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--shared", type=int, default=1024, help="prompt tokens already cached (default: 1024)")
    ap.add_argument("--suffix", type=int, default=64, help="new prompt tokens after them (default: 64)")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--kv-dtype", choices=("int8", "f16"), default=None)
    ap.add_argument("--weights", default="auto:16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from splitgemma.engine import Model, open_arena
    from splitgemma.services.prefill.prefix_cache import PrefixCache

    m = Model(args.model, max_context=args.max_context, chunk=args.chunk, threads=args.threads,
              kv_dtype=args.kv_dtype, weights=args.weights)
    arena = open_arena(m, 1)
    rng = np.random.default_rng(0)
    vocab = m.vocab_size

    def run(tokens, cache) -> tuple[float, int]:
        t0 = time.perf_counter()
        cached = cache.restore(arena, 0, tokens) if cache else 0
        for i in range(cached, len(tokens), m.chunk):
            m.prefill(arena, 0, tokens[i:i + m.chunk], pos0=i)
            if cache:
                cache.capture(arena, 0, tokens, i, len(tokens[i:i + m.chunk]))
        return time.perf_counter() - t0, cached

    rows: dict[str, list[float]] = {"uncached": [], "miss (capturing)": [], "hit": [], "restore alone": []}
    hit_tokens = 0
    for _ in range(args.repeats):
        shared = rng.integers(4, vocab, args.shared)
        prompt = np.concatenate([shared, rng.integers(4, vocab, args.suffix)])
        rows["uncached"].append(run(prompt, None)[0])
        cache = PrefixCache(1 << 40)
        rows["miss (capturing)"].append(run(prompt, cache)[0])
        other = np.concatenate([shared, rng.integers(4, vocab, args.suffix)])
        seconds, hit_tokens = run(other, cache)
        rows["hit"].append(seconds)
        t0 = time.perf_counter()
        cache.restore(arena, 0, other)
        rows["restore alone"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in rows.items()}
    out = {"model": m.path, "backend": m.backend, "threads": m.threads, "kv_dtype": m.kv_layout["kv_dtype"],
           "chunk": m.chunk, "prompt_tokens": args.shared + args.suffix, "cached_tokens": hit_tokens,
           "restored_bytes": hit_tokens * m.kv_layout["position_bytes"], "seconds": med,
           "speedup": med["uncached"] / med["hit"]}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{Path(m.path).name}: {out['prompt_tokens']} prompt tokens, {hit_tokens} cached "
          f"({out['restored_bytes']:,} bytes of {out['kv_dtype']} K/V), chunk {m.chunk}, {m.backend}, "
          f"{m.threads} threads")
    for name, s in med.items():
        print(f"  {name:<18} {s * 1000:9.2f} ms")
    print(f"  hit vs uncached    {out['speedup']:9.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
