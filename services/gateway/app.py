"""The gateway's HTTP application: the OpenAI endpoints over the prefill/decode workers, plus operations.

  POST /v1/completions, /v1/chat/completions   (stream: SSE `data: {chunk}` … `data: [DONE]`)
  POST /v1/responses, and GET / DELETE the stored ones (responses.py; stream: typed SSE events)
  /v1/conversations: OpenAI's Conversations API, whose items a response may continue (conversations.py)
  POST /v1/messages, /v1/messages/count_tokens: Anthropic's Messages API (messages.py; its envelope for errors)
  /v1/files, /v1/batches: OpenAI's Files and Batch APIs (files.py, batches.py); /v1/messages/batches: Anthropic's
                 Message Batches API (message_batches.py)
  GET  /v1/models, /v1/models/{id}; POST /tokenize, /detokenize; GET /version, /, /docs, /openapi.json
                 (endpoints.py)
  GET  /health   liveness: answers as long as the event loop runs (inference never runs on it, nor parsing,
                 rendering or tokenizing a prompt: offload.py; slow and idle clients are bounded: limits.py)
  GET  /ready    200 when at least one prefill and one decode worker answer SERVING, else 503
  GET  /metrics  Prometheus

The inference endpoints' work, from a body to its answer, is inference.py's (a batch runs the same); the routes here
add the request id, the caller's key and the disconnect watch.

With API keys configured every path but /health, /ready (and /metrics unless metrics_auth) needs one (auth.py).

Client disconnects (the vLLM pattern): a request's handler runs beside a task that waits for the ASGI
http.disconnect message, and is cancelled when it arrives; a streaming response listens the same way while it
streams. Cancelling cancels the in-flight gRPC calls, so the decode worker frees the slot.

Tracing: a SERVER span per API request (continuing the client's traceparent if it sent one), and inside it an
INTERNAL gen_ai span "chat {model}" / "text_completion {model}" that is current around every gRPC call, so the
workers' spans join the same trace.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import AsyncIterator, Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from tokenizers import Tokenizer

from splitgemma import __version__
from splitgemma.serving import telemetry
from splitgemma.serving.chat_template import ChatTemplate, ChatTemplateError, RenderBudget, RenderTooLarge
from splitgemma.serving.credentials import TlsFiles
from splitgemma.serving.generation_config import SamplingDefaults
from splitgemma.serving.grammar import Grammars
from splitgemma.v1 import serving_pb2 as pb

from .auth import ApiKeyMiddleware, request_owner
from .background import BackgroundRuns
from .batches import BatchLimits, Batches, add_batch_endpoints
from .conversation_store import ConversationStore
from .conversations import add_conversation_endpoints
from .endpoints import add_endpoints
from .files import FileLimits, FileStore, add_file_endpoints
from .inference import Inference
from .limits import ClientGoneError, RequestLimits, check_messages, read_body
from .message_batches import add_message_batch_endpoints
from .messages import error_body, is_messages_path
from .metrics import GatewayMetrics
from .offload import Offload
from .pipeline import ChoiceSpec, Pipelines, Run, Timeouts
from .reasoning import ReasoningFormat, ReasoningPlan, plan_reasoning, template_kwargs
from .render import ChoiceRenderer
from .response_store import ResponseStore, StoreLimits
from .responses import add_store_endpoints, truncated
from .protocol import (LOWEST_PRIORITY, MAX_CHOICES, ApiError, ChatCompletionRequest, CompletionRequest, invalid,
                       parse_request)
from .structured import request_constraint, wants_constraint
from .tools import ToolFormat, ToolPlan, plan_tools, template_messages
from .workers import WorkerPool

log = logging.getLogger("splitgemma.gateway")

# Chat stops at the gateway's --default-max-tokens (or the end of the context, if sooner): a small model that never
# says its end-of-turn would otherwise run through the whole context (completions stop at 16, as OpenAI's).
DEFAULT_CHAT_MAX_TOKENS = 1024
# Temperatures below this sample greedily, as vLLM's _SAMPLING_EPS: the workers take float32, in which a smaller
# temperature's inverse overflows (1e-39 would sample garbage and report -inf logprobs). Likewise a top_p that
# rounds to float32 0 would mean "no cut" there: the smallest positive top_p keeps the likeliest token only.
MIN_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-6


@dataclass
class GatewayConfig:
    model_name: str
    tokenizer: Tokenizer
    prefill: list[str]
    decode: list[str]
    chat_template: ChatTemplate | None = None
    no_chat_template_reason: str = "this model has no chat template"
    chat_template_source: str | None = None   # where chat's template came from, for /v1/models (endpoints.py)
    # chat without max_tokens/max_completion_tokens generates at most this many (None: to the end of the context)
    default_max_tokens: int | None = DEFAULT_CHAT_MAX_TOKENS
    max_body_bytes: int = 4 << 20
    limits: RequestLimits = field(default_factory=RequestLimits)
    render_threads: int = 2         # per lane of Offload
    render_queue: int = 4           # expensive prompts that may wait for a render thread
    timeouts: Timeouts = field(default_factory=Timeouts)
    probe_interval: float = 0.5
    vocab_size: int | None = None   # the model's (from its file); else the tokenizer's bounds token-id prompts
    api_keys: list[str] = field(default_factory=list)   # none: the API is open (auth.py)
    metrics_auth: bool = False                          # /metrics needs a key too
    service_token: str | None = None                    # sent to the workers (splitgemma/serving/credentials.py)
    worker_tls: TlsFiles | None = None
    grammars: Grammars | None = None    # compiles structured-output constraints; None: they are refused
    response_store: StoreLimits = field(default_factory=StoreLimits)   # the Responses API's (response_store.py)
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)   # the model's recommended
    scheduling_policy: str = "fcfs"     # priority: requests' `priority` orders the queues (docs/scheduling.md)
    files: FileLimits = field(default_factory=FileLimits)         # the Files API's folder (files.py)
    batches: BatchLimits = field(default_factory=BatchLimits)     # the Batch API's (batches.py)


class _RequestState:
    """Per-request bookkeeping shared by the streaming and non-streaming paths."""

    def __init__(self, app: "Gateway", operation: str, request_id: str):
        self.app = app
        self.operation = operation
        self.request_id = request_id
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.output_tokens = 0
        self.span = None

    def on_event(self, event: pb.GenerateEvent) -> None:
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
            self.app.metrics.ttft.observe(now - self.t0)
        elif self.t_last is not None:
            self.app.metrics.inter_token.observe(now - self.t_last)
        self.t_last = now
        self.output_tokens += len(event.tokens)
        self.app.metrics.generation_tokens.inc(len(event.tokens))

    def finish(self, error_type: str | None = None, *, response_id: str | None = None,
               finish_reasons: list[str] | None = None, input_tokens: int | None = None) -> None:
        duration = time.perf_counter() - self.t0
        if error_type is None:
            self.app.metrics.e2e.observe(duration)
            for reason in finish_reasons or ():
                self.app.metrics.success.labels(finished_reason=reason).inc()
        self.app.genai.record(self.operation, self.app.config.model_name, duration_s=duration,
                              ttft_s=None if self.t_first is None else self.t_first - self.t0,
                              output_tokens=self.output_tokens, error_type=error_type)
        if self.span is not None:
            telemetry.set_gen_ai_response(self.span, response_id=response_id,
                                          response_model=self.app.config.model_name,
                                          finish_reasons=finish_reasons, input_tokens=input_tokens,
                                          output_tokens=self.output_tokens)
            if error_type is not None:
                telemetry.set_gen_ai_error(self.span, error_type)
            self.span.end()
            self.span = None


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.metrics = GatewayMetrics(config.model_name)
        tel = telemetry.setup_telemetry("splitgemma-gateway")
        self.tracer = tel.tracer
        self.genai = telemetry.GenAiServerMetrics(tel.meter)
        self.pool = WorkerPool(config.prefill, config.decode, interval=config.probe_interval,
                               on_stats=self.metrics.take_decode_stats, service_token=config.service_token,
                               tls=config.worker_tls)
        self.pipelines = Pipelines(self.pool, config.timeouts, self.metrics)
        self.offload = Offload(self.metrics, config.render_threads, config.render_queue)
        self.created = int(time.time())
        self.vocab_size = config.vocab_size or config.tokenizer.get_vocab_size(with_added_tokens=True)
        self.grammars = config.grammars or Grammars(None, (), self.vocab_size)
        self.response_store = ResponseStore(config.response_store)
        self.background = BackgroundRuns(config.response_store.background)
        self.conversations = ConversationStore(config.response_store)
        self.inference = Inference(self)
        self.files = FileStore(config.files)
        self.batches = Batches(self.files, self.inference, config.batches)

    def request_state(self, operation: str, rid: str) -> _RequestState:
        return _RequestState(self, operation, rid)

    # -- parsing and tokenization (in Offload's threads) --------------------------------------------------------

    async def parse(self, model, raw: bytes):
        """parse_request; a large body in the heavy lane (pydantic takes about a second for 4 MiB of messages)."""
        if Offload.is_light(len(raw)):
            return parse_request(model, raw)
        return await self.offload.run(False, lambda cancelled: parse_request(model, raw))

    @lru_cache(maxsize=65536)
    def token_text(self, token_id: int) -> str:
        return self.config.tokenizer.decode([token_id], skip_special_tokens=False)

    def _check_ids(self, ids: list[int], param: str) -> list[int]:
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise invalid(f"token id {bad} is out of range: the vocabulary has {self.vocab_size} tokens",
                          param=param, code="invalid_value")
        return ids

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            prompts = [p]
        elif not p:
            raise invalid("prompt must not be empty", param="prompt", code="invalid_value")
        else:
            prompts = p
        out = []
        for item in prompts:
            if isinstance(item, str):
                ids = self.config.tokenizer.encode(item, add_special_tokens=True).ids
            elif isinstance(item, int):  # a single list of token ids
                out = [self._check_ids(list(prompts), "prompt")]
                break
            else:
                ids = self._check_ids(list(item), "prompt")
            out.append(ids)
        if any(not ids for ids in out):
            raise invalid("prompt must not be empty (it encodes to no tokens)", param="prompt",
                          code="invalid_value")
        return out

    def echo_texts(self, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """The prompts as echo repeats them: a text prompt as sent, a token-id prompt decoded."""
        p = req.prompt
        if isinstance(p, str):
            return [p]
        return [item if isinstance(item, str) else
                self.config.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)
                for item, ids in zip(p if p and not isinstance(p[0], int) else [p], prompts)]

    def chat_template(self) -> ChatTemplate:
        ct = self.config.chat_template
        if ct is None:
            raise invalid(f"the chat endpoint is not available: {self.config.no_chat_template_reason}; use "
                          "/v1/completions or start the gateway with --chat-template", param="messages",
                          code="chat_template_missing")
        return ct

    @cached_property
    def tool_format(self) -> ToolFormat:
        return ToolFormat.of(self.config.tokenizer, self.chat_template().source)

    @cached_property
    def reasoning_format(self) -> ReasoningFormat:
        return ReasoningFormat.of(self.config.tokenizer, self.chat_template().source)

    def chat_prompt(self, req: ChatCompletionRequest, raw_messages: list[dict], plan: ToolPlan | None,
                    cancelled: threading.Event | None = None, param: str = "messages") -> list[int]:
        ct = self.chat_template()
        messages, tools = template_messages(req, raw_messages, self.tool_format.markers is not None, plan)
        try:
            ids = ct.encode(messages, RenderBudget(self.config.limits.max_rendered_chars, cancelled),
                            add_generation_prompt=req.add_generation_prompt,
                            continue_final_message=req.continue_final_message, tools=tools,
                            **template_kwargs(req, self.reasoning_format))
        except RenderTooLarge as e:
            raise invalid(str(e), param=param, code="string_above_max_length") from None
        except ChatTemplateError as e:
            raise invalid(str(e), param=param) from None
        if not ids:
            raise invalid("the messages render to an empty prompt", param=param, code="invalid_value")
        return ids

    def fitted_prompt(self, req: ChatCompletionRequest, messages: list[dict], plan: ToolPlan | None,
                      cancelled: threading.Event | None, param: str, truncate: bool) -> list[int]:
        """chat_prompt; with `truncate` (responses' truncation auto), of the messages without their oldest turns
        until the prompt and the token limit (else one token) fit the context."""
        ids = self.chat_prompt(req, messages, plan, cancelled, param)
        context = self.pool.known_context() if truncate else 0
        while context and len(ids) + (req.token_limit or 1) > context:
            messages = truncated(messages)
            if messages is None:
                break  # the newest turn alone does not fit: the context check answers 400
            ids = self.chat_prompt(req, messages, plan, cancelled, param)
        return ids

    async def constraint(self, req, body_bytes: int) -> pb.Constraint | None:
        """The request's structured-output constraint (checked). Compiling one takes about a millisecond, in the
        light lane for a light body; the first one builds the grammar tokenizer (seconds): in the heavy lane."""
        if not wants_constraint(req):
            return None
        light = self.grammars.ready and Offload.is_light(body_bytes)
        return await self.offload.run(light, lambda cancelled: request_constraint(req, self.grammars))

    # -- sampling ------------------------------------------------------------------------------------------------

    def effective(self, req, name: str, api_default):
        """A sampling field as it runs: the request's, else the model's recommended default
        (splitgemma/serving/generation_config.py), else the API's."""
        value = getattr(req, name)
        if value is None:
            value = getattr(self.config.sampling_defaults, name)
        return api_default if value is None else value

    def sampling(self, req, index: int, logprobs: bool, top_logprobs: int,
                 constraint: pb.Constraint | None = None) -> pb.SamplingParams:
        # With a seed, choice j samples with seed + j so that n choices differ but stay reproducible.
        seed = (req.seed + index) % (1 << 64) if req.seed is not None else secrets.randbits(64)
        temperature = self.effective(req, "temperature", 1.0)
        return pb.SamplingParams(temperature=temperature if temperature >= MIN_TEMPERATURE else 0.0,
                                 top_k=max(0, self.effective(req, "top_k", 0)),
                                 top_p=max(self.effective(req, "top_p", 1.0), MIN_TOP_P),
                                 seed=seed, logprobs=logprobs, top_logprobs=top_logprobs, constraint=constraint,
                                 logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()},
                                 presence_penalty=req.presence_penalty or 0.0,
                                 frequency_penalty=req.frequency_penalty or 0.0,
                                 repetition_penalty=self.effective(req, "repetition_penalty", 0.0),
                                 min_p=self.effective(req, "min_p", 0.0), min_tokens=req.min_tokens)

    def specs(self, req, prompts: list[list[int]], max_tokens: int | None, logprobs: bool, top_logprobs: int,
              param: str, constraint: pb.Constraint | None = None,
              default_max_tokens: int | None = None, per_prompt: int | None = None,
              prompt_logprobs: int | None = None, priority: int | None = None) -> list[ChoiceSpec]:
        """The choices to run: per prompt `per_prompt` (best_of's candidates) or n; prompt_logprobs asked of the
        first choice of each prompt; `priority` (a batch's) in the queues instead of the request's (or its service
        tier's: flex is the lowest)."""
        per_prompt = per_prompt or req.n
        if len(prompts) * per_prompt > MAX_CHOICES:
            what = "n" if per_prompt == req.n else "best_of"
            raise invalid(f"{len(prompts)} prompts × {what}={per_prompt} is more than {MAX_CHOICES} choices per "
                          "request", param=what, code="invalid_value")
        if req.priority and self.config.scheduling_policy != "priority":
            raise invalid("priority is only taken under the gateway's --scheduling-policy priority; this one "
                          "serves first come, first served", param="priority", code="invalid_value")
        if priority is None:
            priority = LOWEST_PRIORITY if req.tier == "flex" else req.priority
        stop_token_ids = self._check_ids(list(req.stop_token_ids or []), "stop_token_ids")
        self._check_ids([int(k) for k in req.logit_bias or {}], "logit_bias")
        if max_tokens is not None and req.min_tokens > max_tokens:
            raise invalid(f"min_tokens ({req.min_tokens}) is more than max_tokens ({max_tokens})",
                          param="min_tokens", code="invalid_value")
        out = []
        for p_index, ids in enumerate(prompts):
            for j in range(per_prompt):
                index = p_index * per_prompt + j
                out.append(ChoiceSpec(index=index, prompt_ids=ids, max_tokens=max_tokens,
                                      sampling=self.sampling(req, index, logprobs, top_logprobs, constraint),
                                      stop=req.stop_list, stop_token_ids=stop_token_ids,
                                      ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
                                      include_stop_str_in_output=req.include_stop_str_in_output,
                                      prompt_param=param, default_max_tokens=default_max_tokens,
                                      prompt_logprobs=prompt_logprobs if j == 0 else None, priority=priority))
        return out

    # -- the request flow ----------------------------------------------------------------------------------------

    async def chat(self, rid: str, req: ChatCompletionRequest, messages: list[dict], body_bytes: int,
                   make_render: Callable[[ToolPlan | None, ReasoningPlan | None, int], ChoiceRenderer],
                   **options) -> Response:
        """A chat request from its validated form to its answer (chat completions, the Responses and Messages
        APIs): prepare_chat, then the choices run."""
        state, specs, render = await self.prepare_chat(rid, req, messages, body_bytes, make_render, **options)
        return await self.run(state, req, specs, render)

    async def prepare_chat(self, rid: str, req: ChatCompletionRequest, messages: list[dict], body_bytes: int,
                           make_render: Callable[[ToolPlan | None, ReasoningPlan | None, int], ChoiceRenderer], *,
                           prompt_param: str = "messages", effort_param: str = "reasoning_effort",
                           truncate: bool = False, fit_context: bool = False, priority: int | None = None) \
            -> tuple[_RequestState, list[ChoiceSpec], ChoiceRenderer]:
        """What run() takes for a chat request: the tools and the reading of the thought planned, the prompt rendered
        (with `truncate`, the oldest turns dropped until it fits the context: responses truncation auto), the
        constraint compiled (after the thought, when the request thinks), the choices' specs, and
        make_render(tools, reasoning, n_choices)'s renderer. `fit_context`: the context may end the answer before its
        token limit (ChoiceSpec.fit_context); `priority`: as specs()."""
        check_messages(messages, self.config.limits, prompt_param)
        state = _RequestState(self, "chat", rid)
        plan = plan_tools(req, self.tool_format)
        reasoning = plan_reasoning(req, self.reasoning_format, plan is not None and plan.native, effort_param)

        def prompt(cancelled):
            ids = self.fitted_prompt(req, messages, plan, cancelled, prompt_param, truncate)
            # The tools' grammar is built here too: its cost grows with the tools' schemas; and a prediction's ids.
            predicted = self.config.tokenizer.encode(req.prediction.text, add_special_tokens=False).ids \
                if req.prediction is not None else []
            context = self.pool.known_context()
            if context and len(predicted) > context:
                raise invalid(f"the prediction is {len(predicted)} tokens, more than the model's context ({context}) "
                              "could ever repeat", param="prediction", code="invalid_value")
            return ids, plan.constraint() if plan else None, predicted

        ids, tool_constraint, predicted = await self.offload.run(Offload.is_light(body_bytes, len(messages)), prompt)
        constraint = await self.constraint(req, body_bytes)
        if reasoning is not None:
            constraint, tool_constraint = reasoning.constrain(constraint), reasoning.constrain(tool_constraint)
        specs = self.specs(req, [ids], req.token_limit, req.logprobs, req.top_logprobs or 0, prompt_param,
                           constraint, default_max_tokens=self.config.default_max_tokens,
                           prompt_logprobs=req.prompt_logprobs, priority=priority)
        for spec in specs:
            spec.fit_context = fit_context
        if plan is not None:
            plan.apply(specs, tool_constraint)
        if reasoning is not None:
            reasoning.apply(specs)
        render = make_render(plan, reasoning, len(specs))
        if predicted:
            for spec in specs:
                spec.prediction_ids = predicted
            render.prediction = predicted
        return state, specs, render

    async def run(self, state: _RequestState, req, specs: list[ChoiceSpec],
                  render: ChoiceRenderer) -> Response:
        """Admit, prefill, then answer: a JSON body, or an SSE stream."""
        cfg = self.config
        state.span = telemetry.start_gen_ai_span(
            self.tracer, state.operation, cfg.model_name, max_tokens=specs[0].max_tokens,
            temperature=specs[0].sampling.temperature, top_p=specs[0].sampling.top_p,
            top_k=specs[0].sampling.top_k or None, seed=req.seed, choice_count=len(specs),
            stop_sequences=req.stop_list, stream=req.stream)
        render.input_tokens = sum(len(ids) for ids in {id(s.prompt_ids): s.prompt_ids for s in specs}.values())
        render.service_tier = req.tier
        runs: list[Run] = []
        queued = time.perf_counter()
        self.metrics.waiting.inc()
        try:
            with trace.use_span(state.span, end_on_exit=False, record_exception=False,
                                set_status_on_exception=False):
                runs = await self.pipelines.admit(state.request_id, specs, state.operation)
                self.metrics.queue_time.observe(time.perf_counter() - queued)
                self.metrics.waiting.dec()
                self.metrics.in_flight.inc()
                await self.pipelines.prefill_all(runs)
        except BaseException as e:
            if not runs:
                self.metrics.waiting.dec()
            else:
                self.metrics.in_flight.dec()
                self.pipelines.release_all(runs)
            state.finish(_error_type(e), response_id=render.id)
            raise
        self.metrics.prompt_tokens.inc(render.input_tokens)
        render.cached_tokens = _cached_tokens(runs)
        render.take_prompt_logprobs(runs)
        scored = [r for r in runs if r.spec.max_tokens == 0]  # echo with max_tokens 0: the prompt only
        for r in scored:
            self.pipelines.release(r)
            render.finish[r.spec.index] = "length"
        if scored:
            runs = [r for r in runs if r.spec.max_tokens != 0]
        self.metrics.cached_prompt_tokens.inc(render.cached_tokens)
        if req.stream:
            close = self._stream_closer(state, runs, render)
            return _SseResponse(self._stream(state, runs, render, close), on_close=lambda: close("cancelled"),
                                media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Request-Id": state.request_id})
        try:
            async for index, event in self._events(state, runs):
                render.add(index, event)
        except BaseException as e:
            # Choices whose Generate never opened still hold their lease.
            self.pipelines.release_all(runs)
            state.finish(_error_type(e), response_id=render.id)
            raise
        finally:
            self.metrics.in_flight.dec()
        await self._count_prediction(render)
        body = render.body()  # first: reading tool calls settles the finish reasons
        state.finish(response_id=render.id, finish_reasons=render.finish_reasons(),
                     input_tokens=render.input_tokens)
        return JSONResponse(body, headers={"X-Request-Id": state.request_id})

    async def _events(self, state: _RequestState, runs: list[Run]) -> AsyncIterator[tuple[int, pb.GenerateEvent]]:
        """The events of every choice as they come (index, event); an error in one choice ends all."""
        if len(runs) == 1:
            async for event in self._generate(state, runs[0]):
                yield runs[0].spec.index, event
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(run: Run):
            try:
                async for event in self._generate(state, run):
                    await queue.put((run.spec.index, event))
                await queue.put((run.spec.index, done))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises
                await queue.put((run.spec.index, e))

        tasks = [asyncio.create_task(pump(r)) for r in runs]
        try:
            remaining = len(runs)
            while remaining:
                index, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _generate(self, state: _RequestState, run: Run):
        with trace.use_span(state.span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
            events = self.pipelines.generate(run)
            # The first read opens the call: do it with the gen_ai span current so the worker joins the trace.
            first = await events.__anext__()
        try:
            state.on_event(first)
            yield first
            async for event in events:
                state.on_event(event)
                yield event
        finally:
            await events.aclose()

    async def _stream(self, state: _RequestState, runs: list[Run], render: ChoiceRenderer,
                      close: Callable[[str | None], None]) -> AsyncIterator[str]:
        error_type = "cancelled"
        try:
            for frame in render.sse_start():
                yield frame
            async for index, event in self._events(state, runs):
                for frame in render.sse_event(index, event):
                    yield frame
            await self._count_prediction(render)
            for frame in render.sse_end():
                yield frame
            error_type = None
        except ApiError as e:
            error_type = str(e.status)
            log.warning("stream failed", extra={"request_id": state.request_id, "error": e.message})
            for frame in render.sse_error(e):
                yield frame
        except BaseException as e:
            error_type = _error_type(e)
            raise
        finally:
            close(error_type)

    @staticmethod
    async def _count_prediction(render: ChoiceRenderer) -> None:
        """usage's prediction counts: quadratic in the tokens, so in a thread (not a prompt lane: the answer is
        done, and a full lane must not turn it into a 503)."""
        if render.prediction is not None:
            await asyncio.to_thread(render.count_prediction)

    def _stream_closer(self, state: _RequestState, runs: list[Run], render: ChoiceRenderer):
        """The end of a streamed request, run once: from the stream's own end, or from the response when the
        stream never started (the client left before the first byte)."""
        closed = False

        def close(error_type: str | None) -> None:
            nonlocal closed
            if closed:
                return
            closed = True
            self.metrics.in_flight.dec()
            self.pipelines.release_all(runs)
            state.finish(error_type, response_id=render.id,
                         finish_reasons=None if error_type else render.finish_reasons(),
                         input_tokens=render.input_tokens)

        return close


def _cached_tokens(runs: list[Run]) -> int:
    """usage.prompt_tokens_details.cached_tokens: per distinct prompt (counted once, as prompt_tokens is), the
    tokens every one of its choices had from the prefix cache (choices of one prompt may hit each other's blocks)."""
    per_prompt: dict[int, int] = {}
    for r in runs:
        key = id(r.spec.prompt_ids)
        per_prompt[key] = min(per_prompt.get(key, r.prefill_result.cached_tokens), r.prefill_result.cached_tokens)
    return sum(per_prompt.values())


def _error_type(e: BaseException) -> str:
    if isinstance(e, ApiError):
        return str(e.status)
    if isinstance(e, asyncio.CancelledError):
        return "cancelled"
    return type(e).__qualname__


# ---------------------------------------------------------------------------------------------------------------
# ASGI plumbing


class _SseResponse(StreamingResponse):
    """A streaming response that always watches for the client going away (whatever ASGI spec version the server
    reports) and then cancels the stream, which cancels the gRPC calls feeding it."""

    def __init__(self, content, *, on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream():
                    await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                log.info("client went away mid-stream")
                tg.cancel_scope.cancel()
        finally:
            self.on_close()


async def _until_disconnect(request: Request, work: Callable[[], object]):
    """Run work() (a coroutine function) and cancel it if the client disconnects first (vLLM #11190)."""
    task = asyncio.ensure_future(work())

    async def wait_disconnect():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        log.info("client went away; request cancelled")
        return Response(status_code=499)  # nobody is listening; for the access log and metrics only
    return task.result()


_TRACED = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/responses/input_tokens", "/v1/messages",
           "/v1/messages/count_tokens", "/v1/messages/batches", "/v1/conversations", "/v1/files", "/v1/batches", "/v1/models", "/tokenize",
           "/detokenize"}


def _route(path: str) -> str | None:
    """The traced endpoint a path is (ids replaced by their parameter's name), or None for one not traced."""
    if path in _TRACED:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    if path.startswith("/v1/responses/"):
        tail = path.rsplit("/", 1)[1]
        return "/v1/responses/{response_id}" + (f"/{tail}" if path.count("/") > 3 and tail in (
            "input_items", "cancel") else "")
    if path.startswith("/v1/conversations/"):
        parts = path.split("/")[3:]  # [id], [id, "items"], [id, "items", item id]
        items = len(parts) > 1 and parts[1] == "items"
        return "/v1/conversations/{conversation_id}" + (
            ("/items/{item_id}" if len(parts) > 2 else "/items") if items else "")
    if path.startswith("/v1/files/"):
        return "/v1/files/{file_id}" + ("/content" if path.endswith("/content") else "")
    if path.startswith("/v1/batches/"):
        return "/v1/batches/{batch_id}" + ("/cancel" if path.endswith("/cancel") else "")
    if path.startswith("/v1/messages/batches/"):
        tail = path.rsplit("/", 1)[1]
        return "/v1/messages/batches/{message_batch_id}" + (f"/{tail}" if path.count("/") > 4 and tail in (
            "cancel", "results") else "")
    return None


class _ObserveMiddleware:
    """SERVER span and request counter per API call (health, readiness and metrics probes are not traced)."""

    def __init__(self, app, gateway: Gateway):
        self.app = app
        self.gw = gateway

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = _route(path)
        if endpoint is None:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        ctx = propagate.extract(headers)
        status = {"code": 500}

        async def send_observed(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        method = scope["method"]
        with self.gw.tracer.start_as_current_span(
                f"{method} {endpoint}", context=ctx, kind=SpanKind.SERVER,
                attributes={"http.request.method": method, "url.path": path, "http.route": endpoint,
                            "url.scheme": scope.get("scheme", "http")},
                record_exception=False, set_status_on_exception=False) as span:
            try:
                await self.app(scope, receive, send_observed)
            finally:
                span.set_attribute("http.response.status_code", status["code"])
                if status["code"] >= 500:
                    span.set_status(Status(StatusCode.ERROR))
                self.gw.metrics.requests.labels(endpoint=endpoint, status=str(status["code"])).inc()


def _request_id(request: Request, prefix: str = "", client_ids: bool = True) -> str:
    """The request's one id: the body's "id", its X-Request-Id answer, the request_id of its log records, and the
    gen_ai.response.id of its spans in every process. The client's X-Request-Id if it sent a usable one (as vLLM
    takes it) and `client_ids`, else prefix + a random hex (OpenAI's shape: chatcmpl-…, cmpl-…, resp_…). Kept in
    request.state so that an unexpected error is logged under the same id."""
    rid = getattr(request.state, "request_id", None)
    if rid is None:
        given = request.headers.get("x-request-id", "")
        usable = client_ids and given and len(given) <= 128 and given.isprintable()
        rid = given if usable else prefix + uuid.uuid4().hex
        request.state.request_id = rid
    return rid


def create_app(config: GatewayConfig) -> FastAPI:
    gw = Gateway(config)

    async def lifespan(app):
        await gw.pool.start()
        gw.batches.start()
        try:
            yield
        finally:
            await gw.batches.close()
            await gw.background.close()
            await gw.pipelines.drain()
            await gw.pool.close()
            gw.offload.close()
            gw.files.close()
            telemetry.setup_telemetry("splitgemma-gateway").shutdown()

    extra = {}
    if "telemetry" in inspect.signature(FastAPI).parameters:
        # FastAPI >= 0.165 traces requests itself: a second SERVER span beside ours, and operation spans that end
        # when a streaming handler returns while its gen_ai span goes on. The gateway's own spans are the ones
        # above (same HTTP conventions, on every FastAPI version).
        extra["telemetry"] = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}
    app = FastAPI(title="splitgemma gateway", version=__version__, lifespan=lifespan, docs_url="/docs",
                  redoc_url=None, openapi_url="/openapi.json", **extra)
    app.state.gateway = gw
    # Inside the observer: refused requests are counted and traced like any other.
    app.add_middleware(ApiKeyMiddleware, keys=config.api_keys, metrics_auth=config.metrics_auth)
    app.add_middleware(_ObserveMiddleware, gateway=gw)

    def error_response(request: Request, e: ApiError, headers: dict | None = None) -> JSONResponse:
        """OpenAI's envelope, or Anthropic's under /v1/messages."""
        body = error_body(e, getattr(request.state, "request_id", None)) if is_messages_path(request.url.path) \
            else e.body()
        return JSONResponse(body, status_code=e.status, headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return error_response(request, e, e.headers())

    @app.exception_handler(ClientGoneError)
    async def client_gone(request: Request, e: ClientGoneError):
        return Response(status_code=499)  # nobody is listening; for the metrics only

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(e.status_code, e.detail)
        err = ApiError(e.status_code, str(message), code="not_found" if e.status_code == 404 else None)
        return error_response(request, err)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        # The exception's text can hold server paths and internals: it goes to the log, under the request id the
        # client is given to quote, never into the body.
        rid = _request_id(request)
        log.exception("unexpected error", extra={"request_id": rid})
        err = ApiError(500, f"internal server error (request id {rid})")
        return error_response(request, err, {"X-Request-Id": rid})

    inference = gw.inference

    @app.post("/v1/completions")
    async def completions(request: Request):
        raw = await read_body(request, config.max_body_bytes, config.limits.body_timeout)
        rid = _request_id(request, "cmpl-")
        return await _until_disconnect(request, lambda: inference.completions(raw, rid))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        raw = await read_body(request, config.max_body_bytes, config.limits.body_timeout)
        rid = _request_id(request, "chatcmpl-")
        return await _until_disconnect(request, lambda: inference.chat_completions(raw, rid))

    @app.post("/v1/responses")
    async def responses(request: Request):
        raw = await read_body(request, config.max_body_bytes, config.limits.body_timeout)
        # Always the server's own id: it names a stored response, so it must be unique and unguessable.
        rid = _request_id(request, "resp_", client_ids=False)
        owner = request_owner(request, bool(config.api_keys))
        return await _until_disconnect(request, lambda: inference.responses(raw, rid, owner))

    @app.post("/v1/responses/input_tokens")
    async def responses_input_tokens(request: Request):
        raw = await read_body(request, config.max_body_bytes, config.limits.body_timeout)
        owner = request_owner(request, bool(config.api_keys))
        return await _until_disconnect(request, lambda: inference.responses_input_tokens(raw, owner))

    @app.post("/v1/messages")
    async def messages(request: Request):
        raw = await read_body(request, config.max_body_bytes, config.limits.body_timeout)
        rid = _request_id(request, "msg_", client_ids=False)  # Anthropic's id shape; the request's own id
        return await _until_disconnect(request, lambda: inference.messages(raw, rid))

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request):
        raw = await read_body(request, config.max_body_bytes, config.limits.body_timeout)
        return await _until_disconnect(request, lambda: inference.messages_count_tokens(raw))

    add_store_endpoints(app, gw.response_store, gw.background, bool(config.api_keys))
    add_conversation_endpoints(app, gw.conversations, bool(config.api_keys), config.max_body_bytes,
                               config.limits.body_timeout)
    add_file_endpoints(app, gw.files, bool(config.api_keys), config.limits.body_timeout)
    add_batch_endpoints(app, gw.batches, bool(config.api_keys), config.max_body_bytes, config.limits.body_timeout)
    add_message_batch_endpoints(app, gw.batches, bool(config.api_keys), config.max_body_bytes,
                                config.limits.body_timeout)
    add_endpoints(app, gw, inference.check_model)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        body = {"status": "ready" if gw.pool.ready else "not ready", "workers": gw.pool.describe()}
        return JSONResponse(body, status_code=200 if gw.pool.ready else 503)

    @app.get("/metrics")
    async def metrics():
        for w in gw.pool.prefill + gw.pool.decode:
            gw.metrics.worker_up.labels(kind=w.kind, worker=w.address).set(1 if w.healthy else 0)
        gw.metrics.take_kv_usage(gw.pool.decode)
        for kind, store in (("responses", gw.response_store), ("conversations", gw.conversations),
                            ("background_responses", gw.background), ("files", gw.files), ("batches", gw.batches)):
            gw.metrics.kept.labels(kind=kind).set(len(store))
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
