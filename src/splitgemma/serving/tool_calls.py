"""Gemma 4's native tool-call syntax: parsing it (whole or as a stream) into OpenAI-shaped calls, and the JSON-in-text
convention for models that have no tool format of their own.

The syntax (the chat template's, docs/tools.md): the model writes

    <|tool_call>call:NAME{key:<|"|>text<|"|>,n:3,flag:true,obj:{k:<|"|>v<|"|>},list:[1,2]}<tool_call|>

one block per call, several concatenated, then `<|tool_response>` (a stop token). Keys are bare, strings sit between
`<|"|>` delimiters with no escaping inside, numbers, true/false/null are bare. The text is the decode worker's with
special tokens included (the markers are special tokens); the gateway asks for it so whenever tools are in play.

GemmaCallParser is incremental: push() text pieces as they arrive (split anywhere, even inside a marker), and it
returns events: ("content", text), ("call", name) when a call's name is complete, ("args", json_text) pieces that
concatenate to the call's arguments as JSON, ("end", None) when the call is closed. A call that turns out malformed
(possible only without a constraint) becomes ("bad", raw_text) from where it stopped making sense: the text of the
whole call as the model wrote it, for the caller to put into content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

CALL_OPEN = "<|tool_call>"
CALL_CLOSE = "<tool_call|>"
STRING_DELIM = '<|"|>'
TOOL_RESPONSE = "<|tool_response>"
# OpenAI's rule for function names; the template writes the name bare, so nothing else can be parsed back.
NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_NUMBER_RE = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS = {"true", "false", "null"}
_BARE_CHARS = re.compile(r"[A-Za-z0-9_.+\-]")


class ToolSyntaxError(ValueError):
    pass


# ---------------------------------------------------------------------------------------------------------------
# Gemma value syntax → JSON text, one character at a time


class _ArgsConverter:
    """Turns the `{…}` after `call:NAME` into JSON text as it arrives. feed(ch) returns the JSON text it can commit
    to (never taken back); raises ToolSyntaxError on the first character that cannot continue a value. `done` is
    true once the outer object is closed."""

    def __init__(self):
        # Stack of containers: ["obj", state] with state first|key|bkey|qkey|colon|value|next, or ["arr", state]
        # first|value|next ("first": just opened, so it may close at once).
        self.stack: list[list[str]] = []
        self.done = False
        self.in_string = False
        self.key: list[str] | None = None      # a bare key being read
        self.bare: list[str] | None = None     # a number or literal being read
        self.pending = ""                      # delimiter prefix seen inside a string or where a value may start

    def feed(self, text: str) -> str:
        out = []
        for ch in text:
            out.append(self._char(ch))
        return "".join(out)

    def _char(self, ch: str) -> str:
        if self.done:
            raise ToolSyntaxError("text after the arguments' closing brace")
        if self.in_string:
            self.pending += ch
            if STRING_DELIM.startswith(self.pending):
                if self.pending == STRING_DELIM:
                    self.pending = ""
                    self.in_string = False
                    return '"' + self._after_value()
                return ""
            text, self.pending = self.pending, ""
            # The held text was not a delimiter; its first char is body, the rest may start one again.
            first, rest = text[0], text[1:]
            out = json.dumps(first, ensure_ascii=False)[1:-1]
            return out + "".join(self._char(c) for c in rest) if rest else out
        if self.key is not None:
            return self._key_char(ch)
        if self.pending:  # a `<|"|>` opening a string value or a quoted key
            self.pending += ch
            if not STRING_DELIM.startswith(self.pending):
                raise ToolSyntaxError(f"unexpected {self.pending!r}")
            if self.pending != STRING_DELIM:
                return ""
            self.pending = ""
            top = self.stack[-1]
            if top[0] == "obj" and top[1] in ("first", "key"):
                self.key = []
                self.in_string = False
                top[1] = "qkey"
                return '"'
            self.in_string = True
            return '"'
        if self.bare is not None:
            if _BARE_CHARS.match(ch):
                self.bare.append(ch)
                return ""
            out = self._end_bare()
            return out + self._char(ch)
        if not self.stack:
            if ch.isspace():
                return ""
            if ch != "{":
                raise ToolSyntaxError("the arguments must be an object")
            self.stack.append(["obj", "first"])
            return "{"
        top = self.stack[-1]
        if ch.isspace():
            return ""
        kind, state = top
        if kind == "obj" and state in ("first", "key"):
            if ch == "}" and state == "first":
                return self._close("obj")
            if ch == "<":
                self.pending = "<"
                return ""
            if _BARE_CHARS.match(ch):
                self.key = [ch]
                top[1] = "bkey"
                return '"' + json.dumps(ch)[1:-1]
            raise ToolSyntaxError(f"unexpected {ch!r} where a key belongs")
        if kind == "obj" and state == "colon":
            if ch != ":":
                raise ToolSyntaxError(f"unexpected {ch!r} after a key")
            top[1] = "value"
            return ":"
        if state in ("value", "first"):
            return self._value_start(ch, state == "first")
        if state == "next":
            if ch == ",":
                top[1] = "key" if kind == "obj" else "value"
                return ","
            if (ch == "}" and kind == "obj") or (ch == "]" and kind == "arr"):
                return self._close(kind)
            raise ToolSyntaxError(f"unexpected {ch!r} after a value")
        raise ToolSyntaxError(f"unexpected {ch!r}")

    def _key_char(self, ch: str) -> str:
        top = self.stack[-1]
        if top[1] == "qkey":  # <|"|>key<|"|>: the body ends at the delimiter
            self.pending += ch
            if STRING_DELIM.startswith(self.pending):
                if self.pending == STRING_DELIM:
                    self.pending, self.key = "", None
                    top[1] = "colon"
                    return '"'
                return ""
            text, self.pending = self.pending, ""
            out = json.dumps(text[0], ensure_ascii=False)[1:-1]
            return out + "".join(self._key_char(c) for c in text[1:])
        if _BARE_CHARS.match(ch):
            self.key.append(ch)
            return json.dumps(ch)[1:-1]
        self.key = None
        top[1] = "colon"
        return '"' + self._char(ch)

    def _value_start(self, ch: str, first: bool) -> str:
        if ch == "{":
            self.stack.append(["obj", "first"])
            return "{"
        if ch == "[":
            self.stack.append(["arr", "first"])
            return "["
        if ch == "]" and first:
            return self._close("arr")  # an empty list (after a comma it would be a trailing comma)
        if ch == "<":
            self.pending = "<"
            return ""
        if _BARE_CHARS.match(ch):
            self.bare = [ch]
            return ""
        raise ToolSyntaxError(f"unexpected {ch!r} where a value belongs")

    def _end_bare(self) -> str:
        text, self.bare = "".join(self.bare), None
        if text not in _LITERALS and not _NUMBER_RE.fullmatch(text):
            raise ToolSyntaxError(f"{text!r} is not a number, true, false or null (strings need <|\"|>)")
        return text + self._after_value()

    def _after_value(self) -> str:
        self.stack[-1][1] = "next"
        return ""

    def _close(self, kind: str) -> str:
        self.stack.pop()
        if not self.stack:
            self.done = True
            return "}" if kind == "obj" else "]"
        self.stack[-1][1] = "next"
        return "}" if kind == "obj" else "]"

    def finish(self) -> str:
        """At the end of the call: a number or literal still being read ends here."""
        if self.bare is not None:
            return self._end_bare()
        return ""


def gemma_to_json(text: str) -> str:
    """The JSON text of one Gemma-syntax object `{…}` (raises ToolSyntaxError)."""
    conv = _ArgsConverter()
    out = conv.feed(text) + conv.finish()
    if not conv.done:
        raise ToolSyntaxError("the arguments are not closed")
    return out


def render_gemma_value(value) -> str:
    """A JSON value in Gemma's syntax, as the chat template's format_argument writes it (keys bare and sorted)."""
    if isinstance(value, str):
        return STRING_DELIM + value + STRING_DELIM
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{render_gemma_value(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, list):
        return "[" + ",".join(render_gemma_value(v) for v in value) + "]"
    return json.dumps(value)


# ---------------------------------------------------------------------------------------------------------------
# The call blocks in a stream of text


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass
class ParsedMessage:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)
    incomplete: bool = False  # the text ended inside a call


class GemmaCallParser:
    """Incremental parser of model output that may hold native tool calls (see the module docstring).

    `hide` are strings dropped from content (the text of special tokens, when the client asked for special tokens
    to be skipped); inside a call the text is read as it is."""

    def __init__(self, hide: Iterable[str] = ()):
        self._hide = sorted({h for h in hide if h and h != CALL_OPEN}, key=len, reverse=True)
        self._watch = [CALL_OPEN, *self._hide]
        self._held = ""
        self._mode = "content"   # content | header | args | close
        self._raw = ""           # the current call's text as written, for when it goes bad
        self._header = ""
        self._conv: _ArgsConverter | None = None

    def push(self, text: str) -> list[tuple[str, str | None]]:
        events: list[tuple[str, str | None]] = []
        text = self._held + text
        self._held = ""
        i = 0
        while i < len(text):
            if self._mode == "content":
                i = self._content(text, i, events)
            else:
                i = self._in_call(text, i, events)
        return _merge(events)

    def finish(self) -> list[tuple[str, str | None]]:
        """The end of the output: held text is released; a call still open goes bad."""
        events: list[tuple[str, str | None]] = []
        held, self._held = self._held, ""
        if self._mode == "content":
            if held:
                events.append(("content", held))
        else:
            self._raw += held
            events.append(("bad", self._raw))
            self._mode = "content"
        return _merge(events)

    def _content(self, text: str, i: int, events) -> int:
        j = text.find("<", i)
        if j < 0:
            events.append(("content", text[i:]))
            return len(text)
        if j > i:
            events.append(("content", text[i:j]))
        rest = text[j:]
        for w in self._watch:
            if rest.startswith(w):
                if w == CALL_OPEN:
                    self._mode, self._raw, self._header = "header", CALL_OPEN, ""
                return j + len(w)
        if any(w.startswith(rest) for w in self._watch):
            self._held = rest  # may be the start of a marker: wait for more
            return len(text)
        events.append(("content", "<"))
        return j + 1

    def _in_call(self, text: str, i: int, events) -> int:
        ch = text[i]
        self._raw += ch
        try:
            if self._mode == "header":
                if ch == "{":
                    if not self._header.startswith("call:") or not NAME_RE.fullmatch(self._header[5:]):
                        raise ToolSyntaxError(f"a call must start with call:NAME, got {self._header[:80]!r}")
                    events.append(("call", self._header[5:]))
                    self._conv = _ArgsConverter()
                    self._mode = "args"
                    events.append(("args", self._conv.feed("{")))
                else:
                    self._header += ch
                    if len(self._header) > 5 + 64 or not "call:".startswith(self._header[:5]):
                        raise ToolSyntaxError(f"a call must start with call:NAME, got {self._header[:80]!r}")
            elif self._mode == "args":
                piece = self._conv.feed(ch)
                if piece:
                    events.append(("args", piece))
                if self._conv.done:
                    self._mode, self._header = "close", ""
            else:  # close: whitespace, then <tool_call|>
                if ch.isspace() and not self._header:
                    return i + 1
                self._header += ch
                if not CALL_CLOSE.startswith(self._header):
                    raise ToolSyntaxError("a call's arguments must be followed by <tool_call|>")
                if self._header == CALL_CLOSE:
                    events.append(("end", None))
                    self._mode = "content"
        except ToolSyntaxError:
            events.append(("bad", self._raw))
            self._mode = "content"
        return i + 1


def _merge(events):
    out: list[tuple[str, str | None]] = []
    for kind, value in events:
        if kind in ("content", "args") and value == "":
            continue
        if out and out[-1][0] == kind and kind in ("content", "args"):
            out[-1] = (kind, out[-1][1] + value)
        else:
            out.append((kind, value))
    return out


def collect(events: Iterable[tuple[str, str | None]], message: ParsedMessage | None = None) -> ParsedMessage:
    """Folds parser events into a message: content text and the calls that closed. A call that went bad is dropped
    and its text goes to content; a call still open at the end marks the message incomplete."""
    msg = message or ParsedMessage("")
    for kind, value in events:
        if kind == "content":
            msg.content += value
        elif kind == "call":
            msg.calls.append(ParsedCall(value, ""))
            msg.incomplete = True
        elif kind == "args":
            msg.calls[-1].arguments += value
        elif kind == "end":
            msg.incomplete = False
        elif kind == "bad":
            if msg.incomplete:
                msg.calls.pop()
                msg.incomplete = False
            msg.content += value
    return msg


def parse_gemma_output(text: str, hide: Iterable[str] = ()) -> ParsedMessage:
    """The whole output at once: content and calls."""
    p = GemmaCallParser(hide)
    return collect([*p.push(text), *p.finish()])


# ---------------------------------------------------------------------------------------------------------------
# JSON-in-text convention (models without a native tool format): the answer is either text or exactly
#   {"tool_calls": [{"name": NAME, "arguments": {…}}, …]}

JSON_CALLS_KEY = "tool_calls"


def parse_json_convention(text: str) -> ParsedMessage:
    """Text that is one JSON object of the convention's shape becomes calls; anything else is content."""
    stripped = text.strip()
    if not stripped.startswith("{"):
        return ParsedMessage(text)
    try:
        data = json.loads(stripped)
    except ValueError:
        return ParsedMessage(text)
    calls = data.get(JSON_CALLS_KEY) if isinstance(data, dict) and set(data) == {JSON_CALLS_KEY} else None
    if not isinstance(calls, list) or not calls:
        return ParsedMessage(text)
    out = []
    for c in calls:
        if not (isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments"), dict)):
            return ParsedMessage(text)
        out.append(ParsedCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)))
    return ParsedMessage("", out)


# ---------------------------------------------------------------------------------------------------------------
# Grammars (llguidance's Lark dialect) that admit exactly well-formed calls to the declared tools

@dataclass(frozen=True)
class MarkerIds:
    """The ids of the special tokens the syntax uses (looked up in the model's tokenizer)."""

    call_open: int
    call_close: int
    string_delim: int
    tool_response: int | None = None  # the model ends its calls with it (a stop token); None if the vocab lacks it

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "MarkerIds | None":
        """None when the tokenizer lacks a marker: the model has no native call syntax."""
        ids = [tokenizer.token_to_id(t) for t in (CALL_OPEN, CALL_CLOSE, STRING_DELIM)]
        if any(i is None for i in ids):
            return None
        return cls(*ids, tokenizer.token_to_id(TOOL_RESPONSE))


# A string body is any text but the delimiter's own spelling (the parser reads text, where plain tokens spelling
# `<|"|>` would close the string); free text under tool_choice auto likewise never spells a call's opening marker.
_ANY = "/(?s:.*)/"
_TERMINALS = f"""
STR: {_ANY} & ~/(?s:.*)<\\|"\\|>(?s:.*)/
TEXT: {_ANY} & ~/(?s:.*)<\\|tool_call>(?s:.*)/
INT: /-?(0|[1-9][0-9]*)/
NUM: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/
KEY: /[A-Za-z0-9_.+\\-]+/
"""
_BARE_KEY = re.compile(r"[A-Za-z0-9_.+\-]+")


class _Grammar:
    """Compiles JSON schemas into Lark rules over Gemma's value syntax. Enforced: type (and lists of types),
    properties with required (keys in sorted order, as the template writes them; no others), items, minItems 1,
    enum, const, anyOf/oneOf, nullable. Not enforced: string formats and patterns, numeric ranges, lengths
    (docs/tools.md)."""

    def __init__(self, ids: MarkerIds):
        self.d = f"<[{ids.string_delim}]>"
        self.rules: list[str] = []
        self.n = 0
        self._generic: str | None = None

    def rule(self, body: str, name: str | None = None) -> str:
        if name is None:
            self.n += 1
            name = f"r{self.n}"
        self.rules.append(f"{name}: {body}")
        return name

    def literal(self, value) -> str:
        """A constant JSON value as a Lark sequence."""
        if isinstance(value, str):
            return f"{self.d} {json.dumps(value)} {self.d}" if value else f"{self.d} {self.d}"
        if isinstance(value, dict):
            parts = ['"{"']
            for i, (k, v) in enumerate(sorted(value.items())):
                parts += (['","'] if i else []) + [self.key(k), '":"', self.literal(v)]
            return " ".join(parts + ['"}"'])
        if isinstance(value, list):
            parts = ['"["']
            for i, v in enumerate(value):
                parts += (['","'] if i else []) + [self.literal(v)]
            return " ".join(parts + ['"]"'])
        return json.dumps(render_gemma_value(value))

    def key(self, k: str) -> str:
        return json.dumps(k) if _BARE_KEY.fullmatch(k) else f"{self.d} {json.dumps(k)} {self.d}"

    def generic(self) -> str:
        if self._generic is None:
            self._generic = "gvalue"
            self.rule(f'{self.d} STR {self.d} | NUM | "true" | "false" | "null" | gobject | garray', "gvalue")
            self.rule('"{" "}" | "{" gmember ("," " "? gmember)* "}"', "gobject")
            self.rule(f'(KEY | {self.d} STR {self.d}) ":" " "? gvalue', "gmember")
            self.rule('"[" "]" | "[" gvalue ("," " "? gvalue)* "]"', "garray")
        return self._generic

    def value(self, schema) -> str:
        if schema is True or schema == {} or not isinstance(schema, dict):
            return self.generic()
        alts: list[str] = []
        if "const" in schema:
            alts.append(self.literal(schema["const"]))
        elif "enum" in schema and isinstance(schema["enum"], list) and schema["enum"]:
            alts += [self.literal(v) for v in schema["enum"]]
        elif isinstance(schema.get("anyOf") or schema.get("oneOf"), list):
            alts += [self.value(s) for s in schema.get("anyOf") or schema.get("oneOf")]
        else:
            types = schema.get("type")
            if types is None:
                return self.generic()
            for t in types if isinstance(types, list) else [types]:
                alts.append(self._typed(t, schema))
        if schema.get("nullable"):
            alts.append('"null"')
        return self.rule(" | ".join(f"({a})" for a in alts))

    def _typed(self, t: str, schema: dict) -> str:
        if t == "string":
            return f"{self.d} STR {self.d}"
        if t == "integer":
            return "INT"
        if t == "number":
            return "NUM"
        if t == "boolean":
            return '"true" | "false"'
        if t == "null":
            return '"null"'
        if t == "array":
            item = self.value(schema.get("items", True))
            more = f'{item} ("," " "? {item})*'
            return f'"[" {more} "]"' if schema.get("minItems", 0) >= 1 else f'"[" "]" | "[" {more} "]"'
        if t == "object":
            return self.object(schema)
        raise ToolSyntaxError(f"unknown JSON schema type {t!r}")

    def object(self, schema: dict) -> str:
        props = schema.get("properties")
        if not isinstance(props, dict) or not props:
            return self.generic() if schema.get("additionalProperties", True) is not False else '"{" "}"'
        required = set(schema.get("required") or [])
        keys = sorted(props)
        # tail(i, comma): the members from key i on, with a comma before the first one when `comma`. Two rules per
        # key keep the grammar linear in the number of properties however many are optional.
        names = {}
        for i in range(len(keys), -1, -1):
            for comma in (False, True):
                if i == len(keys):
                    names[i, comma] = self.rule('""')
                    continue
                member = f'{self.key(keys[i])} ":" " "? {self.value(props[keys[i]])}'
                with_it = ('"," " "? ' if comma else "") + f"{member} {names[i + 1, True]}"
                body = with_it if keys[i] in required else f"{with_it} | {names[i + 1, comma]}"
                names[i, comma] = self.rule(body)
        return f'"{{" {names[0, False]} "}}"'


def gemma_tools_lark(tools: list[dict], ids: MarkerIds, *, required: bool, parallel: bool) -> str:
    """A grammar over the model's output: `tools` are OpenAI function definitions ({name, parameters}).
    required: one call or more (several only when `parallel`), nothing else; otherwise free text, or text that
    opens a call, which then must be well formed (tool_choice auto)."""
    g = _Grammar(ids)
    alts = []
    for tool in tools:
        args = g.object(tool.get("parameters") or {"type": "object"})
        alts.append(f"{json.dumps(tool['name'])} {args}")
    g.rule(f'<[{ids.call_open}]> "call:" ({" | ".join(f"({a})" for a in alts)}) <[{ids.call_close}]>', "call")
    calls = "call+" if parallel else "call"
    if ids.tool_response is not None:
        calls += f" <[{ids.tool_response}]>"
    g.rule(calls, "calls")
    start = "start: calls" if required else "start: TEXT | TEXT calls"
    return "\n".join(["%llguidance {}", start, *g.rules, _TERMINALS.strip()]) + "\n"


def json_convention_schema(tools: list[dict], *, parallel: bool) -> dict:
    """The JSON schema of a convention answer that calls the given tools."""
    one = [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": _closed(t.get("parameters"))},
            "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    calls = {"type": "array", "items": {"anyOf": one} if len(one) > 1 else one[0], "minItems": 1}
    if not parallel:
        calls["maxItems"] = 1
    return {"type": "object", "properties": {JSON_CALLS_KEY: calls}, "required": [JSON_CALLS_KEY],
            "additionalProperties": False}


def _closed(params: dict | None) -> dict:
    """A function's parameters with no keys beyond the declared ones, as the native grammar has them."""
    params = dict(params or {"type": "object"})
    if params.get("properties") and "additionalProperties" not in params:
        params["additionalProperties"] = False
    return params


def json_convention_lark(tools: list[dict], *, parallel: bool) -> str:
    """tool_choice auto under the convention: free text that does not start with `{`, or a call object."""
    schema = json.dumps(json_convention_schema(tools, parallel=parallel))
    return f'%llguidance {{}}\nstart: "" | FREE | calls\nFREE: /[^{{\\s](?s:.*)/\ncalls: %json {schema}\n'
