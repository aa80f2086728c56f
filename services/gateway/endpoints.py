"""The gateway's endpoints beside the OpenAI generation API: what a client of vLLM or llama-server expects to find.

  POST /tokenize     vLLM's shapes: {model?, prompt, add_special_tokens=true, return_token_strs=false} or
                     {model?, messages, add_generation_prompt=true, add_special_tokens=false, chat_template_kwargs,
                     return_token_strs=false} (the chat template applied, as /v1/chat/completions would)
                     → {count, max_model_len, tokens[, token_strs]}
  POST /detokenize   {model?, tokens} → {prompt} (special tokens kept, so a /tokenize result round-trips)
  GET  /v1/models    the model card: OpenAI's id/object/created/owned_by, vLLM's root/parent/max_model_len/
                     permission, which chat template chat uses (chat_template), and Anthropic's
                     type/display_name/created_at/lifecycle/max_input_tokens (its clients list models here too)
  GET  /version      {"version"} as vLLM answers
  GET  /             what this server is and where to look next
  /docs, /openapi.json are FastAPI's own (create_app enables them).

max_model_len is the smallest slot context among the healthy decode workers (prompt + completion tokens one
request may hold), null until a worker has told the gateway its context.

These need an API key when keys are configured, as every path but /health, /ready (and /metrics) does (auth.py).
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Annotated

from fastapi import FastAPI, Request
from pydantic import Field

from splitgemma import __version__

from .limits import check_messages, read_body
from .offload import Offload
from .protocol import UINT32_MAX, ChatCompletionRequest, _Strict, parse_json_body, parse_request

if TYPE_CHECKING:
    from .app import Gateway

MAX_DETOKENIZE = 1 << 20  # ids per /detokenize: the body cap bounds it already; this names the limit


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatCompletionRequest):
    """The chat request's own validation (messages, chat_template_kwargs, …), with model optional as vLLM has it."""
    model: str | None = None
    add_special_tokens: bool = False   # vLLM's default for chat: the template writes <bos> itself
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0, le=UINT32_MAX)]], Field(max_length=MAX_DETOKENIZE)]


def parse_tokenize(raw: bytes):
    """vLLM tells its two /tokenize shapes apart by `messages`; so does this (then validates as parse_request)."""
    data = parse_json_body(raw)
    return parse_request(TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest, raw)


def model_card(gw: "Gateway", permission_id: str) -> dict:
    cfg = gw.config
    context = gw.pool.known_context()
    return {"id": cfg.model_name, "object": "model", "created": gw.created, "owned_by": "splitgemma",
            "root": cfg.model_name, "parent": None, "max_model_len": context or None,
            "chat_template": cfg.chat_template_source,
            # Anthropic's model object (its clients list models at the same path)
            "type": "model", "display_name": cfg.model_name, "lifecycle": "active",
            "created_at": datetime.fromtimestamp(gw.created, timezone.utc).isoformat().replace("+00:00", "Z"),
            "max_input_tokens": context or None,
            "permission": [{"id": f"modelperm-{permission_id}", "object": "model_permission",
                            "created": gw.created, "allow_create_engine": False, "allow_sampling": True,
                            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                            "allow_fine_tuning": False, "organization": "*", "group": None,
                            "is_blocking": False}]}


def add_endpoints(app: FastAPI, gw: "Gateway", check_model) -> None:
    cfg = gw.config
    tokenizer = cfg.tokenizer
    # What add_special_tokens adds around a text (Gemma: <bos> before it), from the tokenizer's post-processor.
    special_prefix = tokenizer.encode("", add_special_tokens=True).ids
    permission_id = uuid.uuid4().hex

    def tokenize(req, raw_messages, cancelled) -> list[int]:
        if raw_messages is None:
            return tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens).ids
        ids = gw.chat_prompt(req, raw_messages, None, cancelled)  # tools are not rendered: no plan
        if req.add_special_tokens and ids[:len(special_prefix)] != special_prefix:
            ids = special_prefix + ids
        return ids

    @app.post("/tokenize")
    async def tokenize_endpoint(request: Request):
        raw = await read_body(request, cfg.max_body_bytes, cfg.limits.body_timeout)
        if Offload.is_light(len(raw)):
            req, data = parse_tokenize(raw)
        else:  # as Gateway.parse: pydantic takes about a second for 4 MiB of messages
            req, data = await gw.offload.run(False, lambda cancelled: parse_tokenize(raw))
        if req.model is not None:
            check_model(req.model)
        messages = data.get("messages")
        if messages is not None:
            check_messages(messages, cfg.limits)
        light = Offload.is_light(len(raw), len(messages or ()))
        ids = await gw.offload.run(light, lambda cancelled: tokenize(req, messages, cancelled))
        body = {"count": len(ids), "max_model_len": gw.pool.known_context() or None, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = [tokenizer.id_to_token(i) for i in ids]
        return body

    @app.post("/detokenize")
    async def detokenize_endpoint(request: Request):
        raw = await read_body(request, cfg.max_body_bytes, cfg.limits.body_timeout)
        req, _ = await gw.parse(DetokenizeRequest, raw)
        if req.model is not None:
            check_model(req.model)
        ids = gw._check_ids(req.tokens, "tokens")
        text = await gw.offload.run(Offload.is_light(len(raw)),
                                    lambda cancelled: tokenizer.decode(ids, skip_special_tokens=False))
        return {"prompt": text}

    @app.get("/v1/models")
    async def models():
        # OpenAI's list, with Anthropic's paging fields beside it (one model: one page)
        return {"object": "list", "data": [model_card(gw, permission_id)], "has_more": False,
                "first_id": cfg.model_name, "last_id": cfg.model_name}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        check_model(model)
        return model_card(gw, permission_id)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/")
    async def root():
        return {"name": "splitgemma", "version": __version__, "model": cfg.model_name, "openai_base_path": "/v1",
                "endpoints": ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/conversations",
                              "/v1/messages", "/v1/models",
                              "/tokenize", "/detokenize", "/version", "/health", "/ready", "/metrics"],
                "docs": "/docs", "openapi": "/openapi.json"}
