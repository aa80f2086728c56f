"""splitgemma gateway: the OpenAI-compatible HTTP front over prefill and decode workers."""
from __future__ import annotations

import argparse

from splitgemma.commands import CommandError, add_drain_option, add_log_level_option, non_negative_int, \
    port_number, positive_float, positive_int
from splitgemma.serving.credentials import add_service_token_option, add_tls_options, load_service_token, tls_files

# (name, type, metavar, help) of the limits `up` passes on; the defaults are the dataclasses' in limits.py.
_HTTP_LIMITS = (
    ("max_connections", positive_int, "N", "open HTTP connections; past it the one waiting longest for a request "
     "head is closed, and when every connection has a request in progress a new one gets 503"),
    ("header_timeout", positive_float, "S", "seconds a request's head may take to arrive (else 408, closed)"),
    ("keep_alive_timeout", positive_float, "S", "seconds an idle kept-alive connection stays open"),
    ("max_header_bytes", positive_int, "N", "largest request head (h11's max incomplete event size)"),
)
_REQUEST_LIMITS = (
    ("body_timeout", positive_float, "S", "seconds a request's body may take to arrive after its head (else 408)"),
    ("max_messages", positive_int, "N", "messages per chat request (more: 400)"),
    ("max_rendered_chars", positive_int, "N", "characters of a chat's rendered prompt (more: 400; the render "
     "stops there)"),
)
_RENDER = (
    ("render_threads", positive_int, "N", "threads that parse, render and tokenize requests, per lane (light "
     "and heavy requests have one lane each)"),
    ("render_queue", non_negative_int, "N", "heavy requests (large bodies, many messages) that may wait for a "
     "render thread; one more gets 503"),
)
_GENERATION = (
    ("default_max_tokens", non_negative_int, "N", "tokens a chat completion without max_tokens generates at most "
     "(0: to the end of the context)"),
    ("generation_config", str, "auto|none|PATH", "sampling defaults (temperature, top_p, top_k, min_p, "
     "repetition_penalty) for requests that leave them unset: auto takes the model's generation_config.json from "
     "beside it (its makers' recommendation, as vLLM does), none keeps the API's own (temperature 1, no cut), a "
     "PATH names a generation_config.json or its folder"),
)
_SCHEDULING = (
    ("scheduling_policy", lambda v: _choice(v, ("fcfs", "priority")), "fcfs|priority",
     "fcfs: requests are served in their order of arrival and a request's priority other than 0 is refused (400); "
     "priority: a request's priority (vLLM's field: lower first) orders the decode workers' admission queues and "
     "the prefill workers' prompts, arrival order among equals (docs/scheduling.md)"),
)
_RESPONSES = (
    ("response_store_entries", non_negative_int, "N", "finished responses the Responses API keeps for "
     "previous_response_id and GET /v1/responses/{id}, least recently used first out (0: none; store is then "
     "answered false)"),
    ("response_store_mb", positive_int, "MB", "memory those stored responses may take"),
    ("background_responses", non_negative_int, "N", "Responses API responses with background true that may run at "
     "once (more are refused with 429; 0: background refused)"),
)
_BATCHES = (
    ("files_dir", str, "DIR", "where the Files API keeps uploads and batch outputs, and the Batch API its batches: "
     "a gateway started again on the same folder has them all and takes up the unfinished batches (default: a "
     "temporary folder, removed when the gateway stops)"),
    ("files_mb", positive_int, "MB", "what the uploads there may take together (past it an upload gets 413; batch "
     "outputs are written whatever the bound and count against it)"),
    ("batch_concurrency", non_negative_int, "N", "requests of batches that run at once, across every batch (0: the "
     "Batch API is off); they run behind every interactive request in the workers' queues"),
    ("batch_max_requests", positive_int, "N", "requests a batch's input file may hold"),
)
RENDER_DEFAULTS = {"render_threads": 2, "render_queue": 4}


def _choice(value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise argparse.ArgumentTypeError(f"choose one of {', '.join(choices)}, not {value!r}")
    return value


def add_limit_options(p) -> None:
    """The gateway's limits on what one client may cost (services/gateway/limits.py), for `gateway` and `up`."""
    from splitgemma.services.gateway.app import DEFAULT_CHAT_MAX_TOKENS
    from splitgemma.services.gateway.limits import HttpLimits, RequestLimits
    from splitgemma.services.gateway.response_store import StoreLimits
    from splitgemma.services.gateway.batches import BatchLimits
    from splitgemma.services.gateway.files import FileLimits
    store, files, batches = StoreLimits(), FileLimits(), BatchLimits()
    defaults = {**vars(HttpLimits()), **vars(RequestLimits()), **RENDER_DEFAULTS,
                "files_dir": files.folder, "files_mb": files.megabytes, "batch_concurrency": batches.concurrency,
                "batch_max_requests": batches.max_requests,
                "default_max_tokens": DEFAULT_CHAT_MAX_TOKENS, "generation_config": "auto", "scheduling_policy": "fcfs",
                "response_store_entries": store.entries,
                "response_store_mb": store.megabytes, "background_responses": store.background}
    for name, type_, metavar, text in _HTTP_LIMITS + _REQUEST_LIMITS + _RENDER + _GENERATION + _SCHEDULING + \
            _RESPONSES + _BATCHES:
        default = defaults[name]
        p.add_argument("--" + name.replace("_", "-"), type=type_, default=default, metavar=metavar,
                       help=f"{text} (default: {default:g})" if isinstance(default, float) else
                       text if default == "" else f"{text} (default: {default})")


def limit_argv(args) -> list[str]:
    """The limit options of `args` as gateway arguments."""
    out = []
    for name, *_ in _HTTP_LIMITS + _REQUEST_LIMITS + _RENDER + _GENERATION + _SCHEDULING + _RESPONSES + _BATCHES:
        out += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return out



def register(subparsers) -> None:
    p = subparsers.add_parser(
        "gateway", help="serve the OpenAI API over prefill and decode workers",
        description="Serve /v1/completions, /v1/chat/completions and /v1/responses (with SSE streaming), Anthropic's "
                    "/v1/messages, the Files and Batch APIs (/v1/files, /v1/batches), /v1/models, /tokenize, /detokenize, /version, /docs, /health, /ready and /metrics. "
                    "Each request is tokenized here (with the model's chat template for chat), gets a KV slot from "
                    "a decode worker, is prefilled into it by a prefill worker and streamed back by the decode worker. Telemetry follows the OTEL_* environment variables.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-name", metavar="NAME",
                   help="the model id clients send (default: the --model file name without .fgm)")
    p.add_argument("--model", metavar="FILE.fgm",
                   help="the model file; its tokenizer.json and chat template are looked for beside it")
    p.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json (default: beside --model)")
    p.add_argument("--chat-template", metavar="FILE.jinja",
                   help="chat template (default: the model's own, beside it; without one, its family's built-in "
                        "turn format (Gemma 3), else chat answers 400)")
    p.add_argument("--prefill", required=True, metavar="HOST:PORT[,...]", help="prefill worker addresses")
    p.add_argument("--decode", required=True, metavar="HOST:PORT[,...]", help="decode worker addresses")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000, help="HTTP port (default: 8000)")
    p.add_argument("--max-body-bytes", type=positive_int, default=4 << 20, metavar="N",
                   help="largest request body accepted; larger ones get 413 (default: 4 MiB)")
    add_drain_option(p, positive_float)
    add_limit_options(p)
    add_log_level_option(p)
    add_api_key_options(p)
    p.add_argument("--metrics-auth", action="store_true",
                   help="/metrics needs an API key too (default: open like /health and /ready, so that a "
                        "scraper needs no secret; it shows counts and latencies, no request content)")
    add_tls_options(p, "--tls", cert_help="serve HTTPS with this PEM certificate chain (default: plain HTTP)",
                    ca_help=None)
    add_service_token_option(p)
    add_tls_options(p, "--worker-tls", cert_help="a PEM client certificate to present to the workers (mTLS)",
                    ca_help="talk to the workers over TLS, verifying their certificates with this PEM CA (default: "
                            "plaintext; with only --worker-tls-cert/--worker-tls-key, the system's CAs)")
    p.set_defaults(func=run)


def add_api_key_options(p: argparse.ArgumentParser) -> None:
    """--api-key and --api-key-file, of the gateway and of `splitgemma up`."""
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on the API (repeatable; any local user can read a "
                        "command line with ps: prefer --api-key-file or SPLITGEMMA_API_KEYS, comma-separated; all "
                        "three add up; none = open)")
    p.add_argument("--api-key-file", action="append", metavar="FILE",
                   help="API keys, one a line (blank lines and # comments skipped; repeatable)")


def run(args) -> int:
    from splitgemma.serving.worker import setup_logging, worker_id
    from splitgemma.services.gateway.limits import HttpLimits, RequestLimits
    from splitgemma.services.gateway.response_store import StoreLimits
    from splitgemma.services.gateway.batches import BatchLimits
    from splitgemma.services.gateway.files import FileLimits
    from splitgemma.services.gateway.server import ServeOptions, build_config, serve

    from splitgemma.services.gateway.auth import load_api_keys

    setup_logging("splitgemma-gateway", worker_id("gateway"), args.log_level)
    # Credentials first: a bad file fails at once, before the tokenizer and template load.
    api_keys = load_api_keys(args.api_key, args.api_key_file)
    service_token = load_service_token(args.service_token_file)
    https, worker_tls = tls_files(args, "tls"), tls_files(args, "worker_tls")
    if https.enabled:
        https.check(server=True)
    if worker_tls.enabled:
        worker_tls.check(server=False)
    try:
        config = build_config(model_name=args.model_name, model=args.model, tokenizer=args.tokenizer,
                              chat_template=args.chat_template, prefill=args.prefill, decode=args.decode,
                              max_body_bytes=args.max_body_bytes, api_keys=api_keys, metrics_auth=args.metrics_auth,
                              service_token=service_token, worker_tls=worker_tls,
                              limits=RequestLimits(args.body_timeout, args.max_messages, args.max_rendered_chars),
                              render_threads=args.render_threads, render_queue=args.render_queue,
                              default_max_tokens=args.default_max_tokens, generation_config=args.generation_config,
                              scheduling_policy=args.scheduling_policy,
                              response_store=StoreLimits(args.response_store_entries, args.response_store_mb,
                                                         args.background_responses),
                              files=FileLimits(args.files_dir, args.files_mb),
                              batches=BatchLimits(args.batch_concurrency, args.batch_max_requests))
        http = HttpLimits(max_connections=args.max_connections, header_timeout=args.header_timeout,
                          keep_alive_timeout=args.keep_alive_timeout,
                          max_header_bytes=args.max_header_bytes)
    except ValueError as e:  # a missing tokenizer or template is an OSError, which the CLI reports itself
        raise CommandError(str(e)) from None
    try:
        serve(config, ServeOptions(host=args.host, port=args.port, drain_timeout=args.drain_timeout,
                                   log_level=args.log_level, tls=https, http=http))
    except ValueError as e:  # a file-descriptor limit too low for --max-connections
        raise CommandError(str(e)) from None
    return 0
