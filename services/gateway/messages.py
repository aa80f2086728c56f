"""Anthropic's Messages API over the chat pipeline (docs/messages.md).

  POST /v1/messages                 create (stream: Anthropic's SSE events, `event: message_start` …)
  POST /v1/messages/count_tokens    {"input_tokens": n}: the prompt a create request would have

For clients that speak Anthropic's API (its SDKs, and tools built on them): a request becomes the chat request it
means (`chat_request`) and runs exactly as chat does — same template, tool syntax, grammars, thinking and workers.
`system` is a system message first (text blocks joined by a blank line); each message's text blocks are its content
parts; an assistant's `tool_use` blocks its calls (the input as JSON arguments) and its `thinking` blocks its
reasoning_content; a user's `tool_result` blocks become tool messages (before the user's text, as the results
answer the calls before them), naming the call's tool. A last message from the assistant is continued (Anthropic's
prefill: chat's continue_final_message), and the answer holds only the continuation. `max_tokens` is the token
limit; `stop_sequences` the stop strings; `tools` (client tools: name, description, input_schema) and `tool_choice`
(auto, any = required, tool = named, none; `disable_parallel_tool_use`) chat's; `thinking` enabled or adaptive turns
the model's thinking on (adaptive: if the model can think), `output_config.format` (json_schema) is the
response_format.

The answer is a message: thinking block (the thought; signature empty: nothing here verifies one), text block,
tool_use blocks; `stop_reason` end_turn, max_tokens, stop_sequence (with `stop_sequence`, the string matched),
tool_use, or model_context_window_exceeded; usage in Anthropic's terms (input_tokens the prompt's tokens not read
from the prefix cache, cache_read_input_tokens those that were). Errors come in Anthropic's envelope
(`error_body`), on every path under /v1/messages.

What this server does not do is refused with a 400 naming the parameter: server tools (web search, code execution,
…), MCP servers, containers, context management, images, documents and other non-text blocks. Accepted with no
effect, because the server has nothing they would change: cache_control (the prefix cache needs no breakpoints),
service_tier, metadata.user_id (the request's user), inference_geo and `output_config.effort` (the model has one
effort). `thinking.budget_tokens` bounds the thought (chat's thinking_token_budget: at most that many tokens, then it
is closed).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import Field, ValidationError, model_validator

from splitgemma.v1 import serving_pb2 as pb

from .protocol import (MAX_STOP, MAX_STOP_CHARS, MAX_TOKENS_LIMIT, MAX_TOOLS, ApiError, ChatCompletionRequest,
                       FunctionDefinition, _Strict, _Unsupported, _validation_error, check_tools)
from .reasoning import ReasoningPlan
from .render import ChoiceRenderer, sse
from .tools import ToolPlan, tool_message

if TYPE_CHECKING:
    from .app import Gateway

PATH = "/v1/messages"
MAX_ID = 256                 # characters of a tool_use id a client may send back
MIN_THINKING_BUDGET = 1024   # Anthropic's floor for thinking.budget_tokens

# Anthropic's error types by status (its own statuses; 503 is what this server answers when it is overloaded); any
# other client error is an invalid_request_error, any other server error an api_error.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 504: "timeout_error"}


def is_messages_path(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def error_body(e: ApiError, request_id: str | None = None) -> dict:
    """An ApiError in Anthropic's envelope; its message names the parameter (there is no `param` field)."""
    message = e.message
    if e.param and e.param not in message:
        message = f"{e.param}: {message}"
    kind = ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    body = {"type": "error", "error": {"type": kind, "message": message}}
    if request_id is not None:
        body["request_id"] = request_id
    return body


# ---------------------------------------------------------------------------------------------------------------
# The request

# Anthropic's parameters for what this server does not do: the values that ask for nothing, and why anything else
# is refused.
REFUSED = {
    "container": ((None,), "it runs no code execution containers"),
    "mcp_servers": ((None, []), "it connects to no MCP servers; declare the tools and run them yourself"),
    "context_management": ((None,), "it edits no context; send the conversation you want the model to see"),
    "speed": ((None, "standard"), "it has one speed"),
}
# Content block types a message may hold, by role; anything else is refused by name.
_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
_KNOWN_BLOCKS = frozenset(kind for kinds in _BLOCKS.values() for kind in kinds)


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1, max_length=MAX_ID)]
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1, max_length=MAX_ID)]
    content: str | list[TextBlock] | None = None
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None   # another server's, or this one's empty one: not verified


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str                       # another server's encrypted thought: it cannot be read here, and is left out


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
                  Field(discriminator="type")]


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Strict):
    """A client tool (the only kind here): chat's function definition under Anthropic's names."""
    type: Literal["custom"] | None = None
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None     # constrained decoding always holds a call to the schema
    cache_control: dict[str, Any] | None = None
    input_examples: list[dict[str, Any]] | None = None
    eager_input_streaming: bool | None = None   # the input is streamed as it is generated either way

    def function(self) -> FunctionDefinition:
        return FunctionDefinition(name=self.name, description=self.description, parameters=self.input_schema)


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self):
        if (self.type == "tool") != (self.name is not None):
            raise _Unsupported("tool_choice.name", "tool_choice of type tool needs the tool's name (and only it does)",
                               code="invalid_value")
        return self


class ThinkingConfig(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=MIN_THINKING_BUDGET, le=MAX_TOKENS_LIMIT)] | None = None
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget(self):
        if self.type == "enabled" and self.budget_tokens is None:
            raise _Unsupported("thinking.budget_tokens", "thinking of type enabled needs budget_tokens",
                               code="missing_required_parameter")
        return self


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Metadata(_Strict):
    user_id: Annotated[str, Field(max_length=256)] | None = None


class MessagesRequest(_Strict):
    model: str
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
                              Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    # Anthropic's ranges (its temperature tops out at 1)
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: dict[str, Any] | None = None
    inference_geo: str | None = None
    # present only to be refused unless they ask for nothing (REFUSED)
    container: Any = None
    mcp_servers: list[Any] | None = None
    context_management: Any = None
    speed: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _kinds(cls, data: Any):
        """Server tools and non-text blocks refused by name (pydantic's own message would list the kinds it knows)."""
        if not isinstance(data, dict):
            return data
        tools = data.get("tools")
        for i, t in enumerate(tools if isinstance(tools, list) else ()):
            kind = t.get("type") if isinstance(t, dict) else None
            if kind not in (None, "custom"):
                raise _Unsupported(f"tools[{i}].type", f"tools of type {str(kind)[:60]!r} are not supported: this "
                                   "server runs no server tools; declare client tools (name, input_schema) and run "
                                   "them yourself")
        messages = data.get("messages")
        for i, m in enumerate(messages if isinstance(messages, list) else ()):
            if not isinstance(m, dict) or not isinstance(m.get("content"), list):
                continue
            allowed = _BLOCKS.get(m.get("role"), ())
            for j, b in enumerate(m["content"]):
                kind = b.get("type") if isinstance(b, dict) else None
                if isinstance(kind, str) and allowed and kind not in allowed:
                    what = "text only: no images, documents or search results" if kind not in _KNOWN_BLOCKS \
                        else f"not in a {m['role']} message"
                    raise _Unsupported(f"messages[{i}].content[{j}].type",
                                       f"content blocks of type {kind[:60]!r} are not supported here ({what})")
        return data

    @model_validator(mode="after")
    def _checks(self):
        for name, (nothing, why) in REFUSED.items():
            if getattr(self, name) not in nothing:
                raise _Unsupported(name, f"{name} is not supported by this server: {why}")
        if self.thinking is not None and self.thinking.type == "enabled" \
                and self.thinking.budget_tokens >= self.max_tokens:
            raise _Unsupported("thinking.budget_tokens", f"thinking.budget_tokens ({self.thinking.budget_tokens}) "
                               f"must be less than max_tokens ({self.max_tokens})", code="invalid_value")
        choice = self.tool_choice
        check_tools([t.function() for t in self.tools or []], choice is not None and choice.type != "none",
                    choice.name if choice is not None else None, "tools[{}].input_schema")
        return self

    @property
    def thinks(self) -> bool | None:
        """True: thinking asked for; None: adaptive (on if the model can think); False: off."""
        if self.thinking is None or self.thinking.type == "disabled":
            return False
        return True if self.thinking.type == "enabled" else None


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a create request's prompt side (max_tokens has no part in it)."""
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] = MAX_TOKENS_LIMIT


# ---------------------------------------------------------------------------------------------------------------
# Messages as chat messages

def _joined(blocks: str | list[TextBlock] | None, sep: str) -> str:
    if blocks is None:
        return ""
    return blocks if isinstance(blocks, str) else sep.join(b.text for b in blocks)


def chat_messages(req: MessagesRequest) -> list[dict]:
    """The conversation as chat messages (consecutive messages of one role are one turn, as Anthropic combines
    them)."""
    out: list[dict] = [{"role": "system", "content": _joined(req.system, "\n\n")}] if req.system else []
    names: dict[str, str] = {}  # tool_use id -> tool name, for the results
    for m in req.messages:
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if m.role == "assistant":
            text = [{"type": "text", "text": b.text} for b in blocks if b.type == "text"]
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in blocks if b.type == "tool_use"]
            thought = "".join(b.thinking for b in blocks if b.type == "thinking")
            names.update((b.id, b.name) for b in blocks if b.type == "tool_use")
            if out and out[-1]["role"] == "assistant" and not out[-1].get("tool_calls"):
                prev = out.pop()  # one turn: the earlier message's parts first
                text = prev["content"] + text
                thought = prev.get("reasoning_content", "") + thought
            message: dict = {"role": "assistant", "content": text if text or not calls else None}
            if calls:
                message["tool_calls"] = calls
            if thought:
                message["reasoning_content"] = thought
            out.append(message)
            continue
        for b in blocks:
            if b.type == "tool_result":
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "name": names.get(b.tool_use_id, ""),
                            "content": _joined(b.content, "\n") or ("error" if b.is_error else "")})
        text = [{"type": "text", "text": b.text} for b in blocks if b.type == "text"]
        if text:
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += text
            else:
                out.append({"role": "user", "content": text})
    return out


def chat_request(req: MessagesRequest, *, effort_if_adaptive: bool) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat request `req` means, and its messages as the template receives them. `effort_if_adaptive`: whether
    adaptive thinking turns thinking on (the model can think)."""
    messages = chat_messages(req)
    prefill = req.messages[-1].role == "assistant"
    if prefill and not isinstance(messages[-1].get("content"), list):
        raise _invalid("a last assistant message is continued (prefill): it needs text, not only tool use",
                       "messages")
    thinks = req.thinks if req.thinks is not None else effort_if_adaptive
    effort = (req.output_config.effort if req.output_config and req.output_config.effort else "medium") \
        if thinks else None
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_completion_tokens": req.max_tokens, "stream": req.stream,
        "add_generation_prompt": not prefill, "continue_final_message": prefill, "reasoning_effort": effort,
        "include_reasoning": True}
    if thinks and req.thinking is not None and req.thinking.budget_tokens is not None:
        body["thinking_token_budget"] = req.thinking.budget_tokens
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    if req.metadata is not None and req.metadata.user_id is not None:
        body["user"] = req.metadata.user_id
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.function().model_dump(exclude_none=True)}
                         for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
        body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
    try:
        return ChatCompletionRequest.model_validate(body), messages
    except ValidationError as e:  # what the Messages model could not see (a chat rule on the translated request)
        raise _validation_error(e) from None


def _invalid(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


# ---------------------------------------------------------------------------------------------------------------
# The answer


class MessagesRenderer(ChoiceRenderer):
    """One request's message: the body, or its stream of events — message_start, ping, per content block
    content_block_start, its deltas (thinking_delta then signature_delta, text_delta, input_json_delta),
    content_block_stop; then message_delta (stop_reason, usage) and message_stop. A failure mid-stream sends an
    `error` event."""

    def __init__(self, gateway: "Gateway", request_id: str, req: MessagesRequest, plan: ToolPlan | None,
                 reasoning: ReasoningPlan | None):
        super().__init__(gateway, True, 1, request_id, logprobs=False, top_logprobs=0, include_usage=False,
                         tools=plan, reasoning=reasoning)
        self.req = req
        self.show_thought = req.thinking is None or req.thinking.display != "omitted"
        self.stop_string: str | None = None   # the stop sequence that ended the answer
        self.blocks = 0                       # content blocks streamed so far
        self.open: str | None = None          # the kind of the block being streamed

    def add(self, index: int, event: pb.GenerateEvent):
        out = super().add(index, event)
        if event.finish_reason == pb.FINISH_REASON_STOP and not event.HasField("stop_token_id") \
                and event.stop_reason in (self.req.stop_sequences or ()):
            self.stop_string = event.stop_reason
        return out

    def _stop_reason(self) -> str:
        finish = self.finish[0] or "stop"
        if finish == "tool_calls":
            return "tool_use"
        if finish == "length":
            return "max_tokens" if self.tokens[0] >= self.req.max_tokens else "model_context_window_exceeded"
        return "stop_sequence" if self.stop_string is not None else "end_turn"

    def usage(self, final: bool = True) -> dict:
        cached = self.cached_tokens
        out = {"input_tokens": self.input_tokens - cached, "cache_creation_input_tokens": 0,
               "cache_read_input_tokens": cached, "output_tokens": sum(self.tokens) if final else 0,
               "service_tier": "standard"}
        if final and self.splitters is not None:
            out["output_tokens_details"] = {"thinking_tokens": self.reasoning_tokens()}
        return out

    def _thinking_block(self, text: str) -> dict:
        return {"type": "thinking", "thinking": text if self.show_thought else "", "signature": ""}

    def _message(self, content: list[dict], stop_reason: str | None, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.gw.config.model_name,
                "content": content, "stop_reason": stop_reason,
                "stop_sequence": self.stop_string if stop_reason == "stop_sequence" else None, "usage": usage}

    # non-streaming
    def body(self) -> dict:
        text, finish = self.text[0], self.finish[0] or "stop"
        calls = []
        if self.tools is not None:
            message, self.finish[0] = tool_message(self.tools, text, finish)
            text, calls = message["content"] or "", message.get("tool_calls") or []
        content = [self._thinking_block(self.thought[0])] if self.has_thought(0) else []
        if text:
            content.append({"type": "text", "text": text})
        content += [{"type": "tool_use", "id": _tool_use_id(c["id"]), "name": c["function"]["name"],
                     "input": json.loads(c["function"]["arguments"] or "{}")} for c in calls]
        return self._message(content, self._stop_reason(), self.usage())

    # streaming
    @staticmethod
    def _event(kind: str, **fields) -> str:
        return sse({"type": kind, **fields}, event=kind)

    def sse_start(self) -> list[str]:
        return [self._event("message_start", message=self._message([], None, self.usage(final=False))),
                self._event("ping")]

    def sse_event(self, index: int, event: pb.GenerateEvent) -> list[str]:
        text, thought, _ = self.add(index, event)
        finish = self.finish[0] if event.finish_reason != pb.FINISH_REASON_UNSPECIFIED else None
        frames = self._delta("thinking", thought) if thought else []
        deltas = ([{"content": text}] if text else []) if self.tool_streams is None else \
            self._tool_deltas(0, text, finish)
        for delta in deltas:
            if delta.get("content"):
                frames += self._delta("text", delta["content"])
            elif "tool_calls" in delta:
                call = delta["tool_calls"][0]
                if "id" in call:
                    frames += self._open("tool_use", id=_tool_use_id(call["id"]), name=call["function"]["name"],
                                         input={})
                else:
                    frames += self._delta("tool_use", call["function"]["arguments"])
        return frames

    _DELTAS = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text"),
               "tool_use": ("input_json_delta", "partial_json")}

    def _delta(self, kind: str, value: str) -> list[str]:
        frames = [] if self.open == kind else self._open(kind)
        if kind == "thinking" and not self.show_thought:
            return frames
        delta_type, key = self._DELTAS[kind]
        return frames + [self._event("content_block_delta", index=self.blocks - 1,
                                     delta={"type": delta_type, key: value})]

    def _open(self, kind: str, **fields) -> list[str]:
        frames = self._close()
        block = self._thinking_block("") if kind == "thinking" else {"type": "text", "text": ""} if kind == "text" \
            else {"type": kind, **fields}
        self.open = kind
        self.blocks += 1
        return frames + [self._event("content_block_start", index=self.blocks - 1, content_block=block)]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        frames = []
        if self.open == "thinking":
            frames.append(self._event("content_block_delta", index=self.blocks - 1,
                                      delta={"type": "signature_delta", "signature": ""}))
        self.open = None
        return frames + [self._event("content_block_stop", index=self.blocks - 1)]

    def sse_end(self) -> list[str]:
        stop_reason = self._stop_reason()
        usage = self.usage()
        return self._close() + [
            self._event("message_delta", delta={"stop_reason": stop_reason,
                                                "stop_sequence": self.stop_string if stop_reason == "stop_sequence"
                                                else None}, usage=usage),
            self._event("message_stop")]

    def sse_error(self, e: ApiError) -> list[str]:
        return [sse(error_body(e), event="error")]


def _tool_use_id(call_id: str) -> str:
    """Anthropic's id shape for a call the tool parser named call_…"""
    return "toolu_" + call_id.removeprefix("call_")
