"""Running the gateway: build its configuration from command-line options and serve it with uvicorn.

Shutdown (SIGTERM or SIGINT): uvicorn stops accepting connections, waits up to `drain_timeout` seconds for the
requests in flight (streams included) to finish, then cancels what is left (which cancels their gRPC calls and so
frees their decode slots), and the app closes its worker channels and flushes telemetry.
"""

from __future__ import annotations

import json
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path

from splitgemma.serving.chat_template import ChatTemplate, ChatTemplateNotFound, find_chat_template, \
    special_token_strings
from splitgemma.serving.templates import builtin_chat_template
from splitgemma.serving.credentials import TlsFiles
from splitgemma.serving.generation_config import load_sampling_defaults
from splitgemma.serving.grammar import Grammars
from splitgemma.serving.stop_tokens import model_stop_tokens
from splitgemma.serving.tokenizer import find_tokenizer, load_tokenizer

from .app import DEFAULT_CHAT_MAX_TOKENS, GatewayConfig, create_app
from .auth import warn_if_open
from .batches import BatchLimits
from .files import FileLimits
from .limits import HttpLimits, RequestLimits, ensure_fd_limit, uvicorn_settings
from .pipeline import Timeouts
from .response_store import StoreLimits

log = logging.getLogger("splitgemma.gateway")


@dataclass
class ServeOptions:
    host: str
    port: int
    drain_timeout: float = 30.0
    log_level: str = "INFO"
    tls: TlsFiles | None = None     # HTTPS with this certificate and key
    http: HttpLimits = field(default_factory=HttpLimits)


def parse_addresses(text: str, option: str) -> list[str]:
    """HOST:PORT[,HOST:PORT…] → a list, or ValueError naming the option and the bad entry."""
    out = []
    for item in (p.strip() for p in text.split(",")):
        host, sep, port = item.rpartition(":")
        if not item or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{option}: {item!r} is not HOST:PORT")
        out.append(item)
    return out


def build_config(*, model_name: str | None, model: str | None, tokenizer: str | None, chat_template: str | None,
                 prefill: str, decode: str, max_body_bytes: int, timeouts: Timeouts | None = None,
                 api_keys: list[str] | None = None, metrics_auth: bool = False, service_token: str | None = None,
                 worker_tls: TlsFiles | None = None, limits: RequestLimits | None = None, render_threads: int = 2,
                 render_queue: int = 4, default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS,
                 response_store: StoreLimits | None = None, generation_config: str = "auto",
                 scheduling_policy: str = "fcfs", files: FileLimits | None = None,
                 batches: BatchLimits | None = None) -> GatewayConfig:
    """default_max_tokens 0: chat without max_tokens runs to the end of the context; generation_config: where the
    sampling defaults come from (splitgemma/serving/generation_config.py)."""
    if model is None and tokenizer is None:
        raise ValueError("give --tokenizer FILE or --model FILE.fgm (the tokenizer is looked for beside it)")
    if model_name is None:
        if model is None:
            raise ValueError("give --model-name NAME (the name clients send as 'model')")
        model_name = Path(model).stem
    tok = load_tokenizer(model or tokenizer, tokenizer)
    model_config: dict = {}
    if model is not None:
        from splitgemma._native import FgmFile  # validates the file; FgmError is a ValueError
        model_config = json.loads(FgmFile(model).header_json)["config"]
    # Files beside the model (or beside the tokenizer when no model is given) hold the template; a model without
    # one gets its family's standard turn format, if there is one (Gemma 3's base models ship none).
    beside = model or tokenizer
    source = where = None
    try:
        source, where = find_chat_template(beside, chat_template)
        # Not the path: /v1/models is no place for the server's file layout.
        template_source = "model" if chat_template is None else "--chat-template"
    except ChatTemplateNotFound as e:
        if chat_template is not None:
            raise
        reason = str(e)
        builtin = builtin_chat_template(model_config.get("model_type"))
        if builtin is not None:
            source, template_source = builtin
            log.info("the model has no chat template: chat uses the built-in one of its family",
                     extra={"template": template_source, "reason": reason})
        else:
            log.info("no chat template: the chat endpoint answers 400", extra={"reason": reason})
    template = None
    if source is not None:
        template = ChatTemplate(source, tok, special_token_strings(tok, beside))
        reason = ""
        if where is not None:
            log.info("chat template loaded", extra={"path": str(where)})
    else:
        template_source = None
    vocab = model_config.get("vocab_size")
    sampling = load_sampling_defaults(generation_config, beside)
    if sampling.given():
        log.info("sampling defaults from the generation config", extra={"path": sampling.source, **sampling.given()})
    grammars = Grammars(find_tokenizer(beside, tokenizer), model_stop_tokens(beside)[0],
                        vocab or tok.get_vocab_size(with_added_tokens=True))
    return GatewayConfig(model_name=model_name, tokenizer=tok, chat_template=template, vocab_size=vocab,
                         grammars=grammars, chat_template_source=template_source,
                         default_max_tokens=default_max_tokens or None,
                         no_chat_template_reason=reason or "no chat template",
                         prefill=parse_addresses(prefill, "--prefill"), decode=parse_addresses(decode, "--decode"),
                         max_body_bytes=max_body_bytes, timeouts=timeouts or Timeouts(), api_keys=api_keys or [],
                         metrics_auth=metrics_auth, service_token=service_token, worker_tls=worker_tls,
                         limits=limits or RequestLimits(), render_threads=render_threads,
                         render_queue=render_queue, response_store=response_store or StoreLimits(),
                         sampling_defaults=sampling, scheduling_policy=scheduling_policy,
                         files=files or FileLimits(), batches=batches or BatchLimits())


def serve(config: GatewayConfig, options: ServeOptions) -> None:
    import uvicorn

    ensure_fd_limit(options.http)
    app = create_app(config)
    tls = options.tls if options.tls is not None and options.tls.enabled else None
    server = uvicorn.Server(uvicorn.Config(
        app, host=options.host, port=options.port, log_level=options.log_level.lower(), access_log=False,
        timeout_graceful_shutdown=options.drain_timeout, lifespan="on", log_config=None,
        ssl_certfile=tls.cert if tls else None, ssl_keyfile=tls.key if tls else None,
        **uvicorn_settings(options.http)))
    log.info("gateway starting", extra={"host": options.host, "port": options.port, "model": config.model_name,
                                        "prefill": config.prefill, "decode": config.decode,
                                        "api_keys": len(config.api_keys), "https": tls is not None,
                                        "service_token": config.service_token is not None,
                                        "worker_tls": config.worker_tls is not None and config.worker_tls.enabled})
    warn_if_open(options.host, config.api_keys)
    # uvicorn handles SIGTERM/SIGINT itself (stop accepting, drain), then re-raises the signal to the handler it
    # found at start. A no-op handler there makes a drained shutdown end with status 0 instead of death by signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    server.run()
    if not server.started:
        raise OSError(f"the gateway could not start on {options.host}:{options.port}")
