"""Tool calling on /v1/chat/completions: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` mapped onto the
model's own syntax and back (docs/tools.md).

Two formats:
* native (Gemma 4: the tokenizer has `<|tool_call>`, `<tool_call|>`, `<|"|>` and the chat template writes them): the
  declarations and past calls/results are rendered by the template itself; the output is parsed by
  splitgemma.serving.tool_calls.GemmaCallParser from the decode worker's text with special tokens included.
* json (any other model, e.g. Gemma 3): the declarations go into the system message with the instruction to answer
  `{"tool_calls": [{"name": …, "arguments": {…}}]}`; past calls become that text, results become user turns.

Constraints (pb.Constraint, enforced by the workers): tool_choice required or named → only well-formed calls to the
declared (or named) tool with arguments that follow its schema; auto → free text, or a call that is held to the same
grammar once the model opens it; none → the tools are left out of the prompt and nothing is parsed.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from splitgemma.serving.tool_calls import (CALL_OPEN, JSON_CALLS_KEY, GemmaCallParser, MarkerIds, ParsedMessage,
                                           ToolSyntaxError, gemma_tools_lark, json_convention_lark,
                                           json_convention_schema, parse_gemma_output, parse_json_convention)
from splitgemma.serving.tokenizer import control_tokens
from splitgemma.v1 import serving_pb2 as pb

from .protocol import invalid, parse_json_object
from .structured import wants_constraint

JSON_INSTRUCTION = (
    "You can call the tools below. To call one or more of them, answer with nothing but one JSON object of the form "
    '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments as the tool\'s parameters schema says>}}]}. '
    "Otherwise answer normally in text.\nTools:\n")


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolPlan:
    """How one request uses tools: the format, the tools in play, the constraint and how to read the output."""

    native: bool
    tools: list[dict]                   # the function definitions the output may call (named: that one)
    required: bool
    parallel: bool
    markers: MarkerIds | None = None
    hide: list[str] = field(default_factory=list)   # special-token texts dropped from content (native)

    def constraint(self) -> pb.Constraint:
        try:
            if self.native:
                return pb.Constraint(lark=gemma_tools_lark(self.tools, self.markers, required=self.required,
                                                           parallel=self.parallel))
            if self.required:
                return pb.Constraint(json_schema=json.dumps(json_convention_schema(self.tools,
                                                                                   parallel=self.parallel)))
            return pb.Constraint(lark=json_convention_lark(self.tools, parallel=self.parallel))
        except ToolSyntaxError as e:
            raise invalid(f"cannot build a grammar for the tools: {e}", param="tools", code="invalid_value") from None

    def apply(self, specs, constraint: pb.Constraint) -> None:
        """Sets the constraint on every choice; native: the text comes with the markers (special tokens) in it, and
        `<|tool_response>`, which the model writes after its calls, ends the choice."""
        for spec in specs:
            spec.sampling.constraint.CopyFrom(constraint)
            if self.native:
                spec.skip_special_tokens = False
                if self.markers.tool_response is not None and self.markers.tool_response not in spec.stop_token_ids:
                    spec.stop_token_ids = [*spec.stop_token_ids, self.markers.tool_response]

    def stream(self) -> "ToolStream":
        return ToolStream(self)

    def parse(self, text: str) -> ParsedMessage:
        return parse_gemma_output(text, self.hide) if self.native else parse_json_convention(text)


@dataclass(frozen=True)
class ToolFormat:
    """What the model's tokenizer and template offer: the markers of the native syntax (None: the json format) and
    the texts of the special tokens, hidden from content."""

    markers: MarkerIds | None
    special_texts: tuple[str, ...]

    @classmethod
    def of(cls, tokenizer, template_source: str) -> "ToolFormat":
        markers = MarkerIds.from_tokenizer(tokenizer)
        native = markers is not None and CALL_OPEN in template_source
        return cls(markers if native else None,
                   tuple(control_tokens(tokenizer).values()))


def plan_tools(req, fmt: ToolFormat) -> ToolPlan | None:
    """The plan for a validated request, or None when no tool may be called (no tools, or tool_choice none)."""
    if not req.tools or req.tool_choice == "none":
        return None
    if wants_constraint(req):
        # Both would constrain the same output: the answer's format and the calls' syntax in one grammar is not
        # built yet.
        raise invalid("a structured-output constraint together with tools is not supported; send one of them, "
                      "or tool_choice: none", "response_format")
    functions = [t.function.model_dump(exclude_none=True) for t in req.tools]
    choice = req.tool_choice or "auto"
    if not isinstance(choice, str):
        functions = [f for f in functions if f["name"] == choice.function.name]
    native = fmt.markers is not None
    return ToolPlan(native=native, tools=functions, required=choice != "auto", parallel=req.parallel_tool_calls,
                    markers=fmt.markers, hide=list(fmt.special_texts) if native and req.skip_special_tokens else [])


# ---------------------------------------------------------------------------------------------------------------
# The prompt side


def template_messages(req, messages: list[dict], native: bool,
                      plan: ToolPlan | None) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) to render: past calls' arguments as mappings (the template writes them key by key), and for
    the json format everything in text. The template declares every tool of the request (a named tool_choice
    narrows what the constraint admits, not what the model is told of); none when tool_choice is none."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m.get("tool_calls") is not None:
            m["tool_calls"] = _past_calls(m["tool_calls"], i)
        out.append(m)
    if native:
        return out, [t.model_dump(exclude_none=True) for t in req.tools] if plan is not None else None
    return _json_messages(out, plan), None


def _past_calls(calls, i: int) -> list[dict]:
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise invalid(f"{param} must be a list", param=param, code="invalid_type")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"{param}[{j}] must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                          param=f"{param}[{j}]", code="invalid_value")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            # Held to the body's own rules (strict JSON, bounded nesting): the template renders it recursively.
            args = parse_json_object(args, f"{param}[{j}].function.arguments", f"{param}[{j}].function.arguments") \
                if args.strip() else {}
        if not isinstance(args, dict):
            raise invalid(f"{param}[{j}].function.arguments must be a JSON object", param=f"{param}[{j}]",
                          code="invalid_value")
        out.append({**c, "function": {**fn, "arguments": args}})
    return out


def _json_messages(messages: list[dict], plan: ToolPlan | None) -> list[dict]:
    names: dict[str, str] = {}
    out: list[dict] = []
    from_tool = False  # the last message in `out` holds a tool result
    for m in messages:
        converted = False
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
            for c in m["tool_calls"]:
                if isinstance(c.get("id"), str):
                    names[c["id"]] = c["function"]["name"]
            text = _text(m.get("content"))
            m = {"role": "assistant",
                 "content": (text + "\n" if text else "") + json.dumps({JSON_CALLS_KEY: calls}, ensure_ascii=False)}
        elif m["role"] == "tool":
            name = names.get(m.get("tool_call_id"), m.get("name") or "the tool")
            m = {"role": "user", "content": f"Result of {name}:\n{_text(m.get('content'))}"}
            converted = True
        if out and (converted or from_tool) and out[-1]["role"] == m["role"] == "user":
            # Results of several calls (or a result and a question) form one user turn: templates that insist on
            # alternating roles (Gemma 3's) accept that.
            out[-1] = {"role": "user", "content": _text(out[-1]["content"]) + "\n\n" + _text(m["content"])}
            from_tool = True
        else:
            out.append(m)
            from_tool = converted
    if plan is not None:
        declared = JSON_INSTRUCTION + json.dumps(plan.tools, ensure_ascii=False, indent=1)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": _text(out[0]["content"]) + "\n\n" + declared}
        else:
            out.insert(0, {"role": "system", "content": declared})
    return out


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


# ---------------------------------------------------------------------------------------------------------------
# The answer side


def tool_message(plan: ToolPlan, text: str, finish: str) -> tuple[dict, str]:
    """(the chat message, finish_reason) of a whole answer."""
    parsed = plan.parse(text)
    calls = [{"id": new_call_id(), "type": "function",
              "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]
    msg = {"role": "assistant", "content": parsed.content if parsed.content or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    return msg, "tool_calls" if calls and finish == "stop" else finish


class ToolStream:
    """One streamed choice: text pieces in, chat.completion.chunk deltas out."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.calls = 0          # tool_calls started (the next one's index)
        self.completed = 0
        self._parser = GemmaCallParser(plan.hide) if plan.native else None
        self._held = ""         # json format: an answer that may be a call object is read to its end
        self._deciding = True

    def push(self, text: str) -> list[dict]:
        if self._parser is not None:
            return self._deltas(self._parser.push(text))
        if self._deciding:
            self._held += text
            stripped = self._held.lstrip()
            if not stripped:
                return []
            self._deciding = False
            if stripped.startswith("{"):
                return []
            text, self._held = self._held, ""
            return [{"content": text}]
        if self._held:
            self._held += text
            return []
        return [{"content": text}] if text else []

    def finish(self) -> list[dict]:
        if self._parser is not None:
            return self._deltas(self._parser.finish())
        held, self._held = self._held, ""
        if not held:
            return []
        parsed = parse_json_convention(held)
        events = [("content", parsed.content)] if parsed.content else []
        for c in parsed.calls:
            events += [("call", c.name), ("args", c.arguments), ("end", None)]
        return self._deltas(events)

    def _deltas(self, events) -> list[dict]:
        out = []
        for kind, value in events:
            if kind == "content" or kind == "bad":
                out.append({"content": value})
            elif kind == "call":
                out.append({"tool_calls": [{"index": self.calls, "id": new_call_id(), "type": "function",
                                            "function": {"name": value, "arguments": ""}}]})
                self.calls += 1
            elif kind == "args":
                out.append({"tool_calls": [{"index": self.calls - 1, "function": {"arguments": value}}]})
            elif kind == "end":
                self.completed += 1
        return out

    def finish_reason(self, finish: str) -> str:
        return "tool_calls" if self.completed and finish == "stop" else finish
