"""splitgemma prefill: run a prefill worker (services/prefill): prompts into decode workers' shared-memory slots.

Also defines the options both workers take (splitgemma decode imports them from here)."""
from __future__ import annotations

import argparse

from splitgemma.commands import (add_drain_option, add_kv_dtype_option, add_log_level_option, add_q8g_input_option,
                                 byte_count, context_length, port_number, positive_float, positive_int, thread_count)
from splitgemma.serving.credentials import add_service_token_option, add_tls_options, load_service_token, tls_files

# The prefill scheduler's policies (services/prefill/scheduler.py); defined here so that --help loads no service.
POLICIES = ("rr", "srf", "fifo")
DEFAULT_POLICY = "srf"  # the best time to first token measured (docs/scheduling.md)

DEFAULT_PORT = 50051


def add_worker_options(p: argparse.ArgumentParser, default_port: int, default_weights: str) -> None:
    """The options of both workers: the model, its slot geometry and threads, the addresses, the arena folder."""
    p.add_argument("--model", required=True, metavar="FILE.fgm", help="the .fgm weight file")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=default_port,
                   help=f"gRPC port (default: {default_port}; 0 = any free port, logged at start)")
    p.add_argument("--max-context", type=context_length, default=4096, metavar="C",
                   help="positions per KV slot (default: 4096); prefill and decode workers must agree")
    p.add_argument("--chunk", type=context_length, default=256, metavar="N",
                   help="prefill rows per pass, part of the slot layout (default: 256); workers must agree")
    p.add_argument("--threads", type=thread_count, default=None,
                   help="compute threads (default: FGM_THREADS, else every CPU this process may use)")
    p.add_argument("--weights", default=default_weights,
                   help=f"int4, int8 or auto:M: which copy of the FFN weights with an int8 twin to use "
                        f"(default: {default_weights})")
    p.add_argument("--backend", choices=("amx", "vnni", "avx2"), default=None,
                   help="GEMM backend (default: FGM_BACKEND, else the best this CPU runs)")
    add_kv_dtype_option(p)
    add_q8g_input_option(p)
    p.add_argument("--shm-dir", default="/dev/shm", metavar="DIR",
                   help="folder of the shared-memory KV arenas; prefill and decode workers must agree "
                        "(default: /dev/shm)")
    p.add_argument("--metrics-port", type=port_number, default=None,
                   help="serve Prometheus metrics on this port (default: off)")
    add_drain_option(p)
    add_log_level_option(p)
    add_service_token_option(p)
    add_tls_options(p, "--tls", cert_help="serve gRPC over TLS with this PEM certificate chain (default: plaintext)",
                    ca_help="with --tls-cert: require client certificates signed by this PEM CA (mTLS)")


def check_worker_options(args) -> None:
    """The credentials, read and checked before the model loads (args.service_token)."""
    args.service_token = load_service_token(args.service_token_file)
    args.tls = tls_files(args, "tls")
    if args.tls.enabled:
        args.tls.check(server=True)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "prefill", help="run a prefill worker (gRPC service splitgemma.v1.Prefill)",
        description="Run a prefill worker: for each Prefill call it maps the decode worker's arena named in the "
                    "lease (a splitgemma-kv-* file directly under --shm-dir), runs the prompt into the leased slot, "
                    "seals the slot header and returns the first token. When the arena is not on this host it "
                    "streams the K/V to the decode worker instead (Decode.PushKv at the lease's kv_address, with "
                    "the service token and --kv-tls-*). Also serves grpc.health.v1 and server "
                    "reflection. --max-context and --chunk must match the decode workers'.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_worker_options(p, DEFAULT_PORT, default_weights="auto:16")
    add_prefix_cache_option(p)
    add_scheduler_options(p)
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer.json for constrained outputs (structured outputs: the first token is masked "
                        "here); default: beside the model file; without one, constrained requests are refused")
    add_tls_options(p, "--kv-tls", cert_help="a PEM client certificate to present to decode workers when K/V goes "
                                             "over the network (Decode.PushKv; mTLS)",
                    ca_help="verify decode workers' TLS certificates with this PEM CA when K/V goes over the "
                            "network (default: plaintext; with only --kv-tls-cert/--kv-tls-key, the system's CAs)")
    p.set_defaults(func=run)


# The K/V prefix of a 3.5k-token prompt of E2B (int8 K/V: 9,336 bytes a position) is 33 MB: 1 GiB holds ~30.
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30


def add_scheduler_options(p: argparse.ArgumentParser) -> None:
    """How the prefill worker runs concurrent prompts (services/prefill/scheduler.py); also `splitgemma up`'s."""
    p.add_argument("--prefill-policy", choices=POLICIES, default=DEFAULT_POLICY,
                   help="which prompt's chunk the model thread runs next: rr (round robin by chunk), srf (shortest "
                        "remaining first) or fifo (one prompt at a time); docs/scheduling.md compares them "
                        f"(default: {DEFAULT_POLICY})")
    p.add_argument("--max-prompts", type=positive_int, default=32, metavar="N",
                   help="Prefill calls in flight (waiting or running); more are refused with RESOURCE_EXHAUSTED "
                        "(default: 32)")
    p.add_argument("--max-prefill-seconds", type=positive_float, default=600.0, metavar="S",
                   help="longest a call may hold its slot, from acceptance to seal, when its own gRPC deadline is "
                        "later or absent (default: 600)")


def add_prefix_cache_option(p: argparse.ArgumentParser) -> None:
    """--prefix-cache-bytes, of the prefill worker and of `splitgemma up`."""
    p.add_argument("--prefix-cache-bytes", type=byte_count, default=DEFAULT_PREFIX_CACHE_BYTES, metavar="BYTES",
                   help="memory for the automatic prefix cache: K/V of prompt prefixes seen before, in blocks of "
                        "--chunk tokens, least recently used evicted first (e.g. 512M, 2G; 0 = off; default: 1G)")


def run(args) -> int:
    import asyncio

    from splitgemma.services.prefill.server import serve

    check_worker_options(args)
    args.kv_tls = tls_files(args, "kv_tls")
    if args.kv_tls.enabled:
        args.kv_tls.check(server=False)
    return asyncio.run(serve(args))
