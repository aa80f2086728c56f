"""Where the engine's time goes, per phase of the forward pass (the native FGM_PROFILE counters: embed, ple, norms,
act_quant, qkv_gemm, qk_rope_kv, attention, o_gemm, ffn_gemm, ffn_act, ple_inject, lm_head).

Decode: for each batch size, a context is prefilled once and copied into every sequence's slot, then --steps decode
steps are timed; prints ms/step, tok/s and each phase's ms/step and calls/step. Prefill: one prompt per length,
after a warm-up prefill; prints seconds, tok/s and each phase's ms and calls. Synthetic token ids; 2 threads unless
--threads. It sets FGM_PROFILE=1 itself (the counters cost a clock read per phase, so compare profiles with
profiles, and speeds with `splitgemma bench`).

    python bench/profile_phases.py MODEL.fgm --batches 1,8,32 --context 1024 --steps 8
    python bench/profile_phases.py MODEL.fgm --prefill 1024,4096
"""

from __future__ import annotations

import argparse
import os
import time


def _phases(prof: dict, per: float, unit: str) -> str:
    rows = sorted(((k, v) for k, v in prof.items() if v[0] > 0), key=lambda kv: -kv[1][0])
    return ", ".join(f"{k} {v[0] / per * 1e3:.2f}{unit}/{v[1] // max(1, int(per))}" for k, v in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="the .fgm file")
    ap.add_argument("--batches", default="1,8,32", help="decode batch sizes (default: 1,8,32; '' for none)")
    ap.add_argument("--context", type=int, default=1024, help="positions each sequence holds when decode is timed")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per batch size")
    ap.add_argument("--prefill", default="", help="prefill prompt lengths, e.g. 1024,4096 (default: none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", default=None, help="int4, int8 or auto:M (default: the engine's)")
    ap.add_argument("--backend", default=None, help="amx, vnni or avx2 (default: the best this CPU runs)")
    ap.add_argument("--kv-dtype", default=None, help="int8, f16 or f32 (default: the file's)")
    ap.add_argument("--chunk", type=int, default=256)
    a = ap.parse_args()
    os.environ["FGM_PROFILE"] = "1"  # read by the Model's constructor
    import numpy as np

    from splitgemma.commands.generate import open_model
    from splitgemma.engine import open_arena

    batches = [int(x) for x in a.batches.split(",") if x]
    lens = [int(x) for x in a.prefill.split(",") if x]
    m = open_model(a, max_context=max([a.context + a.steps + 8, *lens]), max_batch=max(batches or [1]),
                   chunk=a.chunk)
    rng = np.random.default_rng(0)

    def ids(n: int):
        return rng.integers(10, m.vocab_size - 10, n).astype(np.int32)

    if lens:
        ar = open_arena(m, 1)
        m.prefill(ar, 0, ids(min(256, min(lens))))
        for n in lens:
            prompt = ids(n)
            m.reset_profile()
            t0 = time.perf_counter()
            m.prefill(ar, 0, prompt)
            dt = time.perf_counter() - t0
            print(f"prefill {n}: {dt:.3f} s, {n / dt:.1f} tok/s")
            print("   " + _phases(m.profile(), 1, "ms"))
    if batches:
        ar = open_arena(m, max(batches) + 1)
        pristine = max(batches)
        m.prefill(ar, pristine, ids(a.context))
        for b in batches:
            slots = list(range(b))
            for s in slots:
                ar.copy_slot(s, ar, pristine)
            m.decode(ar, slots, [5] * b, [a.context] * b)  # warm-up step, rewound by the copies below
            for s in slots:
                ar.copy_slot(s, ar, pristine)
            m.reset_profile()
            t0 = time.perf_counter()
            for i in range(a.steps):
                m.decode(ar, slots, [int(x) for x in rng.integers(10, 1000, b)], [a.context + i] * b)
            dt = (time.perf_counter() - t0) / a.steps
            print(f"decode B={b} @{a.context}: {dt * 1e3:.1f} ms/step, {b / dt:.1f} tok/s")
            print("   " + _phases(m.profile(), a.steps, "ms"))


if __name__ == "__main__":
    main()
