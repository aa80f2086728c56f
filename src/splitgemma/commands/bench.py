"""splitgemma bench: the engine's own throughput benchmark (as llama-bench is llama.cpp's), beside this machine's
limits measured in the same run.

* Prefill: tok/s per prompt length, synthetic ids, one Model.prefill per prompt (chunked as the engine does, the
  KV-shared shortcut on: the layers that write no K/V run on the last row only).
* Decode: aggregate tok/s per batch size at a context: the context is prefilled once and copied into every
  sequence's slot, then N decode steps are timed (tok/s = steps × batch / time). Sampling is not included. With
  --decode-prefix shared (the default) a batch of two or more reads the context from that one prefilled slot
  (Model.decode prefixes=: its sequences share one prompt, as llama-batched-bench -pps runs them) and only its own
  tokens from its slot; with copies every sequence reads its own copy (what the decode worker runs today, and what
  sequences with unrelated prompts cost); both times each batch both ways. Decode
  uses --decode-weights (default int4, what the decode worker serves: its bits do not depend on the batch size),
  prefill --weights (default auto:16, the prefill worker's).
* Limits: int8 peak TOPS of the backend's multiply-accumulate instruction and streaming DRAM read bandwidth, on the
  model's threads (splitgemma._native.kernels probes), measured before and after the figures. The peak: the best
  reading counts, since other work can only lower it. The bandwidth: a buffer at least the weight bytes of the
  largest decode step (on huge pages, as the weights' mapping asks for) read DRAM_PASSES times each time; the median
  of the passes counts and their range is printed (a best-of over a buffer smaller than a step, as before,
  overstated it by up to 2x). Prefill is compared with the peak (the model's GEMM multiply-adds per prompt), decode
  with the bandwidth (the weight bytes one step streams).
  Because the bandwidth a shared host gives moves by 1.4x from one minute to the next, every decode repeat is also
  bracketed by a pass of the probe just before and just after it, and a decode row's fraction of DRAM is the median
  over its repeats of the repeat's GB/s over the mean of its two brackets. Beside it, the same reading of the model
  file's own mapped pages (all of them), which is what decode streams: where the page cache holds them as small
  pages (read in before a mapping asked for 2 MB ones, as the engine's does) they read up to 1.6x slower than
  freshly written memory on a KVM guest (docs/benchmarks.md, sessions 20 and 23), and decode with them; the header
  shows both and says so when they part, and how much of the file the page cache holds in 2 MB pages.

Every figure is the median of --repeats runs, with the range. The page cache is warmed first (a cold mmap of a
multi-GB file reads far slower than a warm one), and the benchmark refuses to start on a loaded machine.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import sys
import time

from splitgemma.commands import context_length, positive_int

DRAM_PASSES = 3  # passes over the bandwidth probe's buffer, each time it is measured (before and after the figures)
DRAM_MIN_BYTES = 1 << 28  # the probe's buffer when the decode steps stream less (small models)
FILE_PAGES_SLOW = 0.85  # below this fraction of the DRAM probe, the header says the weights' pages read slow
LOAD_FACTOR = 0.5  # refuse when the 1-minute load average exceeds this × CPUs (fastgemma's bench used 0.35)
_LAYER = re.compile(r"l(\d+)\.")


def mapped_pages(path, threads: int):
    """The file's bytes where the page cache holds them (a read-only mapping as a uint8 array), every page already
    mapped into this process by one untimed pass of the bandwidth probe, so that timed passes read pages, not page
    faults. Mapped with MADV_HUGEPAGE, as the engine maps its weights (native/src/fgm_file.cpp): pages the cache does
    not hold yet come in as the 2 MB folios the engine's own faults would bring."""
    import mmap

    import numpy as np

    from splitgemma._native import kernels as K
    from splitgemma.engine import advise_huge_pages
    with open(path, "rb") as f:
        pages = np.frombuffer(advise_huge_pages(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)), np.uint8)
    K.read_bandwidth(pages.size, threads, 1, of=pages)
    return pages


def pmd_mapped_bytes(pages) -> int | None:
    """Bytes of the file mapping that `pages` (mapped_pages' array) starts, mapped by 2 MB entries (FilePmdMapped in
    /proc/self/smaps): once every page is mapped, the part of the file the page cache holds in 2 MB folios, which is
    what the engine's mapping of it gets too. None when no mapping starts there. On the Xeon KVM guest a page cache
    full of other files gave only 1.1 of the 1.8 GB an E2B step reads in 2 MB pages, and the single-stream step took
    58 ms against 54 once they all were (docs/benchmarks.md, session 41)."""
    start, in_vma = pages.ctypes.data, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if not head.endswith(":"):  # a mapping's first line: "lo-hi perms offset dev inode path"
                lo, _, hi = head.partition("-")
                in_vma = int(lo, 16) <= start < int(hi, 16)
            elif in_vma and head == "FilePmdMapped:":
                return int(line.split()[1]) * 1024
    return None


def fresh_memory(nbytes: int):
    """The DRAM probe's buffer: nbytes of anonymous memory written once, on huge pages where the kernel gives them,
    as the engine's weights and scratch are (on 4 KB pages the probe read 1.5x slower than the model file's 2 MB
    folios on a KVM guest, and understated the limit decode is compared with: docs/benchmarks.md, session 23).
    Allocated once per run: a fresh allocation for every bracket had the kernel assemble gigabytes of huge pages
    between the decode repeats."""
    import numpy as np

    from splitgemma.engine import advise_huge_pages, anonymous_memory
    buf = np.frombuffer(advise_huge_pages(anonymous_memory(nbytes)), np.uint8)
    buf.fill(1)
    return buf


def evict_pages(path) -> None:
    """Drop the file's pages from the page cache (those no process maps), so that the next mapping reads them again
    (posix_fadvise DONTNEED; a no-op where it is not supported)."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# Published figures of the engine we match (fastgemma, reference/fastgemma-notes.md §7) and the floors.
ANCHORS = {
    "fastgemma_amx": {"host": "4 cores of Sapphire Rapids @ 2.1 GHz, DRAM 33 GB/s",
                      "prefill_tok_s": {"1024": 280.3, "8192": 168.5},
                      "decode_b1_tok_s": {"1024": 14.2, "8192": 13.8},
                      "decode_b8_tok_s": {"512": 58.7}},
    "fastgemma_vnni": {"host": "AVX-512 VNNI host (no AMX)",
                       "prefill_tok_s": {"512": 124.6, "2048": 113.9},
                       "decode_b1_tok_s_range": [7.4, 7.9]},
    "floors_amx": {"note": "the issue's acceptance floors, set for an AMX host",
                   "prefill_1024_tok_s": 500, "decode_b1_tok_s": 8, "decode_b8_tok_s": 35},
}


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers."""
    try:
        values = [positive_int(t.strip()) for t in text.split(",")]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return sorted(set(values))


def register(subparsers) -> None:
    from splitgemma.commands.generate import add_engine_options
    p = subparsers.add_parser(
        "bench", help="benchmark prefill and decode throughput against this machine's limits",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_options(p)
    p.add_argument("--prompt-lens", type=int_list, default=[512, 1024, 8192], metavar="N,N,…",
                   help="prefill prompt lengths (default: 512,1024,8192)")
    p.add_argument("--batches", type=int_list, default=[1, 8, 32], metavar="B,B,…",
                   help="decode batch sizes (default: 1,8,32)")
    p.add_argument("--context", type=context_length, default=1024, metavar="C",
                   help="positions each sequence holds when decode is timed (default: 1024)")
    p.add_argument("--steps", type=positive_int, default=32, metavar="N",
                   help="decode steps timed per repeat (default: 32)")
    p.add_argument("--repeats", type=positive_int, default=3, help="runs per figure; the median is reported "
                                                                   "(default: 3)")
    p.add_argument("--chunk", type=context_length, default=256, help="prefill rows per pass (default: 256)")
    p.add_argument("--decode-weights", default="int4", metavar="POLICY",
                   help="the FFN weight policy of the decode steps (default: int4, the decode worker's default; "
                        "--weights applies to prefill)")
    p.add_argument("--decode-prefix", choices=("shared", "copies", "both"), default="shared",
                   help="shared (default): a decode batch of two or more reads the context from one prefix slot, as "
                        "sequences over one prompt can; copies: each sequence reads its own copy; both: each batch "
                        "both ways")
    p.add_argument("--ignore-load", action="store_true",
                   help=f"run even when the 1-minute load average is above {LOAD_FACTOR} × CPUs (figures are "
                        f"then lower bounds)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=run)


# ---------------------------------------------------------------------------------------------------------------
# The model's work: GEMM multiply-adds per prefill and weight bytes per decode step, from the file's tensor table.

# q8g is a gather-table type too (a tied embedding): tables are looked up, not multiplied.
_GATHER_TABLES = ("embed_tokens", "embed_tokens_per_layer")


def _linears(f, q8g_input: str) -> list[dict]:
    """Every quantised linear of the file: name, layer (None for global ones), N, K, whether it runs on int8
    activations (q8c/q4g; q8g/q8ga with the engine's q8g_input int8 where the kernel's units fit its group) or f32
    ones (q8g/q8ga, weight-only), and the bytes (codes + scales + q8ga offsets) of its own copy and of its int8 twin
    when the file has one."""
    from splitgemma._native import kernels

    names = set(f.tensor_names)

    def nbytes(name: str) -> int:
        return f.tensor_info(name)["nbytes"] + sum(f.tensor_info(name + c)["nbytes"] for c in (".scale", ".offset")
                                                   if name + c in names)

    out = []
    for name in f.tensor_names:
        info = f.tensor_info(name)
        # Without an lm_head tensor the q8g embedding table is the tied head (docs/fgm-extensions.md).
        head = name == "embed_tokens" and "lm_head" not in names
        if info["dtype"] not in ("q8c", "q4g", "q8g", "q8ga") or name.endswith(".i8") or \
                name in _GATHER_TABLES and not head:
            continue
        m = _LAYER.match(name)
        n, k = info["shape"]
        out.append({"name": "lm_head" if head else name, "layer": int(m.group(1)) if m else None, "n": n, "k": k,
                    "bytes": nbytes(name), "twin_bytes": nbytes(name + ".i8") if name + ".i8" in names else None,
                    "f32": info["dtype"] in ("q8g", "q8ga") and
                    (q8g_input == "f32" or not kernels.q8g_runs_int8(k, info["group"]))})
    return out


def prefill_macs(linears: list[dict], config: dict, tokens: int, f32: bool = False) -> int:
    """GEMM multiply-adds of one prefill of `tokens` tokens with the KV-shared shortcut: layers from
    first_shared_layer on, the LM head and those layers' rows of per_layer_model_projection run on the last row
    only (attention's own products are not counted). f32: count the weight-only (q8g) GEMMs, whose multiply-adds
    are f32 FMAs, instead of the int8 ones."""
    layers = config["num_hidden_layers"]
    shared_from = config.get("first_shared_layer", layers)
    total = 0
    for w in linears:
        if w["f32"] != f32:
            continue
        if w["name"] == "lm_head":
            rows_nk = w["n"] * w["k"]
        elif w["name"] == "per_layer_model_projection":
            per_layer = w["n"] // layers  # [layers · P, D]
            rows_nk = (tokens - 1) * shared_from * per_layer * w["k"] + w["n"] * w["k"]
        elif w["layer"] is not None and w["layer"] >= shared_from:
            rows_nk = w["n"] * w["k"]
        else:
            rows_nk = tokens * w["n"] * w["k"]
        total += rows_nk
    return total


def _twin_from_rows(policy: str):
    """rows -> whether a pass of that many rows uses the int8 twins, for a Model.weights string."""
    if policy == "int8":
        return lambda rows: True
    if policy == "int4":
        return lambda rows: False
    threshold = int(policy.split(":", 1)[1])  # auto:M
    return lambda rows: rows >= threshold


def decode_step_bytes(linears: list[dict], policy: str, batch: int, max_rows: int) -> int:
    """Weight bytes (codes + scales) one decode step of `batch` rows streams: every linear once per pass of at
    most max_rows rows, in the copy the policy picks for that pass (the gathered embedding rows and the KV cache are
    not counted)."""
    use_twin = _twin_from_rows(policy)
    total = 0
    for start in range(0, batch, max_rows):
        twin = use_twin(min(max_rows, batch - start))
        total += sum(w["twin_bytes"] if twin and w["twin_bytes"] is not None else w["bytes"] for w in linears)
    return total


# ---------------------------------------------------------------------------------------------------------------

def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, for the benchmarks' headers."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def warm_page_cache(path: str) -> tuple[int, float]:
    """Read the whole file once so that the weights are in the page cache. Returns (bytes, seconds)."""
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            total += n
    return total, time.perf_counter() - t0


class LoadWatch:
    """The 1-minute load average against LOAD_FACTOR × CPUs: checked at the start and after every figure. Once the
    benchmark computes, its own threads count in the load average, so during the run the limit is raised by them
    (see running()). Above the limit, a warning is printed the first time and again whenever the load has risen
    by half since the last warning (so a run started with --ignore-load still reports a machine getting busier)."""

    RISE = 1.5

    def __init__(self, ignore: bool):
        self.cpus = os.cpu_count() or 1
        self.limit = LOAD_FACTOR * self.cpus
        self.start = os.getloadavg()[0]
        self.max = self.start
        self.own = 0  # threads of ours that may be running
        self.warned_at: float | None = None
        if self.start > self.limit:
            if not ignore:
                from splitgemma.commands import CommandError
                raise CommandError(
                    f"the 1-minute load average is {self.start:.2f}, above {LOAD_FACTOR} × {self.cpus} CPUs = "
                    f"{self.limit:.2f}: other work would distort the figures. Wait for a quiet machine, or pass "
                    f"--ignore-load (the figures are then lower bounds)")
            self._warn(f"running on a loaded machine (load average {self.start:.2f} > {self.limit:.2f}, "
                       f"--ignore-load): the figures are lower bounds", self.start)

    def _warn(self, message: str, load: float) -> None:
        self.warned_at = load
        print(f"splitgemma bench: warning: {message}", file=sys.stderr, flush=True)

    def running(self, threads: int) -> None:
        self.own = threads

    def check(self, what: str) -> float:
        """The current 1-minute load (recorded beside the figure just measured), warning if it rose."""
        load = os.getloadavg()[0]
        self.max = max(self.max, load)
        limit = self.limit + self.own
        if load > limit and (self.warned_at is None or load > self.RISE * self.warned_at):
            self._warn(f"the load average rose to {load:.2f} (limit {self.limit:.2f} + {self.own} threads of "
                       f"this benchmark) during {what}: this figure and later ones may be low", load)
        return load

    def summary(self) -> dict:
        return {"start": self.start, "max": self.max, "end": os.getloadavg()[0], "limit": self.limit,
                "limit_while_running": self.limit + self.own, "cpus": self.cpus}


def _spread(tokens: float, seconds: list[float]) -> dict:
    med = statistics.median(seconds)
    return {"tok_s": tokens / med, "tok_s_min": tokens / max(seconds), "tok_s_max": tokens / min(seconds),
            "seconds": seconds}


def _synthetic(rng, n: int, vocab: int):
    # ids well inside the vocabulary, clear of the special tokens at its start (fastgemma used ids >= 1000)
    return rng.integers(min(1000, vocab // 2), vocab, n, dtype="int32")


def run(args) -> int:
    import numpy as np

    from splitgemma._native import FgmFile
    from splitgemma._native import kernels as K
    from splitgemma.commands import CommandError
    from splitgemma.commands.generate import open_model, use_default_model
    from splitgemma.engine import open_arena

    use_default_model(args)
    watch = LoadWatch(args.ignore_load)
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))

    fgm = FgmFile(args.model)
    config = json.loads(fgm.header_json)["config"]
    say(f"reading {args.model} into the page cache …")
    file_bytes, warm_s = warm_page_cache(args.model)

    max_batch = max(args.batches)
    model = open_model(args, max_context=max(max(args.prompt_lens), args.context + args.steps),
                       max_batch=max_batch, chunk=args.chunk)
    threads, backend = model.threads, model.backend
    linears = _linears(fgm, model.q8g_input)
    watch.running(threads)
    arena = open_arena(model, max_batch + 1)  # slot max_batch keeps the decode context, copied into the others
    pristine = max_batch
    rng = np.random.default_rng(0)

    weight_only = any(w["f32"] for w in linears)  # q8g GEMMs on f32 activations: their limit is the f32 FMA peak
    probes = {"peak_tops": [], "dram_gbs": [], "file_gbs": [],
              **({"peak_f32_gflops": []} if weight_only else {})}
    # The bandwidth probe reads at least what the largest decode step streams, so that no cache holds a useful
    # part of it and the reading is for the same kind of pass as the figure it is compared with.
    prefill_weights = model.weights
    try:
        model.weights = args.decode_weights  # checked before any measuring; set back for the prefill figures
    except ValueError as e:
        raise CommandError(f"--decode-weights: {e}") from None
    decode_weights = model.weights  # as the engine spells the policy
    model.weights = prefill_weights
    dram_bytes = max([DRAM_MIN_BYTES] + [decode_step_bytes(linears, decode_weights, b, model.max_rows)
                                         for b in args.batches])
    file_pages = mapped_pages(args.model, threads)
    fresh = fresh_memory(dram_bytes)

    def probe() -> None:
        say(f"measuring the {backend} int8 peak{', f32 FMA peak' if weight_only else ''} and DRAM read bandwidth "
            f"({_size(dram_bytes)} × {DRAM_PASSES}) on {threads} threads …")
        for _ in range(3):
            probes["peak_tops"].append(K.peak_tops(backend, threads, 0.2))
            if weight_only:
                probes["peak_f32_gflops"].append(K.peak_f32_gflops(threads, 0.2, backend=backend))
        probes["dram_gbs"] += K.read_bandwidth(dram_bytes, threads, DRAM_PASSES, of=fresh)
        probes["file_gbs"] += K.read_bandwidth(file_pages.size, threads, DRAM_PASSES, of=file_pages)

    probe()
    watch.check("the probes")

    # Warm-up, untimed: the first touch of every weight page through the mapping, both weight copies.
    model.prefill(arena, 0, _synthetic(rng, min(args.chunk, min(args.prompt_lens)), model.vocab_size))
    model.decode(arena, [0], [int(_synthetic(rng, 1, model.vocab_size)[0])], [1])

    prefill = []
    for n in args.prompt_lens:
        ids = _synthetic(rng, n, model.vocab_size)
        say(f"prefill {n} tokens × {args.repeats} …")
        seconds = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            model.prefill(arena, 0, ids)
            seconds.append(time.perf_counter() - t0)
        r = {"prompt_len": n, **_spread(n, seconds)}
        macs, f32_macs = prefill_macs(linears, config, n), prefill_macs(linears, config, n, f32=True)
        r["gemm_macs"] = macs
        r["int8_tops"] = 2 * macs / statistics.median(seconds) / 1e12
        if f32_macs:  # q8g GEMMs: f32 FMAs, which the int8 peak does not bound
            r["f32_gemm_macs"] = f32_macs
            r["f32_gflops"] = 2 * f32_macs / statistics.median(seconds) / 1e9
        r["load_1min"] = watch.check(f"prefill {n}")
        prefill.append(r)

    decode = []
    say(f"prefill of the decode context ({args.context} tokens) …")
    model.prefill(arena, pristine, _synthetic(rng, args.context, model.vocab_size))
    model.weights = decode_weights
    # A single sequence has no one to share its context with: B=1 is timed plain whatever --decode-prefix says.
    ways = {"shared": (True,), "copies": (False,), "both": (False, True)}[args.decode_prefix]
    for b, shared in [(b, shared) for b in args.batches for shared in (ways if b > 1 else (False,))]:
        slots = list(range(b))
        steps = [[int(t) for t in _synthetic(rng, b, model.vocab_size)] for _ in range(args.steps)]
        prefixes = [(pristine, args.context)] * b if shared else None
        say(f"decode batch {b} at context {args.context}{' (shared prefix)' if shared else ''}: "
            f"{args.steps} steps × {args.repeats} …")

        def start() -> None:
            for s in slots:
                arena.copy_slot(s, arena, pristine)

        start()
        logits = np.empty((b, model.vocab_size), np.float32)  # reused, as the decode worker reuses its buffer
        model.decode(arena, slots, steps[0], [args.context] * b, out=logits,  # warm-up (rewound by the next copy)
                     prefixes=prefixes)
        step_bytes = decode_step_bytes(linears, decode_weights, b, model.max_rows)
        seconds, brackets = [], [K.read_bandwidth(dram_bytes, threads, 1, of=fresh)[0]]
        for _ in range(args.repeats):
            start()
            t0 = time.perf_counter()
            for i, toks in enumerate(steps):
                model.decode(arena, slots, toks, [args.context + i] * b, out=logits, prefixes=prefixes)
            seconds.append(time.perf_counter() - t0)
            brackets += K.read_bandwidth(dram_bytes, threads, 1, of=fresh)
        r = {"batch": b, "context": args.context, "steps": args.steps, "shared_prefix": shared,
             **_spread(args.steps * b, seconds)}
        r["weight_bytes_per_step"] = step_bytes
        r["weight_read_gbs"] = step_bytes * args.steps / statistics.median(seconds) / 1e9
        r["dram_brackets_gbs"] = brackets  # the probe pass before the first repeat and after each
        r["ratio_to_dram"] = statistics.median(step_bytes * args.steps / t / 1e9 / ((lo + hi) / 2)
                                               for t, lo, hi in zip(seconds, brackets, brackets[1:]))
        r["load_1min"] = watch.check(f"decode batch {b}")
        decode.append(r)

    probe()
    peak, dram = max(probes["peak_tops"]), statistics.median(probes["dram_gbs"])
    f32_peak = max(probes["peak_f32_gflops"]) if weight_only else None
    for r in prefill:
        r["ratio_to_peak"] = r["int8_tops"] / peak
        if "f32_gflops" in r:
            r["ratio_to_f32_peak"] = r["f32_gflops"] / f32_peak

    result = {
        "model": args.model, "file_bytes": file_bytes, "layers": config["num_hidden_layers"],
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(),
                    "backends": {b: K.cpu_supports(b) for b in ("amx", "vnni", "avx2")}},
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "backend": backend, "threads": threads, "weights": {"prefill": prefill_weights, "decode": decode_weights},
        "q8g_input": model.q8g_input,
        "chunk": model.chunk,
        "repeats": args.repeats, "page_cache_read_s": warm_s,
        "limits": {f"{backend}_int8_tops": peak, "dram_read_gbs": dram,
                   **({f"{backend}_f32_gflops": f32_peak} if weight_only else {})},
        "dram_probe": {"bytes": dram_bytes, "passes": len(probes["dram_gbs"]),
                       "range_gbs": [min(probes["dram_gbs"]), max(probes["dram_gbs"])]},
        "file_probe": {"bytes": int(file_pages.size), "read_gbs": statistics.median(probes["file_gbs"]),
                       "range_gbs": [min(probes["file_gbs"]), max(probes["file_gbs"])],
                       "pmd_mapped_bytes": pmd_mapped_bytes(file_pages)},
        "limit_readings": probes,  # peaks: 3 before the figures, 3 after; DRAM: DRAM_PASSES passes before, as many after
        "prefill": prefill, "decode": decode, "load": watch.summary(), "anchors": ANCHORS,
    }
    print(json.dumps(result, indent=1) if args.json else render(result))
    return 0


def _anchor_text(kind: str, key: int) -> str:
    a, v, f = ANCHORS["fastgemma_amx"], ANCHORS["fastgemma_vnni"], ANCHORS["floors_amx"]
    parts = []
    if kind == "prefill":
        if str(key) in a["prefill_tok_s"]:
            parts.append(f"fastgemma AMX {a['prefill_tok_s'][str(key)]}")
        if str(key) in v["prefill_tok_s"]:
            parts.append(f"fastgemma VNNI {v['prefill_tok_s'][str(key)]}")
        if key == 1024:
            parts.append(f"floor ≥{f['prefill_1024_tok_s']} (AMX)")
    elif key == 1:
        lo, hi = v["decode_b1_tok_s_range"]
        parts += [f"fastgemma AMX {a['decode_b1_tok_s']['1024']} @1024", f"VNNI {lo}–{hi}",
                  f"floor ≥{f['decode_b1_tok_s']} (AMX)"]
    elif key == 8:
        parts += [f"fastgemma AMX {a['decode_b8_tok_s']['512']} @512 ctx", f"floor ≥{f['decode_b8_tok_s']} (AMX)"]
    return "; ".join(parts)


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def render(r: dict) -> str:
    m, lim = r["machine"], r["limits"]
    peak = lim[f"{r['backend']}_int8_tops"]
    f32_peak = lim.get(f"{r['backend']}_f32_gflops")  # only for files with q8g GEMMs
    dp = r["dram_probe"]
    lo, hi = dp["range_gbs"]
    limits = [f"{r['backend']} int8 peak {peak:.3f} TOPS (best of {len(r['limit_readings']['peak_tops'])})"] + \
        ([f"f32 FMA peak {f32_peak:.1f} GFLOP/s"] if f32_peak else []) + \
        [f"DRAM read {lim['dram_read_gbs']:.1f} GB/s (median of {dp['passes']} passes over {_size(dp['bytes'])}, "
         f"range {lo:.1f}–{hi:.1f})"]
    fp = r.get("file_probe")
    if fp:
        huge = fp.get("pmd_mapped_bytes")
        limits.append(f"the model file's pages {fp['read_gbs']:.1f} GB/s (the same over all "
                      f"{_size(fp['bytes'])} of them, range {fp['range_gbs'][0]:.1f}–{fp['range_gbs'][1]:.1f}"
                      + (f"; {huge / fp['bytes']:.0%} of them in 2 MB pages" if huge is not None else "") + ")")
    load = r["load"]
    out = [f"splitgemma bench  {r['model']}  ({r['file_bytes'] / 1e9:.2f} GB, {r['layers']} layers)  {r['date']}",
           f"machine: {m['cpu']}, {m['cpus']} CPUs; backend {r['backend']} "
           f"(amx {'yes' if m['backends']['amx'] else 'no'}, vnni {'yes' if m['backends']['vnni'] else 'no'}); "
           f"{r['threads']} threads; weights: prefill {r['weights']['prefill']}, decode {r['weights']['decode']}; "
           f"q8g activations {r.get('q8g_input', 'f32')}; "
           f"chunk {r['chunk']}",
           f"limits, measured in this run: {', '.join(limits)}"
           f"; page cache warmed in {r['page_cache_read_s']:.1f} s",
           f"load average: {load['start']:.2f} at start (limit {load['limit']:.2f}), {load['max']:.2f} max (limit "
           f"{load['limit_while_running']:.2f} with this benchmark's threads)"]
    if fp and fp["read_gbs"] < FILE_PAGES_SLOW * lim["dram_read_gbs"]:
        out.append(f"note: the model file's pages read at {fp['read_gbs'] / lim['dram_read_gbs']:.0%} of fresh "
                   f"memory: decode streams them, so its fractions of DRAM below are low by as much (pages the "
                   f"page cache read in before the engine mapped the file are small pages; with no process mapping "
                   f"the file, `dd if=FILE iflag=nocache count=0` drops them and the engine reads them back in 2 MB "
                   f"pages; docs/benchmarks.md, session 23)")
    out.append("")
    rows = [["test", "tok/s", "range", "load", "vs limit", "published / floor"]]
    for p in r["prefill"]:
        vs = [f"{p['int8_tops']:.3f} TOPS = {p['ratio_to_peak']:.0%} of peak"] if p["gemm_macs"] else []
        if "f32_gflops" in p:
            vs.append(f"{p['f32_gflops']:.1f} GFLOP/s f32 (q8g) = {p['ratio_to_f32_peak']:.0%} of f32 peak")
        rows.append([f"prefill {p['prompt_len']}", f"{p['tok_s']:.2f}", f"{p['tok_s_min']:.2f}–{p['tok_s_max']:.2f}",
                     f"{p['load_1min']:.2f}", " + ".join(vs), _anchor_text("prefill", p["prompt_len"])])
    for d in r["decode"]:
        rows.append([f"decode B={d['batch']} @{d['context']}" +
                     (" shared" if d.get("shared_prefix") else " copies" if d["batch"] > 1 else ""),
                     f"{d['tok_s']:.2f}",
                     f"{d['tok_s_min']:.2f}–{d['tok_s_max']:.2f}", f"{d['load_1min']:.2f}",
                     f"{_size(d['weight_bytes_per_step'])}/step → {d['weight_read_gbs']:.1f} GB/s = "
                     f"{d['ratio_to_dram']:.0%} of DRAM read beside it "
                     f"({statistics.median(d['dram_brackets_gbs']):.1f})", _anchor_text("decode", d["batch"])])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        out.append("  ".join(c.rjust(w) if j in (1, 2, 3) else c.ljust(w)
                             for j, (c, w) in enumerate(zip(row, widths))).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    out += ["", f"tok/s: median of {r['repeats']} runs (range: slowest–fastest); decode tok/s is the aggregate over "
                f"the batch (shared: its sequences read the context from one prefix slot; copies: each its own, --decode-prefix); load: the 1-minute load average after the figure. Prefill TOPS count the int8 GEMM multiply-adds (×2) of the prompt with the KV-shared "
                f"shortcut (q8g GEMMs on f32 activations, FGM_Q8G_INPUT=f32, run f32 FMAs: counted apart, in GFLOP/s); decode GB/s count the weight bytes one step streams, "
                f"and their fraction of DRAM is the median over the repeats of each one's GB/s over the probe read "
                f"just before and after it (in brackets: the median of those readings).",
            f"Published: fastgemma on an AMX host ({ANCHORS['fastgemma_amx']['host']}) and an AVX-512 VNNI host; "
            f"the floors are the issue's, set for AMX. Compare like with like: this {r['backend']} host with "
            f"{r['threads']} threads is neither of those machines."]
    return "\n".join(out)
