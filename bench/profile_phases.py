"""Where the engine's time goes, per phase of the forward pass (the native FGM_PROFILE counters: embed, ple, norms,
act_quant, qkv_gemm, qk_rope_kv, attention, o_gemm, ffn_gemm, ffn_act, ple_inject, lm_head).

Decode: for each batch size, a context is prefilled once and copied into every sequence's slot, then --steps decode
steps are timed; prints ms/step, tok/s and each phase's ms/step and calls/step. Prefill: one prompt per length,
after a warm-up prefill; prints seconds, tok/s and each phase's ms and calls. Synthetic token ids; 2 threads unless
--threads. It sets FGM_PROFILE=1 itself (the counters cost a clock read per phase, so compare profiles with
profiles, and speeds with `splitgemma bench`).

With --peak, every decode step is timed alone between two readings of the backend's int8 multiply-add peak probe
(the vpdpbusd loop of `splitgemma bench`, 0.1 s each on the same threads), and each int8-activation GEMM phase
(qkv_gemm, o_gemm, ffn_gemm, ple_inject, lm_head) is printed as its int8 TOPS (2 x rows x the multiply-adds of its
q4g/q8c weights, from the file's shapes) and as a fraction of the mean of the two readings: on a shared host the
load moves both alike, so the fraction means more than either figure. Medians and ranges over the steps. A phase's
time holds what it does besides the GEMM (ple_inject its GELU, lm_head its softcap), so its fraction is a lower
bound.

    python bench/profile_phases.py MODEL.fgm --batches 1,8,32 --context 1024 --steps 8
    python bench/profile_phases.py MODEL.fgm --prefill 1024,4096
    python bench/profile_phases.py MODEL.fgm --batches 8,32 --steps 8 --peak
    python bench/profile_phases.py MODEL.fgm --batches 8,32 --shared-prefix
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time

# The int8-activation GEMM phases and the weights each multiplies (per-layer names; the head is `lm_head`, or the
# tied `embed_tokens` when the file has none). q8g weights (f32 activations) are not counted: the int8 peak does not
# bound them.
_GEMM_PHASES = {
    "qkv_gemm": re.compile(r"l\d+\.[qkv]_proj"),
    "o_gemm": re.compile(r"l\d+\.o_proj"),
    "ffn_gemm": re.compile(r"l\d+\.(gate|up|down)_proj"),
    "ple_inject": re.compile(r"l\d+\.(per_layer_input_gate|per_layer_projection)"),
}
_INT8_ACTIVATION_DTYPES = ("q4g", "q8c")


def gemm_macs_per_row(path: str) -> dict[str, int]:
    """Multiply-adds per decode row of each int8-activation GEMM phase (a row that goes through every layer and the
    head, as one whose logits are wanted does), from the file's tensor shapes."""
    from splitgemma._native import FgmFile

    f = FgmFile(path)
    names = set(f.tensor_names)
    macs = dict.fromkeys([*_GEMM_PHASES, "lm_head"], 0)

    def add(phase: str, name: str) -> None:
        t = f.tensor_info(name)
        if t["dtype"] in _INT8_ACTIVATION_DTYPES:
            macs[phase] += t["shape"][0] * t["shape"][1]

    for name in names:
        for phase, pattern in _GEMM_PHASES.items():
            if pattern.fullmatch(name):
                add(phase, name)
    add("lm_head", "lm_head" if "lm_head" in names else "embed_tokens")
    return {k: v for k, v in macs.items() if v}


def _phases(prof: dict, per: float, unit: str) -> str:
    rows = sorted(((k, v) for k, v in prof.items() if v[0] > 0), key=lambda kv: -kv[1][0])
    return ", ".join(f"{k} {v[0] / per * 1e3:.2f}{unit}/{v[1] // max(1, int(per))}" for k, v in rows)


def peak_fractions(m, macs: dict[str, int], threads: int, b: int, steps: int, step) -> None:
    """Runs step(i) for i < steps, each between two readings of the int8 peak probe; prints per GEMM phase the
    median TOPS and fraction of the probes' mean, and the step's time and the phases' shares of it."""
    from splitgemma._native import kernels

    def probe() -> float:
        return kernels.peak_tops(m.backend, threads, 0.1)

    rows: dict[str, list[float]] = {k: [] for k in macs}
    frac: dict[str, list[float]] = {k: [] for k in [*macs, "all GEMMs"]}
    step_s, peaks, shares = [], [], {k: [] for k in ("GEMMs", "attention")}
    for i in range(steps):
        p0 = probe()
        m.reset_profile()
        t0 = time.perf_counter()
        step(i)
        dt = time.perf_counter() - t0
        pk = (p0 + probe()) / 2
        prof = m.profile()
        step_s.append(dt)
        peaks.append(pk)
        t_all = ops_all = 0.0
        for k, n in macs.items():
            t, ops = max(prof[k][0], 1e-9), 2.0 * b * n
            rows[k].append(ops / t / 1e12)
            frac[k].append(ops / t / 1e12 / pk)
            t_all += t
            ops_all += ops
        frac["all GEMMs"].append(ops_all / max(t_all, 1e-9) / 1e12 / pk)
        shares["GEMMs"].append(t_all / dt)
        shares["attention"].append(prof["attention"][0] / dt)

    def med(v: list[float], fmt: str) -> str:
        return f"{statistics.median(v):{fmt}} ({min(v):{fmt}}-{max(v):{fmt}})"

    print(f"decode B={b}: {med([s * 1e3 for s in step_s], '.1f')} ms/step; int8 peak {med(peaks, '.3f')} TOPS; "
          f"time shares: GEMMs {med(shares['GEMMs'], '.2f')}, attention {med(shares['attention'], '.2f')}")
    for k, v in frac.items():
        tops = f"{med(rows[k], '.3f')} TOPS, " if k in rows else ""
        print(f"   {k}: {tops}{med(v, '.2f')} of the peak")


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
    ap.add_argument("--q8g-input", default=None, help="int8 or f32: the q8g GEMMs' activations (default: the "
                                                      "engine's: FGM_Q8G_INPUT, else int8)")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--shared-prefix", action="store_true",
                    help="decode batches of two or more read the context from one prefix slot (as `splitgemma bench` "
                         "does by default, --decode-prefix shared), instead of each from its own copy")
    ap.add_argument("--arena-dir", default=None, metavar="DIR",
                    help="decode: the KV arena as a file under DIR (e.g. /dev/shm), mapped shared as the decode "
                         "worker maps its arena, instead of private anonymous memory; removed after")
    ap.add_argument("--peak", action="store_true",
                    help="decode: each GEMM phase's int8 TOPS against the peak probe read around every step")
    a = ap.parse_args()
    os.environ["FGM_PROFILE"] = "1"  # read by the Model's constructor
    import numpy as np

    from splitgemma.commands.generate import open_model
    from splitgemma.engine import open_arena

    batches = [int(x) for x in a.batches.split(",") if x]
    lens = [int(x) for x in a.prefill.split(",") if x]
    m = open_model(a, max_context=max([a.context + a.steps + 8, *lens]), max_batch=max(batches or [1]),
                   chunk=a.chunk)
    macs = gemm_macs_per_row(a.model) if a.peak else {}
    if a.peak and not macs:
        raise SystemExit(f"{a.model}: no q4g/q8c weights (int8 activations), so no GEMM the int8 peak bounds")
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
        arena_file = os.path.join(a.arena_dir, f"profile-phases-{os.getpid()}.arena") if a.arena_dir else None
        ar = open_arena(m, max(batches) + 1, arena_file)
        if arena_file:
            os.unlink(arena_file)  # the mapping keeps the pages until the arena goes
        pristine = max(batches)
        m.prefill(ar, pristine, ids(a.context))
        for b in batches:
            slots = list(range(b))
            for s in slots:
                ar.copy_slot(s, ar, pristine)
            # One logits buffer for every step, as the decode worker and `splitgemma bench` keep theirs: a new array
            # a step would put its page faults (33.5 MB at B=32 for E2B) in the lm_head phase.
            out = np.empty((b, m.vocab_size), np.float32)
            prefixes = [(pristine, a.context)] * b if a.shared_prefix and b > 1 else None
            m.decode(ar, slots, [5] * b, [a.context] * b, out=out,  # warm-up step, rewound by the copies below
                     prefixes=prefixes)
            for s in slots:
                ar.copy_slot(s, ar, pristine)
            if a.peak:
                peak_fractions(m, macs, a.threads, b, a.steps,
                               lambda i: m.decode(ar, slots, [int(x) for x in rng.integers(10, 1000, b)],
                                                  [a.context + i] * b, out=out, prefixes=prefixes))
                continue
            m.reset_profile()
            t0 = time.perf_counter()
            for i in range(a.steps):
                m.decode(ar, slots, [int(x) for x in rng.integers(10, 1000, b)], [a.context + i] * b, out=out,
                         prefixes=prefixes)
            dt = (time.perf_counter() - t0) / a.steps
            print(f"decode B={b} @{a.context}{' shared prefix' if prefixes else ''}: {dt * 1e3:.1f} ms/step, "
                  f"{b / dt:.1f} tok/s")
            print("   " + _phases(m.profile(), a.steps, "ms"))


if __name__ == "__main__":
    main()
