"""The OpenAI request shapes the gateway accepts, its error envelope, and the mapping of validation failures to it.

Requests are validated with pydantic in strict mode (a string where a number belongs is an error, not a
conversion) and every failure becomes `{"error": {"message", "type", "param", "code"}}` with status 400, never
FastAPI's 422. Fields OpenAI or vLLM define that this server does not implement are rejected with a 400 naming them
when they ask for something (beam search, bad_words, suffix, …: REFUSED) rather than silently ignored; unknown
fields are ignored, as vLLM does.

The body itself is held to strict JSON before any field is looked at (RFC 8259; Python's json module is more
lenient): UTF-8 only, no NaN/Infinity, no number that overflows a double, no integer longer than Python converts,
no duplicate keys (two parsers may pick different ones), no lone surrogate escapes (they cannot be encoded again
nor tokenized), and nesting at most MAX_DEPTH deep (the chat template walks what it is given recursively).
Integer fields are bounded by what the workers' proto fields hold, so nothing valid here fails to serialise there.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from splitgemma.serving.chat_template import RESERVED_VARIABLES

MAX_N = 16               # choices per prompt
MAX_CHOICES = 64         # choices per request (prompts × n)
MAX_STOP = 16            # stop strings per request
MAX_TOP_LOGPROBS = 20    # as the workers' SamplingParams.top_logprobs
MAX_TOKENS_LIMIT = 1 << 20
MAX_STOP_CHARS = 1024    # per stop string: the decode worker holds back text that may begin one
MAX_TOOLS = 128          # function definitions per request (each is compiled into the constraint)
MAX_DEPTH = 32           # JSON nesting (arrays and objects) anywhere in a body
INT32_MAX = (1 << 31) - 1
LOWEST_PRIORITY = INT32_MAX   # last in every queue (lower first): batches' requests and service_tier flex
UINT32_MAX = (1 << 32) - 1


class ApiError(Exception):
    """An error answered in the OpenAI envelope. `code` is a string or None, as OpenAI's own."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 502: "server_error",
             503: "service_unavailable_error", 504: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None, type_: str | None = None):
        # Messages quote the client's input, which may hold text that cannot be encoded (a lone surrogate in a
        # URL path): the error must still be sendable.
        message = _sendable(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = None if param is None else _sendable(param)
        self.code = code
        self.retry_after = retry_after
        self.type = type_ or self.TYPES.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        # Retry-After takes whole seconds; round up so a client never comes back too early.
        return {"Retry-After": str(max(1, int(-(-self.retry_after // 1))))}


def _sendable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# ---------------------------------------------------------------------------------------------------------------
# Requests

PositiveInt = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    # "schema" would shadow BaseModel.schema
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # constrained decoding always holds the output to the schema


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: one of json (a schema), regex, choice, grammar."""
    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")  # "json" would shadow BaseModel's
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _SamplingRequest(_Strict):
    model: str
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    # extension (vLLM, llama-server); -1 or 0 = no cut; the workers' SamplingParams.top_k is an int32
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    seed: Annotated[int, Field(ge=-(1 << 63), lt=1 << 64)] | None = None
    stop: Annotated[str, Field(max_length=MAX_STOP_CHARS)] | \
        Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=UINT32_MAX)]], Field(max_length=MAX_STOP)] | \
        None = None
    ignore_eos: bool = False                                   # extension: for benchmarks
    skip_special_tokens: bool = True                           # extension (vLLM): drop <unk>, <bos>… from text
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extension (vLLM): the request's place in the admission queue and among the prompts a prefill worker runs,
    # lower first; not 0 only under the gateway's --scheduling-policy priority (docs/scheduling.md)
    priority: Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)] = 0
    # OpenAI's processing tier: "flex" (slower, for work that can wait) runs at LOWEST_PRIORITY, behind every other
    # request under either scheduling policy; the others run as "default", the tier the answer reports
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None

    @property
    def tier(self) -> str:
        return "flex" if self.service_tier == "flex" else "default"

    # logits processing (splitgemma/serving/logits.py): OpenAI's, then vLLM's extensions
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]], Field(max_length=1024)] | \
        None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=1e6)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)] = 0
    include_stop_str_in_output: bool = False
    # vLLM: the prompt's logprobs with the top n per position (services/gateway/prompt_logprobs.py)
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # vLLM parameters this server does not implement: present only to be refused (REFUSED)
    use_beam_search: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    truncate_prompt_tokens: Any = None
    length_penalty: Any = None
    # structured outputs (services/gateway/structured.py): OpenAI's, then vLLM's and llama-server's extensions
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None                          # Lark (llguidance) or GBNF
    grammar: str | None = None                                 # llama-server: GBNF (Lark accepted too)
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="after")
    def _unsupported(self):
        for name, off in REFUSED.items():
            if getattr(self, name) not in off:
                raise _Unsupported(name, f"{name} is not supported by this server")
        for key in self.logit_bias or {}:
            if not (key.isascii() and key.isdigit()) or len(key) > 10 or int(key) > UINT32_MAX:
                raise _Unsupported("logit_bias", f"logit_bias keys must be token ids, got {key[:40]!r}",
                                   code="invalid_value")
        if self.prompt_logprobs is not None and self.stream:
            raise _Unsupported("prompt_logprobs", "prompt_logprobs is not supported with stream")
        if self.stream_options is not None and not self.stream:
            raise _Unsupported("stream_options", "stream_options is only allowed when stream is true",
                               code="invalid_value")
        if isinstance(self.stop, list) and any(not s for s in self.stop) or self.stop == "":
            raise _Unsupported("stop", "stop strings must not be empty", code="invalid_value")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


# Accepted-and-refused parameters and the values that ask for nothing (so a client that sends the default works).
REFUSED = {"use_beam_search": (None, False), "bad_words": (None, []),
           "allowed_token_ids": (None,), "truncate_prompt_tokens": (None,), "length_penalty": (None, 1, 1.0)}


class CompletionRequest(_SamplingRequest):
    # A string, a list of strings (a batch: one set of choices per prompt), a list of token ids, or a list of
    # lists of token ids. Order matters for the union: strict mode keeps each shape to its own member.
    prompt: Union[str, list[str], list[Annotated[int, Field(ge=0, le=UINT32_MAX)]],
                  list[list[Annotated[int, Field(ge=0, le=UINT32_MAX)]]]]
    # 0 only with echo: the prompt scored, nothing generated (OpenAI's legacy completions)
    max_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_checks(self):
        if self.max_tokens == 0 and not self.echo:
            raise _Unsupported("max_tokens", "max_tokens must be at least 1 (0 only with echo, to score the prompt)",
                               code="invalid_value")
        if self.echo and self.stream:
            raise _Unsupported("echo", "echo is not supported with stream")
        if self.best_of is not None and self.best_of < self.n:
            raise _Unsupported("best_of", f"best_of ({self.best_of}) must be at least n ({self.n})",
                               code="invalid_value")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise _Unsupported("best_of", "best_of cannot be used with stream (the candidates are ranked once all "
                               "are complete)", code="invalid_value")
        if self.suffix:
            raise _Unsupported("suffix", "suffix is not supported by this model")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """Validated for shape; the template receives the message exactly as the client sent it (tool_calls,
    tool_call_id, name, reasoning_content, … pass through)."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    @model_validator(mode="before")
    @classmethod
    def _media(cls, data: Any):
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            for part in data["content"]:
                if isinstance(part, dict) and part.get("type") not in ("text", None):
                    raise _Unsupported("messages", f"content parts of type {part.get('type')!r} are not "
                                       "supported: this server takes text only")
        return data

    @model_validator(mode="after")
    def _content_required(self):
        if self.content is None and self.role != "assistant":
            raise _Unsupported("messages", f"a {self.role} message needs content", code="invalid_value")
        return self


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class Prediction(_Strict):
    """OpenAI's predicted output: text the answer is expected to repeat much of (a file to be edited, say)."""
    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True                         # extension (vLLM)
    # extension (vLLM): the last message is left open and the model continues it (a prefilled answer); needs
    # add_generation_prompt false
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None         # extension (vLLM), e.g. {"enable_thinking": true}
    # thinking on at any level but none (reasoning.py); the thought comes back as reasoning_content unless
    # include_reasoning (vLLM's extension) is false
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    include_reasoning: bool = True
    # extension (vLLM): a thinking request's thought holds at most this many tokens, then it is closed
    thinking_token_budget: Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)] | None = None
    # drafts for the decode worker's speculation (docs/speculation.md): the same tokens, sooner where it is right
    prediction: Prediction | None = None

    @model_validator(mode="after")
    def _chat_checks(self):
        taken = sorted(RESERVED_VARIABLES.intersection(self.chat_template_kwargs or {}))
        if taken:
            # `tools` here would put tool definitions into the prompt that the tools field is refused for.
            raise _Unsupported("chat_template_kwargs", f"chat_template_kwargs cannot set {', '.join(taken)}: the "
                               "chat template receives those from the request itself", code="invalid_value")
        if self.top_logprobs and not self.logprobs:
            raise _Unsupported("top_logprobs", "top_logprobs needs logprobs: true", code="invalid_value")
        if self.continue_final_message and self.add_generation_prompt:
            raise _Unsupported("continue_final_message", "continue_final_message and add_generation_prompt cannot "
                               "both be true: set add_generation_prompt to false to continue the last message",
                               code="invalid_value")
        self._tool_checks()
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise _Unsupported("max_completion_tokens", "max_tokens and max_completion_tokens disagree",
                               code="invalid_value")
        return self

    def _tool_checks(self) -> None:
        named = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
        check_tools([t.function for t in self.tools or []], self.tool_choice not in (None, "none"), named,
                    "tools[{}].function.parameters")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def check_tools(functions: list[FunctionDefinition], asks_for_tools: bool, named: str | None,
                parameters_param: str) -> None:
    """What a request's tools must be, on chat and Responses alike: distinct names, parameters that are a JSON schema
    of type object (`parameters_param` names tool i's), and a tool_choice that asks for a call (`asks_for_tools`: not
    none) with tools to call, naming (`named`) one of them."""
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise _Unsupported("tools", f"two tools are named {dup!r}", code="invalid_value")
    for i, f in enumerate(functions):
        if f.parameters is not None and f.parameters.get("type", "object") != "object":
            raise _Unsupported(parameters_param.format(i), "a function's parameters must be a JSON schema of type "
                               "object", code="invalid_value")
    if asks_for_tools and not functions:
        raise _Unsupported("tool_choice", "tool_choice needs tools", code="invalid_value")
    if named is not None and named not in names:
        raise _Unsupported("tool_choice", f"tool_choice names {named!r}, which is not one of the tools",
                           code="invalid_value")


class _Unsupported(ValueError):
    """Raised inside validators: becomes a 400 naming the parameter (pydantic wraps it in ValidationError)."""

    def __init__(self, param: str, message: str, code: str | None = "unsupported_parameter"):
        super().__init__(message)
        self.param = param
        self.code = code
        self.message = message


def parse_request(model: type[BaseModel], raw: bytes) -> tuple[BaseModel, dict]:
    """The validated request and the decoded JSON object, or ApiError(400) for malformed JSON and bad fields."""
    data = parse_json_body(raw)
    try:
        return model.model_validate(data), data
    except ValidationError as e:
        raise _validation_error(e) from None


class _BodyError(ValueError):
    """Raised from the JSON decoder's hooks; becomes a 400."""


def _no_constants(name: str):
    raise _BodyError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _BodyError(f"the number {text[:40]} is out of range")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _BodyError(f"the key {json.dumps(dup)[:80]} appears twice in one object")
    return out


_DECODER = json.JSONDecoder(parse_float=_finite_float, parse_constant=_no_constants, object_pairs_hook=_unique_keys)
# A \uD800-\uDFFF escape: the only way a lone surrogate gets into a strictly decoded body. Rare, so the (slower)
# search for one that is not half of a pair runs only when the text has such an escape at all.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_json_body(raw: bytes) -> dict:
    """The body as a JSON object, held to strict JSON (see the module docstring), or ApiError(400)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"the request body is not valid UTF-8 (byte {e.start})") from None
    return parse_json_object(text, "the request body")


def parse_json_object(text: str, what: str, param: str | None = None) -> dict:
    """`text` (the request body, or JSON text inside it such as a tool call's arguments) as a JSON object held to
    strict JSON, or ApiError(400) saying what `what` is wrong with."""
    try:
        data = _DECODER.decode(text)
    except json.JSONDecodeError as e:
        raise invalid(f"{what} is not valid JSON: {e.msg} (line {e.lineno} column {e.colno})", param=param) \
            from None
    except _BodyError as e:
        raise invalid(f"{what} is not valid JSON: {e}", param=param) from None
    except RecursionError:
        raise invalid(f"{what} is nested too deeply (the limit is {MAX_DEPTH} levels)", param=param) from None
    except ValueError:
        # The only other ValueError the decoder raises: an integer longer than int() converts (sys.int_info).
        raise invalid(f"{what} has an integer with too many digits", param=param) from None
    if not isinstance(data, dict):
        raise invalid(f"{what} must be a JSON object, got {type(data).__name__}", param=param)
    bad = _first_bad_value(data, _SURROGATE_ESCAPE.search(text) is not None)
    if bad is not None:
        path, problem = bad
        path = path if param is None else param + ("" if path == "body" else "." + path)
        raise invalid(f"invalid value for '{path}': {problem}", param=path, code="invalid_value")
    return data


def _first_bad_value(data: dict, surrogates: bool) -> tuple[str, str] | None:
    """(parameter path, problem) of the first value nested more than MAX_DEPTH deep or (when `surrogates`) holding a
    lone surrogate, else None. Iterative: the point is to refuse what would make recursive code overflow."""
    stack: list[tuple[Any, tuple, int]] = [(data, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            return _param_path(list(path)), f"nested more than {MAX_DEPTH} levels deep"
        items = value.items() if isinstance(value, dict) else enumerate(value)
        if surrogates:
            items = list(items)
            for k, v in items:
                if isinstance(k, str) and _has_surrogate(k):
                    return _param_path(list(path)), _SURROGATE_MESSAGE.format("a key")
                if isinstance(v, str) and _has_surrogate(v):
                    return _param_path([*path, str(k)]), _SURROGATE_MESSAGE.format("the string")
        if isinstance(value, list) and not surrogates and _CONTAINERS.isdisjoint(map(type, value)):
            continue  # e.g. a prompt of token ids: no per-item Python work
        stack.extend((v, (*path, str(k)), depth + 1) for k, v in items if type(v) in _CONTAINERS)
    return None


_CONTAINERS = frozenset((dict, list))
_SURROGATE_MESSAGE = "{} holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text"


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _validation_error(e: ValidationError) -> ApiError:
    errors = e.errors(include_url=False)
    # A value that fails a union fails every member; the member of its own shape says what is wrong with it (a token
    # id out of range, a stop string too long) better than the first member's "should be a valid string".
    err = next((x for x in errors if not x["type"].endswith("_type") and not x["type"].startswith("union")),
               errors[0])
    ctx_error = (err.get("ctx") or {}).get("error")
    if isinstance(ctx_error, _Unsupported):
        return invalid(ctx_error.message, param=ctx_error.param, code=ctx_error.code)
    loc = [str(p) for p in err["loc"] if not _is_union_tag(p)]
    param = _param_path(loc)
    kind = err["type"]
    if kind == "missing":
        return invalid(f"missing required parameter: '{param}'", param=param, code="missing_required_parameter")
    value = err.get("input")
    shown = json.dumps(value)[:80] if _jsonable(value) else repr(value)[:80]
    return invalid(f"invalid value for '{param}': {err['msg']} (got {shown})", param=param,
                   code="invalid_type" if kind.endswith("_type") or kind.startswith("union") else "invalid_value")


def _is_union_tag(part) -> bool:
    # pydantic names union members in error locations ("str", "list[int]", "function-after[...]"); drop them.
    return isinstance(part, str) and ("[" in part or part.startswith("constrained-")
                                      or part in ("str", "int", "float", "bool", "list", "dict"))


def _param_path(loc: list[str]) -> str:
    out = ""
    for p in loc:
        out += f"[{p}]" if p.isdigit() else (("." if out else "") + p)
    return out or "body"


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False
