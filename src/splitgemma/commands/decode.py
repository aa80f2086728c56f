"""splitgemma decode: run a decode worker (services/decode): the KV arena owner and continuous-batching decoder."""
from __future__ import annotations

import argparse

DEFAULT_PORT = 50052
DEFAULT_MAX_QUEUE = 256
DEFAULT_QUEUE_TIMEOUT = 120.0
DEFAULT_LEASE_MS = 30000
# The longest a reservation may hold a slot unclaimed (a prefill writing it keeps it alive regardless): a caller that
# reserves every slot locks the others out for this long at most.
DEFAULT_MAX_LEASE_MS = 60000
# Rows per pass over the weights. The engine sizes its scratch for, and decodes per pass, max(chunk, max_batch) rows
# (docs/engine-api.md), so at the default --chunk 256 this bound costs nothing and binds only with a smaller chunk.
DEFAULT_MAX_BATCH = 64


def add_capacity_options(p: argparse.ArgumentParser) -> None:
    """--kv-cache-bytes or --slots: how many sequences the decode worker's arena holds (up passes them on)."""
    from splitgemma.commands import byte_size, positive_int
    g = p.add_mutually_exclusive_group()
    g.add_argument("--kv-cache-bytes", type=byte_size, default=None, metavar="SIZE",
                   help="memory for the KV arena (bytes, or e.g. 512m, 8g); concurrent sequences = SIZE // the "
                        "slot size of the model at --max-context/--chunk/--kv-dtype (default: min(free space of "
                        "--shm-dir - 1 MiB, (available RAM - the model file) / 2); the worker logs the slot and arena bytes at "
                        "start)")
    g.add_argument("--slots", type=positive_int, default=None,
                   help="KV slots in the arena = concurrent sequences, instead of a memory budget")


def add_speculation_options(p: argparse.ArgumentParser) -> None:
    """The weight-free multi-token paths (docs/speculation.md); the output is the same with them on or off."""
    from splitgemma.commands import non_negative_int
    from splitgemma.services.decode.speculation import SpeculationConfig
    d = SpeculationConfig()
    p.add_argument("--forced-tokens", choices=("on", "off"), default="on" if d.forced else "off",
                   help="take the tokens a constraint forces (its mask admits one id) without the model and feed a "
                        "run of them as one multi-token step whose rows compute no logits (default: %(default)s)")
    p.add_argument("--lookup-k", type=non_negative_int, default=d.lookup_k, metavar="K",
                   help="prompt-lookup speculation: drafts of up to K tokens (at most 8) copied from "
                        "the prompt and output, verified in the step; 0 = off (default: %(default)s)")
    p.add_argument("--lookup-max-batch", type=non_negative_int, default=d.lookup_max_batch, metavar="N",
                   help="draft only in steps of at most N sequences; 0 = in any step (the adaptive policy feeds a "
                        "step's drafts only as far as their rows pay for the whole step; on a 2-core AVX2 host it "
                        "gained 15%% at 4 clients, nothing at 8 and lost 4%% at 32) (default: %(default)s)")
    p.add_argument("--lookup-policy", choices=("adaptive", "fixed"), default=d.lookup_policy,
                   help="the draft length: 'adaptive' picks it each step from the sequence's acceptance rate and the "
                        "measured cost of the extra rows; 'fixed' drafts as much as the prompt offers, up to K, every "
                        "step (timing-independent: for tests and measurements) (default: %(default)s)")


def add_lease_options(p: argparse.ArgumentParser) -> None:
    """--lease-ms and --max-lease-ms (up passes them on)."""
    from splitgemma.commands import positive_int
    p.add_argument("--lease-ms", type=positive_int, default=DEFAULT_LEASE_MS,
                   help="how long a reserved slot waits for its Generate when the Reserve asks for no length; while "
                        f"a prefill is writing the slot the lease does not expire (default: {DEFAULT_LEASE_MS})")
    p.add_argument("--max-lease-ms", type=positive_int, default=DEFAULT_MAX_LEASE_MS,
                   help="the longest lease granted: a Reserve asking for more gets this long (its lease's deadline "
                        f"says so), so no caller holds slots unclaimed for longer (default: {DEFAULT_MAX_LEASE_MS})")


def check_speculation_options(args) -> None:
    from splitgemma.commands import CommandError
    if args.lookup_k > 8:
        raise CommandError(f"--lookup-k must be at most 8, got {args.lookup_k}")


def speculation_argv(args) -> list[str]:
    """The speculation options as a decode worker's command line takes them (up passes them on)."""
    return ["--forced-tokens", args.forced_tokens, "--lookup-k", str(args.lookup_k),
            "--lookup-max-batch", str(args.lookup_max_batch), "--lookup-policy", args.lookup_policy]


def check_lease_options(args) -> None:
    from splitgemma.commands import CommandError
    if args.lease_ms > args.max_lease_ms:
        raise CommandError(f"--lease-ms {args.lease_ms} exceeds --max-lease-ms {args.max_lease_ms}")


def register(subparsers) -> None:
    from splitgemma.commands import non_negative_int, positive_float, positive_int
    from splitgemma.commands.prefill import add_worker_options
    p = subparsers.add_parser(
        "decode", help="run a decode worker (gRPC service splitgemma.v1.Decode)",
        description="Run a decode worker: it creates the shared-memory KV arena under --shm-dir (as many slots as "
                    "--kv-cache-bytes holds, or --slots), "
                    "leases its slots (Reserve), verifies each slot a prefill worker filled (Generate) and decodes "
                    "every running sequence in one continuous batch, streaming the tokens. A Reserve that finds "
                    "every slot taken waits in a first-come-first-served queue (--max-queue, --queue-timeout) "
                    "shared by every gateway in front of this worker. Also serves grpc.health.v1 and server "
                    "reflection. SIGTERM/SIGINT: stop admitting (queued Reserves are answered UNAVAILABLE), "
                    "finish the running streams (at most --drain-timeout), unlink the arena.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_worker_options(p, DEFAULT_PORT, default_weights="int4")
    add_capacity_options(p)
    p.add_argument("--max-batch", type=positive_int, default=DEFAULT_MAX_BATCH,
                   help="decode rows per forward pass; a larger batch runs in several passes. The engine's "
                        "scratch holds max(--chunk, --max-batch) rows, so up to --chunk rows cost no memory "
                        f"(default: {DEFAULT_MAX_BATCH})")
    add_speculation_options(p)
    add_lease_options(p)
    p.add_argument("--max-queue", type=non_negative_int, default=DEFAULT_MAX_QUEUE, metavar="N",
                   help="Reserve calls that may wait for a slot when all are taken; one more is refused at once "
                        "(RESOURCE_EXHAUSTED, the gateway's 429) with a retry-after from the observed rate at "
                        f"which slots free up. 0 = no queue (default: {DEFAULT_MAX_QUEUE})")
    p.add_argument("--queue-timeout", type=positive_float, default=DEFAULT_QUEUE_TIMEOUT, metavar="SECONDS",
                   help="the longest a Reserve waits in the queue before it is refused (DEADLINE_EXCEEDED, the "
                        f"gateway's 503) with a retry-after (default: {DEFAULT_QUEUE_TIMEOUT:g})")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer.json for token texts and stop strings (default: beside the model file; "
                        "without one, texts stay empty and stop strings are refused)")
    p.add_argument("--worker-id", default=None,
                   help="names the arena file (default: decode-<pid>-<random>, unique per start)")
    p.add_argument("--advertise-address", default=None, metavar="HOST:PORT",
                   help="where prefill workers on other hosts reach this worker to send K/V over the network "
                        "(Decode.PushKv), put in every lease (default: the address the gateway dials this worker at)")
    p.set_defaults(func=run)


def run(args) -> int:
    import asyncio

    from splitgemma.commands.prefill import check_worker_options
    from splitgemma.services.decode.server import serve

    check_worker_options(args)
    check_lease_options(args)
    check_speculation_options(args)
    return asyncio.run(serve(args))
