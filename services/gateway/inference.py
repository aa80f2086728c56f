"""The inference endpoints from a request's body to its answer: what their routes run (app.py, which adds the
request id, the caller's key and the client's disconnect) and what a batch runs for each request of its input file
(batches.py) — the same code either way, so a batch's answers are the endpoints' own, byte for byte in shape.

Each method takes the raw body and returns a Response (a JSON body, or an SSE stream when the request streams) or
raises ApiError. `priority`, when given, is the request's place in the workers' queues whatever its body says (a
batch's requests run behind every interactive one); the body's own priority is still checked as the endpoint checks
it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse, Response, StreamingResponse

from .limits import check_messages
from .messages import CountTokensRequest, MessagesRenderer, MessagesRequest
from .messages import chat_request as messages_chat_request
from .offload import Offload
from .pipeline import check_context
from .protocol import ApiError, ChatCompletionRequest, CompletionRequest, invalid
from .reasoning import ReasoningPlan, thinking
from .render import ChoiceRenderer
from .responses import InputTokensRequest, ResponsesRenderer, ResponsesRequest, chat_request, conversation_before, \
    input_items
from .tools import ToolPlan, plan_tools

if TYPE_CHECKING:
    from .app import Gateway

COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's legacy completions endpoint generates 16 tokens unless told otherwise


class Inference:
    def __init__(self, gw: "Gateway"):
        self.gw = gw

    def check_model(self, name: str) -> None:
        served = self.gw.config.model_name
        if name != served:
            raise ApiError(404, f"The model '{name}' does not exist; this server serves '{served}'",
                           param="model", code="model_not_found")

    async def completions(self, raw: bytes, rid: str, priority: int | None = None) -> Response:
        gw = self.gw
        req, _ = await gw.parse(CompletionRequest, raw)
        self.check_model(req.model)
        state = gw.request_state("text_completion", rid)
        prompts = await gw.offload.run(Offload.is_light(len(raw)), lambda cancelled: gw.completion_prompts(req))
        constraint = await gw.constraint(req, len(raw))
        max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        top = req.logprobs or 0
        per_prompt = req.best_of or req.n
        # echo's logprobs come from the prompt's: the top n of either
        scored = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            scored = max(scored or 0, top)
        # best_of ranks by the tokens' logprobs, so the workers report them even if the client did not ask
        specs = gw.specs(req, prompts, max_tokens, req.logprobs is not None or per_prompt > req.n, top, "prompt",
                         constraint, per_prompt=per_prompt, prompt_logprobs=scored, priority=priority)
        render = ChoiceRenderer(gw, False, len(specs), rid, logprobs=req.logprobs is not None, top_logprobs=top,
                                include_usage=bool(req.stream_options and req.stream_options.include_usage))
        render.prompt_side(echo_texts=gw.echo_texts(req, prompts) if req.echo else None,
                           vllm_prompt_logprobs=req.prompt_logprobs is not None, per_prompt=per_prompt, n=req.n)
        return await gw.run(state, req, specs, render)

    async def chat_completions(self, raw: bytes, rid: str, priority: int | None = None) -> Response:
        gw = self.gw
        req, data = await gw.parse(ChatCompletionRequest, raw)
        self.check_model(req.model)

        def render(plan: ToolPlan | None, reasoning: ReasoningPlan | None, n_choices: int) -> ChoiceRenderer:
            out = ChoiceRenderer(gw, True, n_choices, rid, logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0,
                                 include_usage=bool(req.stream_options and req.stream_options.include_usage),
                                 tools=plan, reasoning=reasoning)
            out.prompt_side(vllm_prompt_logprobs=req.prompt_logprobs is not None, per_prompt=req.n, n=req.n)
            return out

        return await gw.chat(rid, req, data["messages"], len(raw), render, priority=priority)

    async def _responses_request(self, raw: bytes, owner: str, model: type[ResponsesRequest]):
        """(the validated request, the conversation it continues — previous_response_id's or its conversation's
        items —, the bytes of body and conversation) of a /v1/responses or /v1/responses/input_tokens call."""
        gw = self.gw
        req, _ = await gw.parse(model, raw)
        if req.model is not None:  # required on create (validated), optional when counting
            self.check_model(req.model)
        if req.conversation_id is None:
            before, before_bytes = conversation_before(gw.response_store, gw.background, req, owner)
        else:
            found = gw.conversations.items(req.conversation_id, owner)
            if found is None:
                raise ApiError(404, f"Conversation with id '{req.conversation_id}' not found.", param="conversation",
                               code="not_found")
            before, before_bytes = found
        return req, before, len(raw) + before_bytes

    async def responses(self, raw: bytes, rid: str, owner: str, priority: int | None = None) -> Response:
        gw = self.gw
        req, before, size = await self._responses_request(raw, owner, ResponsesRequest)

        def translate(cancelled):
            items = input_items(req.input)
            return items, *chat_request(req, before + items)

        items, chat, messages = await gw.offload.run(Offload.is_light(size, len(before)), translate)
        options = dict(prompt_param="input", effort_param="reasoning.effort", truncate=req.truncation == "auto",
                       priority=priority)

        def render(plan, reasoning, _):
            return ResponsesRenderer(gw, rid, req, plan, reasoning, store=gw.response_store, owner=owner,
                                     input_items=items, conversations=gw.conversations)

        if not req.background:
            return await gw.chat(rid, chat, messages, size, render, **options)
        if not gw.response_store.enabled:
            raise invalid("background responses need the response store, which this gateway has off "
                          "(--response-store-entries 0)", param="background", code="invalid_value")
        gw.background.check_room()
        # Checked and rendered now (a bad request is a 400 at once); run as a stream whatever the client asked.
        chat = chat.model_copy(update={"stream": True})
        state, specs, render = await gw.prepare_chat(rid, chat, messages, size, render, **options)
        for spec in specs:
            check_context(spec, gw.pool.known_context())

        async def events():
            return (await gw.run(state, chat, specs, render)).body_iterator

        run = gw.background.start(owner, render, events)
        if req.stream:  # the client may leave this stream: the response goes on
            return StreamingResponse(run.follow(None), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        return JSONResponse(run.snapshot(), headers={"X-Request-Id": rid})

    async def responses_input_tokens(self, raw: bytes, owner: str) -> dict:
        gw = self.gw
        req, before, size = await self._responses_request(raw, owner, InputTokensRequest)

        def count(cancelled):
            chat, messages = chat_request(req, before + input_items(req.input))
            check_messages(messages, gw.config.limits, "input")
            thinking(chat, gw.reasoning_format, "reasoning.effort")  # its refusal named as create names it
            plan = plan_tools(chat, gw.tool_format)
            return len(gw.fitted_prompt(chat, messages, plan, cancelled, "input", req.truncation == "auto"))

        n = await gw.offload.run(Offload.is_light(size, len(before)), count)
        return {"object": "response.input_tokens", "input_tokens": n}

    async def messages(self, raw: bytes, rid: str, priority: int | None = None) -> Response:
        gw = self.gw
        req, _ = await gw.parse(MessagesRequest, raw)
        self.check_model(req.model)
        chat, messages = await gw.offload.run(Offload.is_light(len(raw), len(req.messages)),
                                              lambda cancelled: self._messages_chat(req))
        return await gw.chat(rid, chat, messages, len(raw),
                             lambda plan, reasoning, _: MessagesRenderer(gw, rid, req, plan, reasoning),
                             effort_param="thinking", fit_context=True, priority=priority)

    async def messages_count_tokens(self, raw: bytes) -> dict:
        gw = self.gw
        req, _ = await gw.parse(CountTokensRequest, raw)
        self.check_model(req.model)

        def count(cancelled):
            chat, messages = self._messages_chat(req)
            check_messages(messages, gw.config.limits, "messages")
            thinking(chat, gw.reasoning_format, "thinking")
            return len(gw.chat_prompt(chat, messages, plan_tools(chat, gw.tool_format), cancelled))

        return {"input_tokens": await gw.offload.run(Offload.is_light(len(raw), len(req.messages)), count)}

    def _messages_chat(self, req: MessagesRequest) -> tuple[ChatCompletionRequest, list[dict]]:
        """The chat request a Messages request means; thinking asked of a model that cannot think is refused here,
        under Anthropic's name for it."""
        can_think = self.gw.reasoning_format.can_think
        if req.thinks and not can_think:
            raise ApiError(400, "thinking: this model does not think (its chat template has no thinking mode); "
                           "leave thinking out or disable it", param="thinking", code="unsupported_parameter")
        return messages_chat_request(req, effort_if_adaptive=can_think)
