#!/usr/bin/env python3
"""What a draft's rows cost: Model.decode's time for B sequences, each fed one token, plus x draft rows spread over
them (one more token of a multi-token run each, in turn; every draft row computes logits, as prompt lookup's do),
beside the plain step of B rows. The table the decode worker's draft rule measures as it runs (StepCosts,
docs/speculation.md), taken in isolation: the rows' cost is not smooth, because the GEMM kernels take rows in blocks.

    python bench/bench_draft_rows.py [--model m.fgm] --batch 8 --extra 0,1,2,4,8,16,32 [--context 300]

Every sequence is prefilled with --context random ids once; each step writes its tokens at the same positions (the
K/V they leave is overwritten by the next step), so every repeat measures the same work. Per x: the median of
--repeats steps, the counts interleaved (x = 0, 1, … then again), after a warm-up; the ratio is to x = 0. Without
--model, the default model (Gemma 3 270M).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="the .fgm (default: the default model)")
    ap.add_argument("--batch", type=int, default=8, help="sequences in the step (default: %(default)s)")
    ap.add_argument("--extra", default="0,1,2,3,4,8,16",
                    help="draft rows added to the step, comma-separated; 0 first (default: %(default)s)")
    ap.add_argument("--context", type=int, default=300, help="positions each sequence holds (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    from splitgemma.engine import Model, open_arena
    if args.model is None:
        from splitgemma.default_model import resolve_default_model
        args.model = str(resolve_default_model(progress=True)[0])
    extras = [int(x) for x in args.extra.split(",")]
    if extras[0] != 0:
        raise SystemExit("--extra must start with 0 (the plain step the ratios are to)")
    b = args.batch
    per_seq = 1 + (max(extras) + b - 1) // b
    model = Model(args.model, threads=args.threads, max_context=args.context + per_seq + 1, chunk=max(256, per_seq),
                  max_batch=b * per_seq)
    arena = open_arena(model, b)
    rng = np.random.default_rng(0)
    for s in range(b):
        model.prefill(arena, s, rng.integers(10, 20000, args.context).tolist())
    out = np.empty((b * per_seq, model.vocab_size), np.float32)

    def step(x: int) -> float:
        runs = [1 + x // b + (s < x % b) for s in range(b)]
        slots = [s for s in range(b) for _ in range(runs[s])]
        pos = [args.context + j for s in range(b) for j in range(runs[s])]
        t0 = time.perf_counter()
        model.decode(arena, slots, [5] * len(slots), pos, logits=[True] * len(slots), out=out)
        return time.perf_counter() - t0

    for _ in range(3):
        step(0)
    times: dict[int, list[float]] = {x: [] for x in extras}
    for _ in range(args.repeats):
        for x in extras:
            times[x].append(step(x))
    base = statistics.median(times[0])
    print(f"{b} sequences at {args.context} positions, {model.backend} backend, medians of {args.repeats}")
    print(f"{'logits rows':>11s} {'ms':>8s} {'vs plain':>9s}")
    for x in extras:
        t = statistics.median(times[x])
        print(f"{b + x:11d} {1e3 * t:8.1f} {t / base:8.2f}x")


if __name__ == "__main__":
    main()
