#!/usr/bin/env python3
"""Benchmark the HF → .fgm converter: wall time, CPU time and peak RSS of the converter process.

The conversion runs as its own process (``python -m splitgemma convert``), so the peak RSS reported
(from wait4's rusage) is the converter's alone.

    python bench/make_hf_checkpoint.py /tmp/e2b-hf          # once: a full-size random E2B checkpoint
    python bench/bench_convert.py /tmp/e2b-hf /tmp/e2b.fgm  # then measure
    python bench/bench_convert.py --make /tmp/e2b-hf /tmp/e2b.fgm --delete-checkpoint   # all in one
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def run_measured(cmd: list[str]) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"exit": proc.returncode, "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_rss_mb": usage.ru_maxrss / 1024}  # Linux reports KiB


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="HF checkpoint directory")
    ap.add_argument("out", type=Path, help="output .fgm")
    ap.add_argument("--make", action="store_true", help="first create a random checkpoint at SRC "
                                                        "(bench/make_hf_checkpoint.py) if it is not there")
    ap.add_argument("--preset", default="e2b", help="preset for --make (default: e2b)")
    ap.add_argument("--weights", default="dual")
    ap.add_argument("--group", default="256")
    ap.add_argument("--threads", type=int, help="the converter's --threads (default: its own default)")
    ap.add_argument("--delete-checkpoint", action="store_true", help="remove SRC afterwards")
    ap.add_argument("--keep-output", action="store_true", help="keep OUT (default: delete it)")
    args = ap.parse_args(argv)

    if args.make and not (args.src / "config.json").exists():
        made = run_measured([sys.executable, str(HERE / "make_hf_checkpoint.py"), str(args.src),
                             "--preset", args.preset])
        if made["exit"]:
            return made["exit"]
        print(f"checkpoint made in {made['wall_s']:.0f} s", file=sys.stderr)
    cmd = [sys.executable, "-m", "splitgemma", "convert", str(args.src), str(args.out), "--weights", args.weights,
           "--group", args.group, "--no-progress"] + (["--threads", str(args.threads)] if args.threads else [])
    r = run_measured(cmd)
    result = {"checkpoint_bytes": dir_bytes(args.src), "fgm_bytes": args.out.stat().st_size if r["exit"] == 0 else 0,
              "weights": args.weights, "group": int(args.group), "cpus": len(os.sched_getaffinity(0)),
              "threads": args.threads, **r}
    print(json.dumps(result))
    print(f"convert {args.src} -> {args.out}: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU, "
          f"peak RSS {r['peak_rss_mb']:.0f} MB, exit {r['exit']}", file=sys.stderr)
    if not args.keep_output and args.out.exists():
        args.out.unlink()
    if args.delete_checkpoint:
        shutil.rmtree(args.src)
    return r["exit"]


if __name__ == "__main__":
    sys.exit(main())
