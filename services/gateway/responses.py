"""OpenAI's Responses API over the chat pipeline (docs/responses.md).

  POST   /v1/responses                        create (stream: the typed SSE events, `event: response.…`)
  POST   /v1/responses/input_tokens           the prompt tokens a create request would have (truncation included)
  GET    /v1/responses/{id}                   a stored response, or a background one as it stands (stream=true:
                                              its events after starting_after, then the rest as they come)
  GET    /v1/responses/{id}/input_items       its input items (limit, order, after)
  DELETE /v1/responses/{id}                   forget it (a running background response is cancelled first)
  POST   /v1/responses/{id}/cancel            cancel a background response (background.py)

A request becomes the chat request it means (`chat_request`): `instructions` a system message first, the input
items (a string, or messages, function calls and their outputs) and, with `previous_response_id`, the stored
conversation before them as chat messages; `max_output_tokens` the token limit; function `tools`, `tool_choice` and
`parallel_tool_calls` the chat's (flat in this API, nested in chat); `text.format` the response_format;
`reasoning.effort` the chat's reasoning_effort (reasoning.py); logprobs when `include` asks for
`message.output_text.logprobs`, with `top_logprobs` alternatives; and the sampling parameters the chat endpoint
takes (vLLM's extensions included). From there it runs exactly as chat does: same template, same tool syntax and
grammars, same constraint, same workers. `ResponsesRenderer` then shapes the answer as a response object: a
reasoning item with the thought's text (reasoning_text; no summary is written), a message item with its
output_text, a function_call item per call; `status` completed, or incomplete (`incomplete_details.reason`
max_output_tokens) when the token limit or the context ended it. A reasoning item in the input goes back to the
model as the thought of the assistant turn after it (the template replays a thought before that turn's calls).

`background: true` queues the response and answers at once; it runs in the gateway and is read back, streamed or
cancelled by its id (background.py).

`conversation` (the Conversations API, conversations.py) reads a conversation's items before the input instead, and
adds the input and output items to it when the response completes or stops at its token limit.

What this server does not do is refused with a 400 naming the parameter, never silently dropped: saved prompts, hosted tools (web search, file search, …: function
tools only), input images, files and audio, item references, n > 1.
`include` values that name output this server never produces (reasoning.encrypted_content, hosted tools' results,
input image URLs) are accepted and have nothing to include; a reasoning item's encrypted_content (another server's)
is not read.

`store` (default true, as OpenAI's) keeps the finished response in the gateway's bounded store (response_store.py),
per API key. `truncation: "auto"` drops the oldest turns of the conversation until the prompt and
`max_output_tokens` (else one token) fit the context; `"disabled"` (the default) answers 400
context_length_exceeded instead.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, model_validator

from splitgemma.v1 import serving_pb2 as pb

from .protocol import (MAX_TOOLS, MAX_TOP_LOGPROBS, ApiError, ChatCompletionRequest, FunctionDefinition,
                       PositiveInt, _SamplingRequest, _Strict, _Unsupported, check_tools, invalid)
from .auth import request_owner
from .background import BackgroundRuns
from .conversation_store import ConversationStore
from .reasoning import ReasoningPlan
from .render import ChoiceRenderer, sse
from .response_store import ChainBroken, ResponseStore
from .tools import ToolPlan, tool_message

if TYPE_CHECKING:
    from .app import Gateway

log = logging.getLogger("splitgemma.gateway")

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# include values naming output this server never produces: asking for them is answered by their absence.
NOTHING_TO_INCLUDE = frozenset({"reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
                                "web_search_call.action.sources", "code_interpreter_call.outputs",
                                "computer_call_output.output.image_url", "message.input_image.image_url"})
MAX_METADATA = 16            # OpenAI's limits on metadata: pairs, key and value lengths
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_ID = 128                 # characters of an id a client may send (previous_response_id, item ids)
# The sampling request's fields that carry over to the chat request as they are; the rest are the Responses API's
# own (max_output_tokens, text.format, …) or refused here (max_tokens, n, response_format, prompt_logprobs).
_CARRIED = frozenset(_SamplingRequest.model_fields) - {"max_tokens", "n", "stream_options", "response_format",
                                                        "prompt_logprobs"}


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(16)


# ---------------------------------------------------------------------------------------------------------------
# The request

# OpenAI's parameters for what this server does not do: the values that ask for nothing, and why anything else is
# refused.
REFUSED = {
    "background_options": ((None,), "a background response runs with the gateway's own options"),
    "prompt": ((None,), "send input and instructions instead of a saved prompt"),
    "context_management": ((None, []), "truncation auto drops the oldest turns instead of compacting them"),
    "moderation": ((None,), "it runs no moderation model"),
}


class FunctionTool(FunctionDefinition):
    """The Responses API's function tool: the chat's function definition, flat."""
    type: Literal["function"]


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")  # "schema" would shadow BaseModel's
    strict: bool | None = None  # constrained decoding always holds the output to the schema


class ReasoningConfig(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # Accepted: no summary is written (the reasoning item carries the thought's own text), as OpenAI answers for a
    # model that writes none.
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None   # summary's deprecated name
    # Which past thoughts go back to the model: Gemma 4's template replays the thoughts of the turns after the last
    # user message that made calls, and only those.
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: str | None = None   # OpenAI's execution modes: this server has one, "standard"

    @model_validator(mode="after")
    def _one_way(self):
        if self.context == "all_turns":
            raise _Unsupported("reasoning.context", "reasoning.context all_turns is not supported: the model's chat "
                               "template replays the thoughts of the current turn only")
        if self.mode not in (None, "standard"):
            raise _Unsupported("reasoning.mode", f"reasoning.mode {self.mode[:40]!r} is not supported: this server "
                               "runs the standard mode only")
        return self


class ConversationRef(_Strict):
    id: Annotated[str, Field(min_length=1, max_length=MAX_ID)]


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None   # a hint this model has no use for


class ResponsesRequest(_SamplingRequest):
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    include: Annotated[list[str], Field(max_length=16)] | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    previous_response_id: Annotated[str, Field(min_length=1, max_length=MAX_ID)] | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None   # bounds hosted tools' calls: there are none here
    # accepted and answered as "default": there is one tier
    safety_identifier: Annotated[str, Field(max_length=MAX_ID)] | None = None
    # the prefix cache needs no key or options: it matches prompts by their tokens, and keeps blocks while it has room
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    image: dict[str, Any] | None = None              # options for input images, which this server does not take
    access_programs: dict[str, Any] | None = None    # OpenAI's account programs: nothing here depends on them
    # OpenAI's, for what this server does not do: present only to be refused unless they ask for nothing (REFUSED)
    background: bool | None = None
    background_options: dict[str, Any] | None = None
    # the Conversations API's: its id, or {"id": …}
    conversation: Annotated[str, Field(min_length=1, max_length=MAX_ID)] | ConversationRef | None = None
    prompt: Any = None
    context_management: list[Any] | None = None
    moderation: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _hosted_tools(cls, data: Any):
        tools = data.get("tools") if isinstance(data, dict) else None
        for i, t in enumerate(tools if isinstance(tools, list) else ()):
            kind = t.get("type") if isinstance(t, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise _Unsupported(f"tools[{i}].type", f"tools of type {kind!r} are not supported: this server "
                                   "runs no hosted tools; declare functions (type function) and run them yourself")
        return data

    @model_validator(mode="after")
    def _responses_checks(self):
        for name, better in (("max_tokens", "max_output_tokens"), ("response_format", "text.format")):
            if getattr(self, name) is not None:
                raise _Unsupported(name, f"{name} is not a Responses API parameter: use {better}")
        if self.n != 1:
            raise _Unsupported("n", "a response has one output: use /v1/chat/completions for n choices")
        if self.prompt_logprobs is not None:
            raise _Unsupported("prompt_logprobs", "prompt_logprobs is not supported by /v1/responses: use "
                               "/v1/completions")
        if self.input is None and self.previous_response_id is None:
            raise _Unsupported("input", "missing required parameter: 'input'", code="missing_required_parameter")
        for name, (nothing, why) in REFUSED.items():
            if getattr(self, name) not in nothing:
                raise _Unsupported(name, f"{name} is not supported by this server: {why}")
        if self.background and not self.store:
            raise _Unsupported("background", "a background response is stored (its client reads it back later): "
                               "background needs store true", code="invalid_value")
        for k in self.include or ():
            if k != LOGPROBS_INCLUDE and k not in NOTHING_TO_INCLUDE:
                raise _Unsupported("include", f"include: {k[:80]!r} is not a value this API defines",
                                   code="invalid_value")
        check_metadata(self.metadata)
        if self.conversation is not None and self.previous_response_id is not None:
            raise _Unsupported("conversation", "conversation and previous_response_id cannot both be given: each "
                               "names the conversation to continue", code="invalid_value")
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema" and fmt.schema_ is None:
            raise _Unsupported("text.format.schema", "text.format of type json_schema needs schema",
                               code="missing_required_parameter")
        named = self.tool_choice.name if isinstance(self.tool_choice, NamedFunctionChoice) else None
        check_tools(self.tools or [], self.tool_choice not in (None, "none"), named, "tools[{}].parameters")
        return self

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    @property
    def effort(self) -> str | None:
        return self.reasoning.effort if self.reasoning is not None else None

    @property
    def conversation_id(self) -> str | None:
        c = self.conversation
        return c.id if isinstance(c, ConversationRef) else c


def check_metadata(metadata) -> dict[str, str]:
    """OpenAI's metadata: at most 16 pairs of strings, keys of at most 64 characters, values of at most 512."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise invalid("metadata must be an object of strings", param="metadata", code="invalid_type")
    if len(metadata) > MAX_METADATA or any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE
                                           for k, v in metadata.items()):
        raise invalid(f"metadata holds at most {MAX_METADATA} pairs, keys of at most {MAX_METADATA_KEY} characters "
                      f"and values of at most {MAX_METADATA_VALUE}", param="metadata", code="invalid_value")
    return dict(metadata)


def list_page(items: list[dict], query, default_limit: int = 20, max_limit: int = 100) -> dict:
    """A page of items (oldest first) as the API lists them (a response's input items, a conversation's, files,
    batches): query limit (1 to max_limit), order (asc, or desc: the default), after (an item id)."""
    limit = query.get("limit", str(default_limit))
    if not (limit.isascii() and limit.isdigit() and 1 <= int(limit) <= max_limit):
        raise invalid(f"limit must be an integer from 1 to {max_limit}", param="limit", code="invalid_value")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order must be asc or desc", param="order", code="invalid_value")
    items = items[::-1] if order == "desc" else list(items)
    after = query.get("after")
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise invalid(f"after: no item with id '{after[:MAX_ID]}' here", param="after", code="invalid_value")
        items = items[at + 1:]
    page = items[:int(limit)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}


class InputTokensRequest(ResponsesRequest):
    """POST /v1/responses/input_tokens: what a create request would put in the prompt, counted (model optional)."""
    model: str | None = None


# ---------------------------------------------------------------------------------------------------------------
# Input items: checked and kept in the shape the API returns them (input_items, stored conversations)


def input_items(value: str | list[dict] | None, param: str = "input") -> list[dict]:
    """The request's input (or a conversation's new items, `param` "items") as items (a string is one user message),
    each checked, with an id and a status."""
    if value is None:
        return []
    if isinstance(value, str):
        return [_message_item("user", [_part("input_text", value)])]
    return [_item(item, f"{param}[{i}]") for i, item in enumerate(value)]


def _part(kind: str, text: str) -> dict:
    return {"type": kind, "text": text, **({"annotations": []} if kind == "output_text" else {})}


def _message_item(role: str, content: list[dict], item_id: str | None = None) -> dict:
    return {"id": item_id or new_id("msg_"), "type": "message", "role": role, "status": "completed",
            "content": content}


def _string(item: dict, key: str, param: str, required: bool = True) -> str | None:
    value = item.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise invalid(f"{param}.{key} must be a string", param=f"{param}.{key}",
                      code="missing_required_parameter" if value is None else "invalid_type")
    return value


def _item_id(item: dict, param: str) -> str | None:
    given = _string(item, "id", param, required=False)
    if given is not None and not 0 < len(given) <= MAX_ID:
        raise invalid(f"{param}.id must be 1 to {MAX_ID} characters", param=f"{param}.id", code="invalid_value")
    return given


def _item(item: dict, param: str) -> dict:
    if not isinstance(item, dict):
        raise invalid(f"{param} must be an object", param=param, code="invalid_type")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise invalid(f"{param}.role must be one of user, assistant, system, developer", param=f"{param}.role",
                          code="invalid_value")
        return _message_item(role, _content(item.get("content"), role, f"{param}.content"), _item_id(item, param))
    if kind == "function_call":
        return {"id": _item_id(item, param) or new_id("fc_"), "type": "function_call", "status": "completed",
                "call_id": _string(item, "call_id", param), "name": _string(item, "name", param),
                "arguments": _string(item, "arguments", param)}
    if kind == "function_call_output":
        output = item.get("output")
        if isinstance(output, list):
            output = "".join(p["text"] for p in _content(output, "user", f"{param}.output"))
        elif not isinstance(output, str):
            raise invalid(f"{param}.output must be a string or a list of input_text parts", param=f"{param}.output",
                          code="missing_required_parameter" if output is None else "invalid_type")
        call_id, name = _string(item, "call_id", param, False), _string(item, "name", param, False)
        if call_id is None and name is None:
            raise invalid(f"{param} needs call_id (the call it answers)", param=f"{param}.call_id",
                          code="missing_required_parameter")
        out = {"id": _item_id(item, param) or new_id("fco_"), "type": "function_call_output", "status": "completed",
               "call_id": call_id, "output": output}
        return out if name is None else {**out, "name": name}
    if kind == "reasoning":
        return _reasoning_item(_text_parts(item.get("content") or [], "reasoning_text", f"{param}.content"),
                               _text_parts(item.get("summary") or [], "summary_text", f"{param}.summary"),
                               _item_id(item, param))
    if kind is None:
        raise invalid(f"{param} needs a type (or a role, for a message)", param=f"{param}.type",
                      code="missing_required_parameter")
    raise invalid(f"input items of type {str(kind)[:40]!r} are not supported by this server: it takes messages, "
                  "function_call, function_call_output and reasoning items (continue from stored items with "
                  "previous_response_id)", param=f"{param}.type", code="unsupported_parameter")


def _reasoning_item(content: list[dict], summary: list[dict] | None = None, item_id: str | None = None,
                    status: str = "completed") -> dict:
    return {"id": item_id or new_id("rs_"), "type": "reasoning", "status": status, "summary": summary or [],
            "content": content}


def _text_parts(parts, kind: str, param: str) -> list[dict]:
    """A reasoning item's content (reasoning_text) or summary (summary_text) parts."""
    if not isinstance(parts, list):
        raise invalid(f"{param} must be a list of {kind} parts", param=param, code="invalid_type")
    out = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != kind:
            raise invalid(f"{param}[{j}] must be a content part of type {kind}", param=f"{param}[{j}].type",
                          code="invalid_value")
        out.append({"type": kind, "text": _string(part, "text", f"{param}[{j}]")})
    return out


def _content(content, role: str, param: str) -> list[dict]:
    if isinstance(content, str):
        return [_part("output_text" if role == "assistant" else "input_text", content)]
    if not isinstance(content, list):
        raise invalid(f"{param} must be a string or a list of content parts", param=param,
                      code="missing_required_parameter" if content is None else "invalid_type")
    out = []
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text"):
            out.append(_part(kind, _string(part, "text", p)))
        elif kind == "refusal":
            out.append(_part("output_text", _string(part, "refusal", p)))
        elif kind in ("input_image", "input_file", "input_audio"):
            raise invalid(f"content parts of type {kind!r} are not supported: this server takes text only",
                          param=f"{p}.type", code="unsupported_parameter")
        else:
            raise invalid(f"{p} must be a content part of type input_text or output_text", param=f"{p}.type",
                          code="invalid_value")
    return out


# ---------------------------------------------------------------------------------------------------------------
# The chat request a Responses request means


def chat_messages(instructions: str | None, items: list[dict]) -> list[dict]:
    """Items as chat messages: function calls join the assistant message before them (or make one), each output a
    tool message naming its call; a reasoning item's text (its summary's, if it has no content) becomes the
    reasoning_content of the assistant message after it."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions is not None else []
    names: dict[str, str] = {}
    thought: str | None = None  # a reasoning item's, waiting for its assistant message

    def assistant(message: dict) -> dict:
        nonlocal thought
        if thought is not None:
            message["reasoning_content"], thought = thought, None
        return message

    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            thought = "".join(p["text"] for p in item["content"] or item["summary"])
        elif kind == "message":
            message = {"role": item["role"], "content": "".join(p["text"] for p in item["content"])}
            if item["role"] == "assistant":
                message = assistant(message)
            else:
                thought = None  # a thought belongs to the assistant turn right after it
            out.append(message)
        elif kind == "function_call":
            names[item["call_id"]] = item["name"]
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and thought is None:
                out[-1]["tool_calls"] = [*(out[-1].get("tool_calls") or []), call]
            else:
                out.append(assistant({"role": "assistant", "content": None, "tool_calls": [call]}))
        else:  # function_call_output
            message = {"role": "tool", "content": item["output"]}
            if item.get("call_id") is not None:
                message["tool_call_id"] = item["call_id"]
            name = names.get(item.get("call_id")) or item.get("name")
            out.append(message if name is None else {**message, "name": name})
    return out


def chat_request(req: ResponsesRequest, items: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat request `req` means, over the conversation `items` (the stored one, then this request's input),
    and its messages as the template receives them."""
    messages = chat_messages(req.instructions, items)
    if not messages:
        raise invalid("the request has no input", param="input", code="invalid_value")
    body = req.model_dump(include=_CARRIED, by_alias=True, exclude_none=True)
    body.update(model=req.model or "", messages=messages, max_completion_tokens=req.max_output_tokens,
                logprobs=req.logprobs, top_logprobs=req.top_logprobs if req.logprobs else None,
                parallel_tool_calls=req.parallel_tool_calls, reasoning_effort=req.effort)
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if isinstance(req.tool_choice, NamedFunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None:
        body["response_format"] = {"type": fmt.type} if fmt.type != "json_schema" else {
            "type": "json_schema", "json_schema": fmt.model_dump(exclude={"type"}, by_alias=True, exclude_none=True)}
    return ChatCompletionRequest.model_validate(body), messages


def truncated(messages: list[dict]) -> list[dict] | None:
    """truncation auto's next step: the conversation without its oldest turn (a leading system or developer
    message — the instructions — stays), starting again at a user message; None when no older turn is left."""
    head = 1 if messages and messages[0]["role"] in ("system", "developer") else 0
    rest = messages[head:]
    nxt = next((i for i in range(1, len(rest)) if rest[i]["role"] == "user"), None)
    return None if nxt is None else messages[:head] + rest[nxt:]


# ---------------------------------------------------------------------------------------------------------------
# The answer


class ResponsesRenderer(ChoiceRenderer):
    """One request's response object: the body, or its stream of typed events (each with its sequence_number):
    response.created, response.in_progress; per output item output_item.added, then for a message
    content_part.added, output_text.delta … output_text.done, content_part.done, and for a call
    function_call_arguments.delta … .done; output_item.done; finally response.completed (or response.incomplete).
    A failure mid-stream sends `error` and response.failed."""

    def __init__(self, gateway: "Gateway", request_id: str, req: ResponsesRequest, plan: ToolPlan | None,
                 reasoning: ReasoningPlan | None, *, store: ResponseStore, owner: str, input_items: list[dict],
                 conversations: ConversationStore | None = None):
        super().__init__(gateway, True, 1, request_id, logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0,
                         include_usage=False, tools=plan, reasoning=reasoning)
        self.req = req
        self.store = store
        self.owner = owner
        self.items = input_items
        self.stored = req.store and store.enabled
        self.conversations = conversations   # where a request with `conversation` adds its items
        self.seq = 0
        self.output: list[dict] = []        # finished output items (streaming)
        self.open: dict | None = None       # the item being streamed
        self.pending_lp: list[dict] = []    # logprobs of tokens whose text has not gone out yet
        # background responses (background.py)
        self.started = False                # the stream began (admitted and prefilled)
        self.kept = False                   # the final response went to the store
        self.error: dict | None = None      # the error a failed stream ended with

    # the response object
    def response(self, status: str, output: list[dict], *, error: dict | None = None) -> dict:
        req = self.req
        done = status in ("completed", "incomplete", "failed")
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else \
            {"type": "text"}
        tool_choice = req.tool_choice or "auto"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": bool(req.background),
            "completed_at": int(time.time()) if status == "completed" else None, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls, "metadata": req.metadata or {}, "model": self.gw.config.model_name,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id, "prompt_cache_key": req.prompt_cache_key,
            "conversation": {"id": req.conversation_id} if req.conversation_id is not None else None,
            "reasoning": {"effort": req.effort, "summary": req.reasoning.summary or req.reasoning.generate_summary
                          if req.reasoning is not None else None},
            "safety_identifier": req.safety_identifier,
            "service_tier": req.tier, "store": self.stored,
            "temperature": self.gw.effective(req, "temperature", 1.0),
            "text": {"format": fmt, "verbosity": req.text.verbosity if req.text and req.text.verbosity else "medium"},
            "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_logprobs": req.top_logprobs or 0, "top_p": self.gw.effective(req, "top_p", 1.0),
            "truncation": req.truncation or "disabled", "user": req.user,
            "usage": self.usage() if done and error is None or status == "cancelled" else None,
        }

    def usage(self) -> dict:
        out = sum(self.tokens)
        return {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": out, "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens()},
                "total_tokens": self.input_tokens + out}

    def _status(self) -> str:
        return "incomplete" if self.finish[0] == "length" else "completed"

    def _keep(self, response: dict) -> dict:
        if self.stored and not self.store.put(self.owner, response, self.items, self.req.previous_response_id):
            log.warning("response too large for the store: not kept", extra={"request_id": self.id})
        if self.req.conversation_id is not None and response["status"] in ("completed", "incomplete"):
            try:
                if not self.conversations.add(self.req.conversation_id, self.owner, self.items + response["output"]):
                    log.warning("conversation gone before its response ended: items not added",
                                extra={"request_id": self.id})
            except ApiError:  # the conversation would outgrow the store
                log.warning("conversation full: the response's items not added", extra={"request_id": self.id})
        self.kept = True
        return response

    def finish_as(self, status: str, error: dict | None = None) -> dict:
        """A background response that ended other than by its stream's end (cancelled, failed), stored: the output
        finished so far, and the item that was being streamed, incomplete."""
        output = list(self.output)
        if self.open is not None:
            output.append({**self.open, "status": "incomplete"})
        return self._keep(self.response(status, output, error=error))

    def _lp(self, entries, in_thought: list[bool]) -> list[dict]:
        """The output_text's logprobs: the answer's tokens (a thought's are not the message's)."""
        return self._chat_logprobs([e for e, t in zip(entries, in_thought) if not t])["content"]

    # non-streaming
    def body(self) -> dict:
        text, finish = self.text[0], self.finish[0] or "stop"
        content, calls = text, []
        if self.tools is not None:
            message, self.finish[0] = tool_message(self.tools, text, finish)
            content, calls = message["content"], message.get("tool_calls") or []
        output = []
        status = self._status()
        if self.has_thought(0):
            output.append(_reasoning_item([_part("reasoning_text", self.thought[0])],
                                          status="incomplete" if status == "incomplete" and not content and not calls
                                          else "completed"))
        if content or not (calls or output):
            part = _part("output_text", content or "")
            if self.logprobs:
                part["logprobs"] = self._lp(self.lp[0], self.thought_lp[0])
            output.append({**_message_item("assistant", [part]), "status": status})
        output += [{"id": new_id("fc_"), "type": "function_call", "status": "completed", "call_id": c["id"],
                    "name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
        return self._keep(self.response(status, output))

    # streaming
    def _event(self, kind: str, **fields) -> str:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq - 1, **fields}, event=kind)

    def sse_start(self) -> list[str]:
        self.started = True
        started = self.response("in_progress", [])
        if self.req.background:  # created and queued went out when it was queued (sse_queued)
            return [self._event("response.in_progress", response=started)]
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started)]

    def sse_queued(self) -> list[str]:
        """A background response's first events, when it is queued."""
        queued = self.response("queued", [])
        return [self._event("response.created", response=queued), self._event("response.queued", response=queued)]

    def sse_event(self, index: int, event: pb.GenerateEvent) -> list[str]:
        text, thought, lp = self.add(index, event)
        if lp is not None:
            flags = self.thought_lp[0]
            self.pending_lp += self._lp(lp, flags[len(flags) - len(lp):])
        finish = self.finish[0] if event.finish_reason != pb.FINISH_REASON_UNSPECIFIED else None
        if self.tool_streams is None:
            deltas = [{"content": text}] if text else []
        else:
            deltas = self._tool_deltas(0, text, finish)
        frames = self._thought(thought) if thought else []
        for delta in deltas:
            if delta.get("content"):
                frames += self._text(delta["content"])
            elif "tool_calls" in delta:
                call = delta["tool_calls"][0]
                if "id" in call:
                    frames += self._close() + self._open_call(call["id"], call["function"]["name"])
                else:
                    frames += self._arguments(call["function"]["arguments"])
        return frames

    def _open_part(self, item: dict, part: dict) -> list[str]:
        """`item` opened (the one open before it closed) with its one content part, `part`."""
        frames = self._close()
        self.open = item
        frames.append(self._event("response.output_item.added", output_index=len(self.output),
                                  item={**item, "content": []}))
        item["content"].append(part)
        frames.append(self._event("response.content_part.added", item_id=item["id"], output_index=len(self.output),
                                  content_index=0, part=part))
        return frames

    def _open_message(self) -> list[str]:
        part = _part("output_text", "")
        if self.logprobs:
            part["logprobs"] = []
        return self._open_part({**_message_item("assistant", []), "status": "in_progress"}, part)

    def _text(self, text: str) -> list[str]:
        frames = []
        if self.open is None or self.open["type"] != "message":
            frames += self._open_message()
        part = self.open["content"][0]
        part["text"] += text
        lp, self.pending_lp = self.pending_lp, []
        if self.logprobs:
            part["logprobs"] += lp
        frames.append(self._event("response.output_text.delta", item_id=self.open["id"], output_index=len(self.output),
                                  content_index=0, delta=text, logprobs=lp))
        return frames

    def _thought(self, text: str) -> list[str]:
        frames = []
        if self.open is None or self.open["type"] != "reasoning":
            frames += self._open_part(_reasoning_item([], status="in_progress"), _part("reasoning_text", ""))
        self.open["content"][0]["text"] += text
        frames.append(self._event("response.reasoning_text.delta", item_id=self.open["id"],
                                  output_index=len(self.output), content_index=0, delta=text))
        return frames

    def _open_call(self, call_id: str, name: str) -> list[str]:
        self.pending_lp = []  # a call's tokens: a function_call item has no logprobs
        self.open = {"id": new_id("fc_"), "type": "function_call", "status": "in_progress", "call_id": call_id,
                     "name": name, "arguments": ""}
        return [self._event("response.output_item.added", output_index=len(self.output), item=dict(self.open))]

    def _arguments(self, delta: str) -> list[str]:
        self.open["arguments"] += delta
        return [self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                            output_index=len(self.output), delta=delta)]

    def _close(self, last: bool = False) -> list[str]:
        """The done events of the item being streamed, if any; `last`: the response's end closes it, so it is
        incomplete if the response is."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.output)
        frames = []
        if item["type"] == "message":
            part = item["content"][0]
            if self.logprobs and self.pending_lp:
                part["logprobs"] += self.pending_lp
                self.pending_lp = []
            extra = {"logprobs": part["logprobs"]} if self.logprobs else {"logprobs": []}
            frames += [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=part["text"], **extra),
                       self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part)]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            frames += [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=part["text"]),
                       self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part)]
        else:
            frames.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
        item["status"] = self._status() if last else "completed"
        self.output.append(item)
        frames.append(self._event("response.output_item.done", output_index=index, item=item))
        return frames

    def sse_end(self) -> list[str]:
        frames = self._close(last=True)
        if not self.output:  # nothing came out: still one (empty) message, as the body has
            frames += self._open_message() + self._close(last=True)
        status = self._status()
        done = self._keep(self.response(status, self.output))
        return frames + [self._event(f"response.{status}", response=done)]

    def sse_error(self, e: ApiError) -> list[str]:
        code = "rate_limit_exceeded" if e.status == 429 else "server_error" if e.status >= 500 else "invalid_prompt"
        self.error = {"code": code, "message": e.message}
        failed = self.response("failed", self.output, error=self.error)
        return [self._event("error", code=e.code or e.type, message=e.message, param=e.param),
                self._event("response.failed", response=failed)]


# ---------------------------------------------------------------------------------------------------------------
# The stored responses' endpoints


def conversation_before(store: ResponseStore, runs: BackgroundRuns, req: ResponsesRequest,
                        owner: str) -> tuple[list[dict], int]:
    """The stored conversation `previous_response_id` continues (none without one) and its size in bytes."""
    if req.previous_response_id is None:
        return [], 0
    if runs.running(req.previous_response_id, owner) is not None:
        raise invalid(f"Previous response with id '{req.previous_response_id[:MAX_ID]}' is a background response "
                      "still running: continue it once it has completed", param="previous_response_id",
                      code="invalid_value")
    try:
        found = store.conversation(req.previous_response_id, owner)
    except ChainBroken:
        raise invalid(f"Previous response with id '{req.previous_response_id[:MAX_ID]}' continues a conversation "
                      "whose earlier responses are no longer stored; start it again with the whole input",
                      param="previous_response_id", code="previous_response_not_found") from None
    if found is None:
        raise ApiError(404, f"Previous response with id '{req.previous_response_id[:MAX_ID]}' not found.",
                       param="previous_response_id", code="previous_response_not_found")
    return found


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id[:MAX_ID]}' not found.", param="response_id",
                    code="not_found")


def add_store_endpoints(app: FastAPI, store: ResponseStore, runs: BackgroundRuns, keyed: bool) -> None:
    def stored(request: Request, response_id: str):
        entry = store.get(response_id, request_owner(request, keyed))
        if entry is None:
            raise _not_found(response_id)
        return entry

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str):
        owner = request_owner(request, keyed)
        query = request.query_params
        if query.get("stream", "false") not in ("true", "false"):
            raise invalid("stream must be true or false", param="stream", code="invalid_value")
        after = query.get("starting_after")
        if after is not None and not (after.isascii() and after.isdigit() and len(after) <= 9):
            raise invalid("starting_after must be a sequence number (an integer ≥ 0)", param="starting_after",
                          code="invalid_value")
        if query.get("stream") == "true":
            run = runs.get(response_id, owner)
            if run is None:
                stored(request, response_id)  # 404 if it is not stored either
                raise invalid("only a background response's events can be streamed again, while the gateway keeps "
                              "them: GET this response without stream", param="stream", code="invalid_value")
            return StreamingResponse(run.follow(None if after is None else int(after)),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        run = runs.running(response_id, owner)
        return JSONResponse(run.snapshot() if run is not None else stored(request, response_id).response)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str):
        owner = request_owner(request, keyed)
        run = runs.running(response_id, owner)
        if run is not None:
            await runs.cancel(run)
        if not store.delete(response_id, owner):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(request: Request, response_id: str):
        return list_page(stored(request, response_id).input_items, request.query_params)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str):
        """Cancels a running background response; one that has ended is answered as it is (cancelling is
        idempotent); a response that was not created in the background cannot be cancelled."""
        run = runs.running(response_id, request_owner(request, keyed))
        if run is not None:
            await runs.cancel(run)
            entry = store.get(response_id, run.owner)
            return JSONResponse(entry.response if entry is not None else run.snapshot())
        entry = stored(request, response_id)
        if not entry.response.get("background"):
            raise invalid("only background responses can be cancelled: this one was not created with background "
                          "true", param="response_id", code="invalid_value")
        return JSONResponse(entry.response)
