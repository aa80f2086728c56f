"""splitgemma gateway: the OpenAI-compatible HTTP front over prefill and decode workers."""
from __future__ import annotations

import argparse

from splitgemma.commands import CommandError, port_number, positive_float, positive_int



def register(subparsers) -> None:
    p = subparsers.add_parser(
        "gateway", help="serve the OpenAI API over prefill and decode workers",
        description="Serve /v1/completions and /v1/chat/completions (with SSE streaming), /v1/models, /health, "
                    "/ready and /metrics. Each request is tokenized here (with the model's chat template for "
                    "chat), gets a KV slot from a decode worker, is prefilled into it by a prefill worker and "
                    "streamed back by the decode worker. Telemetry follows the OTEL_* environment variables.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-name", metavar="NAME",
                   help="the model id clients send (default: the --model file name without .fgm)")
    p.add_argument("--model", metavar="FILE.fgm",
                   help="the model file; its tokenizer.json and chat template are looked for beside it")
    p.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json (default: beside --model)")
    p.add_argument("--chat-template", metavar="FILE.jinja",
                   help="chat template (default: the model's own, beside it; without one, chat answers 400)")
    p.add_argument("--prefill", required=True, metavar="HOST:PORT[,...]", help="prefill worker addresses")
    p.add_argument("--decode", required=True, metavar="HOST:PORT[,...]", help="decode worker addresses")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000, help="HTTP port (default: 8000)")
    p.add_argument("--max-body-bytes", type=positive_int, default=4 << 20, metavar="N",
                   help="largest request body accepted; larger ones get 413 (default: 4 MiB)")
    p.add_argument("--drain-timeout", type=positive_float, default=30.0, metavar="S",
                   help="on SIGTERM, how long requests in flight may finish before they are cancelled (default: 30)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.set_defaults(func=run)


def run(args) -> int:
    from splitgemma.serving.worker import setup_logging, worker_id
    from splitgemma.services.gateway.server import ServeOptions, build_config, serve

    setup_logging("splitgemma-gateway", worker_id("gateway"), args.log_level)
    try:
        config = build_config(model_name=args.model_name, model=args.model, tokenizer=args.tokenizer,
                              chat_template=args.chat_template, prefill=args.prefill, decode=args.decode,
                              max_body_bytes=args.max_body_bytes)
    except ValueError as e:  # a missing tokenizer or template is an OSError, which the CLI reports itself
        raise CommandError(str(e)) from None
    serve(config, ServeOptions(host=args.host, port=args.port, drain_timeout=args.drain_timeout,
                               log_level=args.log_level))
    return 0
