"""Soak test: N clients for T minutes against a decode + prefill + gateway stack on loopback, a share of the streams
dropped by their client mid-way; memory, open files and decode slots of every process before, after warm-up and at
the end, and greedy outputs under load checked against the same prompts run alone.

    python bench/soak.py [--minutes 10] [--clients 16] [--disconnect 0.2] [--model M.fgm [--tokenizer T.json]]
                         [--api completions|responses] [--response-store-mb 64]

The three processes are started here (`python -m splitgemma decode|prefill|gateway`, as the tests do, so that each
one's /proc/<pid> can be read) on free loopback ports with a private KV folder, and stopped at the end. Without
--model the model is a small random one written the way tests/test_cli_fgm.py does (mini-e2b-tame's shapes,
random weights) with that fixture's tokenizer beside it.

Each client loops: a random prompt of --prompts fixed ones, streamed (SSE) greedy with exactly --max-tokens
tokens; with probability --disconnect it closes the connection after a random number of chunks, otherwise it reads
to the end and compares the text with the prompt's solo output. Reported: RSS (VmRSS) and open file descriptors of
each process, and the decode worker's slots (Stats), at start, after --warmup seconds and at the end (once the slots
are free again); the gateway's growth after warm-up per minute and per dropped stream; request counts, errors and
mismatches. Exit status 1 when an output differed, a request failed or a slot stayed in use.

--api responses sends the same prompts to /v1/responses instead (streamed typed events, each response stored: the
gateway's store fills to --response-store-mb and then evicts, so its RSS must level off there; the gateway gets
Gemma 4's chat template from tests/fixtures/chat unless the model has one).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import httpx

from splitgemma.serving.ports import free_ports
from splitgemma.v1 import serving_pb2 as pb
from splitgemma.v1 import serving_pb2_grpc as pbg

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "fastgemma" / "mini-e2b-tame"
CHAT_TEMPLATE = ROOT / "tests" / "fixtures" / "chat" / "chat-template-e2b.jinja"
# Runs the command after it with PR_SET_PDEATHSIG = SIGTERM (kept across exec): no server outlives this script.
DIE_WITH_PARENT = [sys.executable, "-c", "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
                   "os.execvp(sys.argv[1], sys.argv[1:])"]


def random_model(folder: Path) -> tuple[Path, Path]:
    """A .fgm with mini-e2b-tame's shapes and random weights, and the fixture's tokenizer beside it."""
    from splitgemma.fgm.hf_config import parse_text_config
    from splitgemma.fgm.random_model import write_random_model

    raw = json.loads((FIXTURE / "config.json").read_text())["text_config"]
    out = folder / "soak-random.fgm"
    write_random_model(parse_text_config(raw, "soak"), out, seed=0, progress=False, label="soak")
    shutil.copy(FIXTURE / "tokenizer.json", folder / "tokenizer.json")
    return out, folder / "tokenizer.json"


class Stack:
    def __init__(self, args, folder: Path):
        self.folder = folder
        self.shm = Path(tempfile.mkdtemp(prefix="sg-soak-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))
        dport, pport, gport = free_ports(3)
        common = ["--model", str(args.model), "--max-context", str(args.max_context), "--chunk", "64",
                  "--shm-dir", str(self.shm), "--log-level", "WARNING"]
        if args.threads:
            common += ["--threads", str(args.threads)]
        tok = ["--tokenizer", str(args.tokenizer)] if args.tokenizer else []
        self.decode_addr = f"127.0.0.1:{dport}"
        self.url = f"http://127.0.0.1:{gport}"
        self.procs: dict[str, subprocess.Popen] = {}
        self._start("decode", ["decode", *common, *tok, "--port", str(dport), "--slots", str(args.slots),
                               "--max-queue", str(4 * args.clients)])
        self._start("prefill", ["prefill", *common, "--port", str(pport)])
        chat = ["--response-store-mb", str(args.response_store_mb)]
        if args.api == "responses" and not (Path(args.model).parent / "chat_template.jinja").exists():
            chat += ["--chat-template", str(CHAT_TEMPLATE)]
        self._start("gateway", ["gateway", "--model", str(args.model), *tok, "--prefill", f"127.0.0.1:{pport}",
                                "--decode", self.decode_addr, "--port", str(gport), "--log-level", "WARNING", *chat])
        self.channel = grpc.insecure_channel(self.decode_addr)
        self.decode = pbg.DecodeStub(self.channel)

    def _start(self, name: str, argv: list[str]) -> None:
        log = open(self.folder / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen([*DIE_WITH_PARENT, sys.executable, "-m", "splitgemma", *argv],
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise SystemExit(f"{name} exited with {p.returncode}; see {self.folder / (name + '.log')}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"the stack was not ready after {timeout:.0f} s")

    def stats(self) -> pb.DecodeStats:
        return self.decode.Stats(pb.StatsRequest(), timeout=5)

    def wait_idle(self, timeout: float) -> pb.DecodeStats:
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if s.slots_leased == s.slots_running == s.slots_quarantined == 0 or time.monotonic() > deadline:
                return s
            time.sleep(0.05)

    def snapshot(self) -> dict:
        out = {}
        for name, p in self.procs.items():
            rss = next(int(line.split()[1]) for line in open(f"/proc/{p.pid}/status") if line.startswith("VmRSS"))
            out[name] = {"rss_kb": rss, "fds": len(os.listdir(f"/proc/{p.pid}/fd"))}
        s = self.stats()
        out["slots"] = {"total": s.slots_total, "leased": s.slots_leased, "running": s.slots_running,
                        "quarantined": s.slots_quarantined}
        return out

    def stop(self) -> dict[str, int]:
        self.channel.close()
        codes = {}
        for names in (["gateway"], ["prefill", "decode"]):
            for n in names:
                if self.procs[n].poll() is None:
                    self.procs[n].send_signal(signal.SIGTERM)
            for n in names:
                try:
                    codes[n] = self.procs[n].wait(60)
                except subprocess.TimeoutExpired:
                    self.procs[n].kill()
                    codes[n] = self.procs[n].wait()
        shutil.rmtree(self.shm, ignore_errors=True)
        return codes


def complete(url: str, body: dict, client: httpx.Client, drop_after: int | None = None) -> str | None:
    """Stream one completion; its text, or None when dropped after `drop_after` chunks (the connection is closed)."""
    text = []
    with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
        chunks = 0
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text.append(json.loads(line[6:])["choices"][0]["text"])
            chunks += 1
            if drop_after is not None and chunks >= drop_after:
                return None  # leaving the block unread closes the connection mid-stream
    return "".join(text)


def respond(url: str, body: dict, client: httpx.Client, drop_after: int | None = None) -> str | None:
    """The same as complete() through /v1/responses: `body` is a completion's, sent as the Responses request it
    means (its prompt the input); the text of the output_text deltas, checked against the final event's."""
    request = {"model": body["model"], "input": body["prompt"], "max_output_tokens": body["max_tokens"],
               "temperature": body["temperature"], "ignore_eos": body["ignore_eos"], "stream": True}
    text = []
    with client.stream("POST", url + "/v1/responses", json=request) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "response.output_text.delta":
                text.append(event["delta"])
                if drop_after is not None and len(text) >= drop_after:
                    return None
            elif event["type"] in ("response.completed", "response.incomplete"):
                final = "".join(c["text"] for item in event["response"]["output"] for c in item["content"])
                if final != "".join(text):
                    raise RuntimeError("the final response's text is not the deltas'")
            elif event["type"] in ("error", "response.failed"):
                raise RuntimeError(f"stream failed: {line[:200]}")
    return "".join(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--disconnect", type=float, default=0.2, help="share of streams dropped mid-way")
    ap.add_argument("--warmup", type=float, default=None, metavar="S",
                    help="seconds before the second snapshot (default: 60, or a third of a shorter run)")
    ap.add_argument("--model", type=Path, help="a .fgm (default: a small random model)")
    ap.add_argument("--tokenizer", type=Path, help="tokenizer.json (default: beside the model)")
    ap.add_argument("--prompts", type=int, default=8, help="distinct prompts (default: 8)")
    ap.add_argument("--prompt-words", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--slots", type=int, default=None, help="decode slots (default: --clients)")
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1, help="compute threads per worker (default: 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api", choices=("completions", "responses"), default="completions",
                    help="the endpoint the clients use (default: completions)")
    ap.add_argument("--response-store-mb", type=int, default=64, help="the gateway's Responses store (default: 64)")
    args = ap.parse_args()
    call = respond if args.api == "responses" else complete
    duration = args.minutes * 60
    warmup = args.warmup if args.warmup is not None else min(60.0, duration / 3)
    args.slots = args.slots or args.clients
    rng = random.Random(args.seed)
    folder = Path(tempfile.mkdtemp(prefix="splitgemma-soak-"))
    if args.model is None:
        args.model, args.tokenizer = random_model(folder)
    stack = Stack(args, folder)
    try:
        stack.wait_ready(300)
        prompts = [" ".join(f"w{rng.randrange(4, 1000)}" for _ in range(args.prompt_words))
                   for _ in range(args.prompts)]
        base = {"model": Path(args.model).stem, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
        with httpx.Client(timeout=120) as c:
            solo = [call(stack.url, {**base, "prompt": p}, c) for p in prompts]
        snaps = {"start": stack.snapshot()}
        counts: Counter = Counter()
        errors: list[str] = []
        lock = threading.Lock()
        end = time.monotonic() + duration

        def client(seed: int) -> None:
            r = random.Random(seed)
            with httpx.Client(timeout=120) as c:
                while time.monotonic() < end:
                    i = r.randrange(len(prompts))
                    drop = r.random() < args.disconnect
                    try:
                        got = call(stack.url, {**base, "prompt": prompts[i]}, c,
                                       r.randint(1, max(1, args.max_tokens // 2)) if drop else None)
                        outcome = "dropped" if drop else ("equal" if got == solo[i] else "DIFFERENT")
                    except (httpx.HTTPError, RuntimeError) as e:
                        outcome = "error"
                        with lock:
                            errors.append(f"{type(e).__name__}: {e}")
                    with lock:
                        counts[outcome] += 1

        threads = [threading.Thread(target=client, args=(args.seed * 1000 + k,), daemon=True)
                   for k in range(args.clients)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(warmup)
        snaps["warm"] = stack.snapshot()
        drops_at_warm = counts["dropped"]
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
        idle = stack.wait_idle(30)
        time.sleep(1.0)  # the gateway's background releases and the workers' cleanup
        snaps["end"] = stack.snapshot()
    finally:
        codes = stack.stop()

    print(f"soak: /v1/{args.api}, {args.clients} clients x {args.minutes:g} min ({elapsed:.0f} s), disconnect "
          f"{args.disconnect:.0%}, "
          f"warm-up {warmup:.0f} s, model {args.model} ({args.slots} slots, {args.max_tokens} tokens per request)")
    print(f"requests: {dict(counts)}")
    print(f"{'':10}{'RSS start':>12}{'warm':>10}{'end':>10}   {'fds start':>9}{'warm':>6}{'end':>6}")
    for name in ("gateway", "prefill", "decode"):
        r = [snaps[k][name]["rss_kb"] / 1024 for k in ("start", "warm", "end")]
        f = [snaps[k][name]["fds"] for k in ("start", "warm", "end")]
        print(f"{name:10}{r[0]:>9.1f} MB{r[1]:>7.1f} MB{r[2]:>7.1f} MB   {f[0]:>9}{f[1]:>6}{f[2]:>6}")
    for k in ("start", "warm", "end"):
        print(f"decode slots at {k}: {snaps[k]['slots']}")
    after_warm = elapsed - warmup
    drops = counts["dropped"] - drops_at_warm
    growth = (snaps["end"]["gateway"]["rss_kb"] - snaps["warm"]["gateway"]["rss_kb"]) * 1024
    if after_warm > 0:
        print(f"gateway RSS after warm-up: {growth / 1024:+.0f} KB ({growth / 1024 / (after_warm / 60):+.0f} KB/min"
              + (f", {growth / drops:+.0f} B per dropped stream)" if drops else ")"))
    print(f"exit codes: {codes}")
    for e in errors[:10]:
        print("error:", e)
    busy = idle.slots_leased + idle.slots_running + idle.slots_quarantined
    ok = counts["DIFFERENT"] == 0 and counts["error"] == 0 and busy == 0 and counts["equal"] > 0
    print("OK" if ok else "FAILED", f"(logs in {folder})")
    if ok:
        shutil.rmtree(folder, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
