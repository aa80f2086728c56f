#!/usr/bin/env python3
"""llama.cpp on the same host: the peer our speed goals are ratios to (issue 14), measured beside `splitgemma bench`.

What it does, in order (every step is cached and skipped when its output exists):

1. build   llama.cpp from the llama-cpp-python sdist on PyPI (`pip download --no-binary :all: --no-deps`; its
           vendored tree vendor/llama.cpp), Release, GGML_NATIVE=ON (the host's ISA), static, only the targets
           llama-bench, llama-batched-bench, llama-server and llama-quantize, `-j2`. Cached in
           <cache>/peer/llama.cpp-<version>-<variant>/ (<cache>: $SPLITGEMMA_CACHE, else
           $XDG_CACHE_HOME/splitgemma, else ~/.cache/splitgemma). Variant "native" is -march=native (on an AMX
           host that compiles ggml's AMX int8 path); "noamx" is the same ISA with -mno-amx-* (AVX-512 VNNI
           kernels), for the hosts where the AMX path crashes (it has with GCC 12.2). --variant auto (default)
           runs a smoke llama-bench on the native build and falls back to noamx when it crashes.
2. models  the same weights for both engines.
           gemma3-270m: the default model's GGUF (Q4_K_M, from PyPI: splitgemma.default_model) is requantised by
             llama-quantize --allow-requantize to Q4_0 and Q8_0; we run its converted .fgm (the default model).
           e2b: bench/make_hf_checkpoint.py writes a random full-size E2B HF checkpoint (with the Gemma 3
             tokenizer.json beside it: llama.cpp's converter needs one, and both vocabularies have 262,144
             entries); llama.cpp's own convert_hf_to_gguf.py (in a throwaway venv <cache>/peer/convert-venv
             with torch==2.13.0, transformers, the vendored gguf-py) writes a BF16 GGUF, llama-quantize
             writes Q4_0 and Q8_0 (the BF16 GGUF is then deleted), and `splitgemma convert` writes the .fgm
             (dual int4 + int8, group 256: fastgemma's layout) from the same checkpoint.
3. run     --passes passes; in each, the three arms llama.cpp Q4_0, llama.cpp Q8_0 and splitgemma, in an order
           rotated from pass to pass, all on --threads threads:
             llama-bench         -p 512,1024 (prefill) and -n 32 -d 1024 (decode B=1 at context 1024)
             llama-batched-bench -npp 1024 -ntg 32 -npl 1,8,32 -pps -kvu (one shared 1024-token prompt, unified
                                 KV: decode B=1/8/32 aggregate at context 1024, as splitgemma bench times it)
             splitgemma bench    --prompt-lens 512,1024 --batches 1,8,32 --context 1024 --steps 32
                                 --decode-prefix both (B=8/32 with the context in one prefix slot, as -pps shares
                                 the prompt's cells, and with a copy in every sequence's slot, as its decode worker
                                 runs today: the table's "on copies" rows, against the same llama.cpp figure)
           Before the passes, every model file the arms read has the read rate of its page-cache pages measured
           beside that of fresh memory (the same probe as `splitgemma bench`'s header); a file whose pages read
           below 0.85 of it is dropped from the page cache and read back through a mapping that asks for 2 MB
           pages (MADV_HUGEPAGE, as splitgemma's engine maps its weights; the pages then serve both engines'
           mappings), for every arm alike, and measured again. On this project's Firecracker VMs, pages the page
           cache holds as small pages stream 25-40% slower than 2 MB ones (docs/benchmarks.md, sessions 20-23):
           every decode figure of both engines moves with it, ours more (it streams at the bandwidth limit). The
           default model's .fgm itself is left alone (a running server's workers map it): the run reads the peer's
           own copy of it in <cache>/peer/models/gemma-3-270m/. Both readings are recorded ("page_probe").
           Each figure is the median over the passes that were not loaded. Before every arm the 1-minute load
           average is checked: above 0.5 × CPUs the script waits up to --settle seconds for it to drop, then runs
           anyway. The load average cannot tell others' work from our previous arm's (it decays for minutes), so
           what flags an arm as loaded is the CPU time other processes used during it (/proc/stat's busy time
           minus our child's rusage): more than 0.25 of a CPU on average. The load before, the steal and the
           others' share are recorded with every run. When every pass of an arm was flagged, its medians are over
           all passes and the table marks them "*" (lower bounds: llama.cpp's spinning threads collapse under
           load).

The table: one row per figure, tok/s for llama.cpp Q4_0, Q8_0 and splitgemma, and splitgemma's ratio to the
better of the two llama.cpp figures. --json prints everything (every pass, loads, build options) instead.

    python bench/peer_llamacpp.py                       # gemma3-270m and e2b, 3 passes
    python bench/peer_llamacpp.py --models gemma3-270m --passes 5
    python bench/peer_llamacpp.py --prepare-only        # build + convert, no benchmark
    python -c 'from peer_llamacpp import start_llama_server'   # the llama-server launcher (bench_serving.py --peer)

Run it with the interpreter of splitgemma's virtual environment (it runs `python -m splitgemma` with it).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # the sdist whose vendored llama.cpp we build (bump to move the peer)
TARGETS = ("llama-bench", "llama-batched-bench", "llama-server", "llama-quantize")
VARIANTS = ("native", "noamx")
# noamx: GGML_NATIVE=OFF and ggml's own ISA switches, each on when /proc/cpuinfo has the flag, the AMX ones off
# (-mno-amx-* in CMAKE_C_FLAGS would not do: GCC expands -march=native, which ggml appends after them, into
# explicit -mamx-* flags)
_NOAMX_ISA = {"GGML_SSE42": "sse4_2", "GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma", "GGML_F16C": "f16c",
              "GGML_BMI2": "bmi2", "GGML_AVX_VNNI": "avx_vnni", "GGML_AVX512": "avx512f",
              "GGML_AVX512_VBMI": "avx512vbmi", "GGML_AVX512_VNNI": "avx512_vnni", "GGML_AVX512_BF16": "avx512_bf16"}


def variant_options(variant: str) -> list[str]:
    if variant == "native":
        # -march=native: on an AMX host GCC defines __AMX_INT8__ and ggml compiles its AMX int8 kernels
        return ["-DGGML_NATIVE=ON"]
    flags = set(machine_flags())
    return (["-DGGML_NATIVE=OFF"] + [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for opt, flag in _NOAMX_ISA.items()]
            + ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"])


def machine_flags() -> list[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return line.split(":", 1)[1].split()
    return []
COMMON_CMAKE = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
                "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]
CONVERTER_PACKAGES = ["torch==2.13.0", "numpy~=2.2.6", "sentencepiece>=0.1.98,<0.3.0", "transformers==4.57.6",
                      "protobuf>=4.21.0,<5.0.0", "safetensors"]
LOAD_FACTOR = 0.5     # the 1-minute load average limit before an arm, × CPUs (as splitgemma bench)
OTHERS_LIMIT = 0.25   # CPUs' worth of other processes' time during an arm above which it is flagged
QUANTS = ("Q4_0", "Q8_0")
HERE = Path(__file__).resolve().parent


def log(*a) -> None:
    print("peer:", *a, file=sys.stderr, flush=True)


def cache_root() -> Path:
    base = os.environ.get("SPLITGEMMA_CACHE")
    if base:
        root = Path(base)
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "splitgemma"
    return root / "peer"


def run(argv, log_to: Path | None = None, **kw) -> subprocess.CompletedProcess:
    argv = [str(a) for a in argv]
    log("$", " ".join(argv) + (f"  > {log_to}" if log_to else ""))
    if log_to is None:
        return subprocess.run(argv, check=True, **kw)
    with open(log_to, "w") as f:
        r = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, **kw)
    if r.returncode:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(argv)}; see {log_to}:\n"
                         + "".join(log_to.read_text(errors="replace").splitlines(True)[-20:]))
    return r


# ---------------------------------------------------------------------------------------------------------------
# 1. build


def source_tree(version: str) -> Path:
    """The extracted sdist's vendored llama.cpp, downloaded once with pip."""
    root = cache_root()
    src = root / f"llama_cpp_python-{version}"
    tree = src / "vendor" / "llama.cpp"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    dl = root / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    sdist = dl / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", dl,
             f"llama-cpp-python=={version}"])
    with tarfile.open(sdist) as t:
        t.extractall(root, filter="tar") if hasattr(tarfile, "tar_filter") else t.extractall(root)
    return tree


def source_revision(tree: Path) -> dict:
    """The llama.cpp commit the sdist vendors (the sdist keeps its git metadata), ggml's version."""
    info = {"llama_cpp_python": None, "commit": None, "commit_date": None, "commit_subject": None}
    init = tree.parent.parent / "llama_cpp" / "__init__.py"
    if init.is_file():
        for line in init.read_text().splitlines():
            if line.startswith("__version__"):
                info["llama_cpp_python"] = line.split("=", 1)[1].strip().strip("\"'")
    try:
        out = subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%H%n%cI%n%s"], capture_output=True,
                             text=True, check=True).stdout.splitlines()
        info.update(commit=out[0], commit_date=out[1], commit_subject=out[2])
    except (OSError, subprocess.CalledProcessError, IndexError):
        pass
    return info


def build_dir(version: str, variant: str) -> Path:
    return cache_root() / f"llama.cpp-{version}-{variant}"


def build(version: str, variant: str, jobs: int = 2, server: bool = True) -> Path:
    """Configure and build the tools once (llama-server too unless server=False, built after the benchmark
    tools, which are then usable sooner); returns the directory holding the binaries."""
    out = build_dir(version, variant)
    bins = out / "build" / "bin"
    stamp = out / "built.json"
    tools = [t for t in TARGETS if t != "llama-server"]
    if stamp.is_file() and all((bins / t).is_file() for t in tools):
        if server and not (bins / "llama-server").is_file():
            run(["cmake", "--build", out / "build", "--config", "Release", f"-j{jobs}", "--target", "llama-server"],
                log_to=out / "build-server.log")
        return bins
    tree = source_tree(version)
    out.mkdir(parents=True, exist_ok=True)
    options = COMMON_CMAKE + variant_options(variant)
    t0 = time.monotonic()
    run(["cmake", "-S", tree, "-B", out / "build", *options], log_to=out / "configure.log")
    run(["cmake", "--build", out / "build", "--config", "Release", f"-j{jobs}", "--target", *tools],
        log_to=out / "build.log")
    cc = subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    stamp.write_text(json.dumps({"variant": variant, "cmake_options": options, "compiler": cc[0] if cc else None,
                                 "build_seconds": round(time.monotonic() - t0), **source_revision(tree)}, indent=1))
    return build(version, variant, jobs, server) if server else bins


def build_info(version: str, variant: str) -> dict:
    stamp = build_dir(version, variant) / "built.json"
    return json.loads(stamp.read_text()) if stamp.is_file() else {}


def smoke(bins: Path, gguf: Path, threads: int) -> tuple[bool, str]:
    """A short llama-bench (pp64 + tg4): crashes and absurd figures show here."""
    argv = [bins / "llama-bench", "-m", gguf, "-t", threads, "-p", "64", "-n", "4", "-r", "1", "-o", "json"]
    r = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=900)
    if r.returncode:
        how = signal.Signals(-r.returncode).name if r.returncode < 0 else "error"
        return False, f"llama-bench exited {r.returncode} ({how}): {r.stderr[-400:]}"
    try:
        rows = json.loads(r.stdout)
        speeds = [row["avg_ts"] for row in rows]
    except (ValueError, KeyError) as e:
        return False, f"unreadable llama-bench output ({e}): {r.stdout[-400:]}"
    if not all(0 < s < 1e6 for s in speeds):
        return False, f"nonsense speeds {speeds}"
    return True, f"pp64 {speeds[0]:.1f} tok/s, tg4 {speeds[-1]:.1f} tok/s"


# ---------------------------------------------------------------------------------------------------------------
# 2. models


def quantize(bins: Path, src: Path, out_dir: Path, stem: str, requantize: bool) -> dict[str, Path]:
    out = {}
    for q in QUANTS:
        dst = out_dir / f"{stem}-{q.lower()}.gguf"
        if not dst.is_file():
            tmp = dst.with_name(dst.name + ".partial")
            run([bins / "llama-quantize", *(["--allow-requantize"] if requantize else []), src, tmp, q, 2],
                log_to=out_dir / f"quantize-{q.lower()}.log")
            os.replace(tmp, dst)
        out[q] = dst
    return out


def prepare_gemma3(bins: Path) -> dict:
    from splitgemma.default_model import ensure_gguf, resolve_default_model
    gguf = ensure_gguf(progress=True)
    fgm, _tok, _chat = resolve_default_model(progress=True)
    d = cache_root() / "models" / "gemma-3-270m"
    d.mkdir(parents=True, exist_ok=True)
    ggufs = quantize(bins, gguf, d, "gemma-3-270m", requantize=True)
    # The peer's own copy (equal_pages may drop its pages from the cache; a server's workers map the original).
    fgm = Path(fgm)
    own = d / fgm.name
    if not own.exists() or own.stat().st_size != fgm.stat().st_size or own.stat().st_mtime < fgm.stat().st_mtime:
        shutil.copyfile(fgm, own.with_suffix(".partial"))
        os.replace(own.with_suffix(".partial"), own)
    return {"name": "gemma3-270m", "fgm": str(own), "gguf": {q: str(p) for q, p in ggufs.items()},
            "note": "Gemma 3 270M base (PyPI Q4_K_M GGUF) requantised to Q4_0/Q8_0 for llama.cpp; splitgemma runs "
                    "the default model's .fgm converted from the same GGUF (q8g weights, int8 activations, f16 K/V)"}


def converter_python() -> Path:
    """A throwaway venv with what llama.cpp's convert_hf_to_gguf.py imports (outside the tree, never used at run
    time of splitgemma)."""
    venv = cache_root() / "convert-venv"
    py = venv / "bin" / "python"
    ok = venv / ".installed"
    if not ok.is_file():
        if not py.is_file():
            run([sys.executable, "-m", "venv", venv])
        tree = source_tree(LLAMA_CPP_PYTHON_VERSION)
        run([py, "-m", "pip", "install", "-q", *CONVERTER_PACKAGES, tree / "gguf-py"])
        ok.touch()
    return py


def prepare_e2b(bins: Path, tree: Path) -> dict:
    from splitgemma.default_model import resolve_default_model
    d = cache_root() / "models" / "e2b-random"
    hf = d / "hf"
    d.mkdir(parents=True, exist_ok=True)
    if not (hf / "model.safetensors").is_file():
        run([sys.executable, HERE / "make_hf_checkpoint.py", hf, "--preset", "e2b", "--seed", "0"])
    # the config alone is rewritten each time (cheap), so a checkpoint written by an older make_hf_checkpoint.py
    # gets the release's keys that llama.cpp's converter needs
    sys.path.insert(0, str(HERE))
    from make_hf_checkpoint import hf_config
    (hf / "config.json").write_text(json.dumps(hf_config("e2b"), indent=2))
    if not (hf / "tokenizer.json").is_file():
        # llama.cpp's Gemma 4 converter reads the vocabulary from tokenizer.json (LlamaHfVocab: a BPE with byte
        # fallback, through transformers' AutoTokenizer). Gemma 3's has the same 262,144 entries.
        _fgm, tok, _chat = resolve_default_model(progress=True)
        shutil.copyfile(tok, hf / "tokenizer.json")
        (hf / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
             "pad_token": "<pad>", "unk_token": "<unk>", "add_bos_token": True}))
    fgm = d / "e2b-random.fgm"
    if not fgm.is_file():
        tmp = d / "e2b-random.partial.fgm"
        run([sys.executable, "-m", "splitgemma", "convert", hf, tmp, "--weights", "dual", "--group", "256",
             "--no-progress"], log_to=d / "splitgemma-convert.log")
        os.replace(tmp, fgm)
    want = {q: d / f"e2b-random-{q.lower()}.gguf" for q in QUANTS}
    if not all(p.is_file() for p in want.values()):
        bf16 = d / "e2b-random-bf16.gguf"
        if not bf16.is_file():
            tmp = d / "e2b-random-bf16.partial.gguf"
            run([converter_python(), tree / "convert_hf_to_gguf.py", hf, "--outtype", "bf16", "--outfile", tmp],
                log_to=d / "convert_hf_to_gguf.log")
            os.replace(tmp, bf16)
        quantize(bins, bf16, d, "e2b-random", requantize=False)
        bf16.unlink()  # 10 GB; the checkpoint can make it again
    return {"name": "e2b", "fgm": str(fgm), "gguf": {q: str(p) for q, p in want.items()},
            "note": "random full-size Gemma 4 E2B (bench/make_hf_checkpoint.py, seed 0) converted by llama.cpp's "
                    "convert_hf_to_gguf.py (BF16) + llama-quantize, and by splitgemma convert --weights dual "
                    "--group 256, from the same checkpoint"}


# ---------------------------------------------------------------------------------------------------------------
# 3. the benchmark


def page_rates(path: str, threads: int) -> tuple[float, float]:
    """GB/s of the file's page-cache pages (all of them, median of 3 passes after an untimed one that maps them)
    and of a fresh buffer as large (at most 1 GB), on `threads` threads: splitgemma bench's probes."""
    from splitgemma._native import kernels as K
    from splitgemma.commands.bench import mapped_pages
    pages = mapped_pages(path, threads)
    file_gbs = statistics.median(K.read_bandwidth(pages.size, threads, 3, of=pages))
    fresh_gbs = statistics.median(K.read_bandwidth(min(pages.size, 1 << 30), threads, 3))
    del pages
    return file_gbs, fresh_gbs


def equal_pages(paths: list[str], threads: int) -> list[dict]:
    """Every file's pages read as fast as fresh memory before the arms run (the module docstring, step 3): a file
    below splitgemma bench's FILE_PAGES_SLOW of it is dropped from the page cache and read back through a mapping
    that asks for 2 MB pages (as splitgemma's engine maps its weights; the pages then serve llama.cpp's mappings
    alike), and measured again. (Rewriting such a file, as this script did before, gave buffered writes' folios, not
    2 MB ones: llama.cpp's GGUFs read 21-22 GB/s after it against 29-32 after a re-read, session 23.)"""
    from splitgemma.commands.bench import FILE_PAGES_SLOW, evict_pages
    out = []
    for path in paths:
        file_gbs, fresh_gbs = page_rates(path, threads)
        rec = {"file": path, "read_gbs": round(file_gbs, 2), "fresh_gbs": round(fresh_gbs, 2)}
        if file_gbs < FILE_PAGES_SLOW * fresh_gbs:
            evict_pages(path)
            after, fresh_after = page_rates(path, threads)
            rec.update(reread=True, read_gbs_after=round(after, 2), fresh_gbs_after=round(fresh_after, 2))
        log(f"pages of {Path(path).name}: " + ", ".join(f"{k} {v}" for k, v in rec.items() if k != "file"))
        out.append(rec)
    return out


def _cpu_times() -> tuple[int, int, int]:
    """(busy, total, steal) jiffies of all CPUs from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    total = sum(v[:8])
    steal = v[7] if len(v) > 7 else 0
    return total - idle - steal, total, steal


class Arm:
    """One measured command with the machine's load around it."""

    def __init__(self, settle: float):
        self.settle = settle
        self.cpus = os.cpu_count() or 1

    def wait_quiet(self) -> float:
        limit = LOAD_FACTOR * self.cpus
        deadline = time.monotonic() + self.settle
        load = os.getloadavg()[0]
        while load > limit and time.monotonic() < deadline:
            time.sleep(5)
            load = os.getloadavg()[0]
        return load

    def __call__(self, argv) -> tuple[str, dict]:
        argv = [str(a) for a in argv]
        load_before = self.wait_quiet()
        busy0, total0, steal0 = _cpu_times()
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        log("$", " ".join(argv), f"(load {load_before:.2f})")
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = p.communicate()
        wall = time.monotonic() - t0
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        busy1, total1, steal1 = _cpu_times()
        tick = os.sysconf("SC_CLK_TCK")
        own = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)  # our child's CPU-seconds
        # CPUs' worth of time the other processes used during the arm: all busy time minus ours
        others = max(0.0, ((busy1 - busy0) / tick - own) / wall)
        steal = (steal1 - steal0) / max(1, total1 - total0)
        load_after = os.getloadavg()[0]
        flags = [f"others used {others:.2f} CPUs"] if others > OTHERS_LIMIT else []
        meta = {"argv": argv, "wall_s": round(wall, 2), "load_before": load_before, "load_after": load_after,
                "others_cpus": round(others, 3), "steal": round(steal, 3), "flags": flags}
        if p.returncode:
            raise RuntimeError(f"{argv[0]} exited {p.returncode}: {err[-1500:]}")
        return out, meta


# The rows a run measures unless told otherwise (and what runs saved before the lists were recorded measured).
DEFAULT_PROMPT_LENS = [512, 1024]
DEFAULT_BATCHES = [1, 8, 32]


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def ints_text(values: list[int]) -> str:
    return ",".join(map(str, values))


def llama_arm(arm: Arm, bins: Path, gguf: str, threads: int, repeats: int, context: int, steps: int,
              prompt_lens, batches) -> dict:
    figures, metas = {}, []
    out, meta = arm([bins / "llama-bench", "-m", gguf, "-t", threads, "-p", ints_text(prompt_lens),
                     "-n", "0", "-r", repeats, "-o", "json"])
    metas.append(meta)
    for row in json.loads(out):
        figures[f"prefill_{row['n_prompt']}"] = row["avg_ts"]
    out, meta = arm([bins / "llama-bench", "-m", gguf, "-t", threads, "-p", "0", "-n", steps, "-d", context,
                     "-r", repeats, "-o", "json"])
    metas.append(meta)
    row = json.loads(out)[0]
    figures["decode_b1_bench"] = row["avg_ts"]
    build = {k: row.get(k) for k in ("build_commit", "build_number", "cpu_info", "backends", "type_k",
                                       "model_type", "model_size", "model_n_params")}
    n_ctx = context + max(batches) * steps + 256
    out, meta = arm([bins / "llama-batched-bench", "-m", gguf, "-t", threads, "-tb", threads, "-c", n_ctx,
                     "-b", 2048, "-ub", 512, "-npp", context, "-ntg", steps, "-npl", ints_text(batches),
                     "-pps", "-kvu", "--output-format", "jsonl"])
    metas.append(meta)
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            r = json.loads(line)
            figures[f"decode_b{r['pl']}"] = r["speed_tg"]
    return {"figures": figures, "runs": metas, "llama_bench": build}


def splitgemma_arm(arm: Arm, fgm: str, threads: int, repeats: int, context: int, steps: int,
                   prompt_lens, batches) -> dict:
    out, meta = arm([sys.executable, "-m", "splitgemma", "bench", "--model", fgm, "--threads", threads,
                     "--prompt-lens", ints_text(prompt_lens), "--batches", ints_text(batches),
                     "--context", context, "--steps", steps, "--repeats", repeats, "--decode-prefix", "both",
                     "--ignore-load", "--json"])
    r = json.loads(out)
    figures = {f"prefill_{p['prompt_len']}": p["tok_s"] for p in r["prefill"]}
    # decode_bB: over one shared prompt, as -pps (B=1: plain); decode_bB_copies: each sequence its own copy
    figures.update({f"decode_b{d['batch']}" + ("_copies" if d["batch"] > 1 and not d["shared_prefix"] else ""):
                    d["tok_s"] for d in r["decode"]})
    return {"figures": figures, "runs": [meta], "backend": r["backend"], "weights": r["weights"],
            "limits": r["limits"], "file_probe": r.get("file_probe")}


def _loaded(run: dict) -> bool:
    """Other processes' CPU use during the run decides (the load average before an arm still holds our previous
    arm's threads: a 1-minute average decays for minutes)."""
    if "others_cpus" in run:
        return run["others_cpus"] > OTHERS_LIMIT
    return bool(run.get("flags"))


def summarise(passes: list[dict]) -> dict:
    """Per arm and figure: the median over unflagged passes (or over all, marked loaded)."""
    out = {}
    for name in passes[0]:
        clean = [p[name] for p in passes if p[name]["figures"] and not any(_loaded(m) for m in p[name]["runs"])]
        use = clean or [p[name] for p in passes]
        keys = sorted({k for p in use for k in p["figures"]})
        out[name] = {"loaded": not clean, "passes_used": len(use), "passes": len(passes),
                     "figures": {k: statistics.median(p["figures"][k] for p in use if k in p["figures"])
                                 for k in keys},
                     "range": {k: [min(p["figures"][k] for p in use if k in p["figures"]),
                                   max(p["figures"][k] for p in use if k in p["figures"])] for k in keys}}
    return out


def rows(prompt_lens, batches, context: int) -> list[tuple[str, str]]:
    out = [(f"prefill {n}", f"prefill_{n}") for n in prompt_lens]
    out.append((f"decode B=1 @{context} (llama-bench tg)", "decode_b1_bench"))
    out += [(f"decode B={b} @{context}" + (" aggregate" if b > 1 else " (batched-bench)"), f"decode_b{b}")
            for b in batches]
    # splitgemma with a copy of the prompt in every sequence's slot (what its decode worker runs today), against the
    # same llama.cpp figure (-pps: one shared prompt)
    out += [(f"decode B={b} @{context} aggregate, splitgemma on copies", f"decode_b{b}_copies")
            for b in batches if b > 1]
    return out


def table(model: str, summary: dict, threads: int, context: int, prompt_lens, batches) -> str:
    arms = [f"llama.cpp {q}" for q in QUANTS] + ["splitgemma"]
    head = f"| {threads} threads, tok/s ({model}) | " + " | ".join(arms) + " | ratio |"
    lines = [head, "|" + "---|" * (len(arms) + 2)]
    for label, key in rows(prompt_lens, batches, context):
        cells, vals = [], {}
        for a in arms:
            s = summary.get(a)
            v = s["figures"].get(key) if s else None
            if v is None and a == "splitgemma" and key == "decode_b1_bench":
                v = s["figures"].get("decode_b1") if s else None
            if v is None and a != "splitgemma" and key.endswith("_copies"):
                v = s["figures"].get(key[: -len("_copies")]) if s else None
            vals[a] = v
            cells.append("–" if v is None else f"{v:.1f}{'*' if s['loaded'] else ''}")
        best = max((vals[a] for a in arms[:-1] if vals[a] is not None), default=None)
        ratio = "–" if best is None or vals["splitgemma"] is None else f"{vals['splitgemma'] / best:.2f}"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def machine() -> dict:
    flags, name = set(), "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and name == "unknown":
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    return {"cpu": name, "cpus": os.cpu_count(),
            # the instruction sets that pick a backend, AVX2 included: the header names an AVX2-only host's too
            "flags": {k: k in flags for k in ("amx_tile", "amx_int8", "amx_bf16", "avx512_vnni", "avx512f", "avx2")}}


# ---------------------------------------------------------------------------------------------------------------
# 4. llama-server, a peer arm for bench/bench_serving.py


def start_llama_server(gguf: str, parallel: int = 1, threads: int = 2, ctx_per_slot: int = 2048,
                       bins: Path | None = None, timeout: float = 600, log_path: str | None = None,
                       extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """Start llama-server from the cached build on a free loopback port: --parallel slots (unified KV of
    parallel × ctx_per_slot positions), its prompt cache on, `threads` threads for prompt and generation. Waits until
    GET /health answers 200 and returns (process, "http://127.0.0.1:PORT/v1"). Stop it with stop_llama_server."""
    if bins is None:
        bins = find_build()
    if not (bins / "llama-server").is_file():
        c = json.loads((cache_root() / "chosen.json").read_text())
        bins = build(c["version"], c["variant"], server=True)
    from splitgemma.serving.ports import free_ports
    (port,) = free_ports(1)
    argv = [bins / "llama-server", "-m", gguf, "--host", "127.0.0.1", "--port", port, "-t", threads, "-tb", threads,
            "--parallel", parallel, "-c", parallel * ctx_per_slot, "-kvu", "--cache-prompt", "--no-webui",
            *extra]
    out = open(log_path, "w") if log_path else subprocess.DEVNULL
    p = subprocess.Popen([str(a) for a in argv], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while True:
        if p.poll() is not None:
            raise RuntimeError(f"llama-server exited {p.returncode} before it was ready"
                               + (f"; see {log_path}" if log_path else ""))
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return p, f"http://127.0.0.1:{port}/v1"
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() > deadline:
            stop_llama_server(p)
            raise RuntimeError(f"llama-server not ready after {timeout:.0f} s")
        time.sleep(0.5)


def stop_llama_server(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def find_build(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """The binaries of the build the last benchmark chose (chosen.json), else of any finished build."""
    chosen = cache_root() / "chosen.json"
    if chosen.is_file():
        c = json.loads(chosen.read_text())
        bins = build_dir(c["version"], c["variant"]) / "build" / "bin"
        if (bins / "llama-server").is_file():
            return bins
    for variant in VARIANTS:
        bins = build_dir(version, variant) / "build" / "bin"
        if (bins / "llama-bench").is_file():
            return bins
    raise RuntimeError("no llama.cpp build yet: run bench/peer_llamacpp.py --prepare-only first")


# ---------------------------------------------------------------------------------------------------------------


def choose_build(version: str, variant: str, probe_gguf: Path, threads: int) -> tuple[Path, str, list[str]]:
    notes = []
    if variant != "auto":
        return build(version, variant, server=False), variant, notes
    chosen = cache_root() / "chosen.json"
    if chosen.is_file():  # an earlier auto run's choice (and why) stands
        c = json.loads(chosen.read_text())
        if c.get("version") == version and c.get("variant") in VARIANTS:
            return build(version, c["variant"], server=False), c["variant"], c.get("notes", [])
    bins = build(version, "native", server=False)
    ok, msg = smoke(bins, probe_gguf, threads)
    notes.append(f"native build smoke test: {'ok' if ok else 'FAILED'}: {msg}")
    log(notes[-1])
    if ok:
        return bins, "native", notes
    bins = build(version, "noamx", server=False)
    ok, msg = smoke(bins, probe_gguf, threads)
    notes.append(f"noamx build smoke test: {'ok' if ok else 'FAILED'}: {msg}")
    log(notes[-1])
    if not ok:
        raise SystemExit("neither llama.cpp build runs: " + "; ".join(notes))
    return bins, "noamx", notes


def print_footer(result: dict) -> None:
    lb = result["load_before_arms"]
    runs = [r for mm in result["models"].values() for p in mm["passes"] for a in p.values() for r in a["runs"]
            if "others_cpus" in r]
    others = [r["others_cpus"] for r in runs]
    print(f"{result['date']}; {result['machine']['cpu']}, {result['machine']['cpus']} CPUs, flags "
          f"{', '.join(k for k, v in result['machine']['flags'].items() if v)}; llama.cpp build "
          f"{result['llama_cpp'].get('variant')} ({(result['llama_cpp'].get('commit') or '?')[:10]}, "
          f"llama-cpp-python {result['llama_cpp'].get('llama_cpp_python')}); 1-minute load average before the "
          f"arms " + (f"{lb['min']:.2f}–{lb['max']:.2f} (median {lb['median']:.2f})" if lb else "–")
          + (f"; other processes' CPU use during the runs {min(others):.2f}–{max(others):.2f} CPUs, "
             f"{sum(o > OTHERS_LIMIT for o in others)} of {len(others)} runs above {OTHERS_LIMIT}" if others else "")
          + "; * = every pass of that arm was loaded (lower bound)")
    for m, spec in result["models"].items():
        if spec.get("page_probe"):
            print(f"{m}: page-cache pages, GB/s (the file / fresh memory): " + "; ".join(
                f"{Path(r['file']).name} {r['read_gbs']}/{r['fresh_gbs']}"
                + (f", read again: {r['read_gbs_after']}/{r['fresh_gbs_after']}" if "read_gbs_after" in r else "")
                for r in spec["page_probe"]))
    for n in result["notes"]:
        print("note:", n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gemma3-270m,e2b",
                    help="comma-separated: gemma3-270m, e2b (default: both, the small one first)")
    ap.add_argument("--passes", type=int, default=3, help="alternating passes over the three arms (default: 3)")
    ap.add_argument("--threads", type=int, default=2, help="threads of every engine (default: 2)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="repetitions inside one llama-bench / splitgemma bench run (default: 3)")
    ap.add_argument("--context", type=int, default=1024, help="decode context (default: 1024)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed (default: 32)")
    ap.add_argument("--prompt-lens", help="prompt lengths of the prefill rows (default "
                                          f"{ints_text(DEFAULT_PROMPT_LENS)}; with --from-json: the saved run's)")
    ap.add_argument("--batches", help=f"decode batch sizes (default {ints_text(DEFAULT_BATCHES)}; with --from-json: "
                                      "the saved run's)")
    ap.add_argument("--settle", type=float, default=120,
                    help="seconds to wait before an arm for the load average to drop below 0.5 × CPUs (default: "
                         "120); the arm then runs anyway and is flagged")
    ap.add_argument("--variant", choices=("auto", *VARIANTS), default="auto",
                    help="llama.cpp build: native (-march=native, AMX on an AMX host), noamx, or auto (default): "
                         "native unless its smoke test crashes")
    ap.add_argument("--version", default=LLAMA_CPP_PYTHON_VERSION, help="llama-cpp-python sdist to build from")
    ap.add_argument("--prepare-only", action="store_true", help="build and convert, then stop")
    ap.add_argument("--json", action="store_true", help="print one JSON object (all passes) instead of tables")
    ap.add_argument("--from-json", metavar="FILE", help="print the tables of a saved run (<cache>/peer/last-run.json "
                                                        "or --json output) again, summarised anew; runs nothing")
    args = ap.parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        prompt_lens = (parse_ints(args.prompt_lens) if args.prompt_lens
                       else saved.get("prompt_lens", DEFAULT_PROMPT_LENS))
        batches = parse_ints(args.batches) if args.batches else saved.get("batches", DEFAULT_BATCHES)
        for m, spec in saved["models"].items():
            spec["summary"] = summarise(spec["passes"])
            print(table(m, spec["summary"], saved["threads"], saved["context"], prompt_lens, batches))
            print()
        print_footer(saved)
        return 0
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    prompt_lens = parse_ints(args.prompt_lens) if args.prompt_lens else DEFAULT_PROMPT_LENS
    batches = parse_ints(args.batches) if args.batches else DEFAULT_BATCHES

    tree = source_tree(args.version)
    # the smoke test needs a GGUF: the default model's, which needs no llama.cpp tool
    from splitgemma.default_model import ensure_gguf
    bins, variant, notes = choose_build(args.version, args.variant, ensure_gguf(progress=True), args.threads)
    if args.variant == "auto":
        (cache_root() / "chosen.json").write_text(json.dumps({"version": args.version, "variant": variant,
                                                              "notes": notes}, indent=1))
    prepared = {}
    for m in models:
        try:
            prepared[m] = prepare_gemma3(bins) if m == "gemma3-270m" else prepare_e2b(bins, tree)
        except (SystemExit, subprocess.CalledProcessError, RuntimeError) as e:
            notes.append(f"{m}: preparation failed: {e}")
            log(notes[-1])
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
              "llama_cpp": {"variant": variant, **build_info(args.version, variant)}, "notes": notes,
              "threads": args.threads, "context": args.context, "steps": args.steps, "prompt_lens": prompt_lens,
              "batches": batches, "models": {}}
    if args.prepare_only:
        build(args.version, variant, server=True)
        result["models"] = prepared
        print(json.dumps(result, indent=1))
        return 0

    arm = Arm(args.settle)
    for m, spec in prepared.items():
        arms = [(f"llama.cpp {q}", "llama", spec["gguf"][q]) for q in QUANTS] + [("splitgemma", "sg", spec["fgm"])]
        spec["page_probe"] = equal_pages([path for _, _, path in arms], args.threads)
        passes = []
        for i in range(args.passes):
            order = arms[i % len(arms):] + arms[:i % len(arms)]
            one = {}
            for name, kind, path in order:
                log(f"{m} pass {i + 1}/{args.passes}: {name}")
                try:
                    if kind == "llama":
                        one[name] = llama_arm(arm, bins, path, args.threads, args.repeats, args.context,
                                              args.steps, prompt_lens, batches)
                    else:
                        one[name] = splitgemma_arm(arm, path, args.threads, args.repeats, args.context,
                                                   args.steps, prompt_lens, batches)
                except RuntimeError as e:
                    notes.append(f"{m} pass {i + 1} {name}: {e}")
                    log(notes[-1])
                    one[name] = {"figures": {}, "runs": [{"flags": ["failed"]}], "error": str(e)}
            passes.append({k: one[k] for k, _, _ in arms})
        result["models"][m] = {**spec, "passes": passes, "summary": summarise(passes)}
        if not args.json:
            print(table(m, result["models"][m]["summary"], args.threads, args.context, prompt_lens, batches),
                  flush=True)
            print()

    loads = [r["load_before"] for mm in result["models"].values() for p in mm["passes"] for a in p.values()
             for r in a["runs"] if "load_before" in r]
    result["load_before_arms"] = {"min": min(loads), "median": statistics.median(loads), "max": max(loads)} \
        if loads else None
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_footer(result)
    with contextlib.suppress(OSError):
        (cache_root() / "last-run.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
