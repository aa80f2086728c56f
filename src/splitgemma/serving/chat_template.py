"""The model's chat template: finding it, rendering it as transformers does, and encoding the result so that user
text cannot inject control tokens.

Finding: `--chat-template FILE` wins; otherwise beside the model file `<model>.chat_template.jinja`,
`chat_template.jinja`, then the "chat_template" entry of `tokenizer_config.json` (a string, or a list of
{name, template} of which "default" is used). A model without one has no chat endpoint (ChatTemplateNotFound).

Rendering uses the environment transformers' apply_chat_template uses, so a template renders the same text here:
a sandboxed jinja2 environment with trim_blocks/lstrip_blocks and loop controls, `tojson` without HTML escaping,
`raise_exception`, `strftime_now`, a `{% generation %}` tag (rendered as its body), and the tokenizer's special
token strings (bos_token, eos_token, …) as variables. tests/test_gateway.py checks the renders against transformers'
own outputs for the Gemma 4 template.

Control tokens (the tokenizer's special added tokens): the template writes them (`<|turn>`, `<turn|>`, …) and they
must map to their single ids, but the same strings inside message content (or tool definitions) are user text and
must be encoded as plain text. Added tokens that are not special (Gemma 3's newline, tab and space runs and HTML
tags) are ordinary text for the tokenizer, in messages as anywhere.
Before rendering, every control-token occurrence inside user-supplied strings is wrapped in two private-use
markers; after rendering, the text is encoded piece by piece: marked pieces with a tokenizer that has no added
tokens, the rest normally. String operations in the template that split a marked token (e.g. `split('<channel|>')`
in strip_thinking) leave lone markers, which are dropped but still separate the text on either side so that it
cannot join into a control token.

Cost: a template's cost need not be linear in the messages (Gemma 4's looks back over all earlier messages for each
one: quadratic), so a caller bounds the message count, and a RenderBudget bounds the rest: the render produces its
text piece by piece (jinja2's generate) and stops past `max_chars`, or as soon as `cancelled` is set (the client
went away), instead of running to its end.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from .files import read_regular_text
from .tokenizer import control_tokens

# Unicode noncharacters: never meaningful in text, so stripping them from user strings loses nothing.
_MARK_START = "\ufdd0"
_MARK_END = "\ufdd1"
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateNotFound(FileNotFoundError):
    pass


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (the template raised, or the input is malformed): a client error."""


class RenderTooLarge(ChatTemplateError):
    """The rendered prompt would exceed RenderBudget.max_chars."""


class RenderCancelled(Exception):
    """RenderBudget.cancelled was set: nobody waits for this prompt any more."""


@dataclass
class RenderBudget:
    max_chars: int
    cancelled: threading.Event | None = None

    def check(self, chars: int) -> None:
        if self.cancelled is not None and self.cancelled.is_set():
            raise RenderCancelled
        if chars > self.max_chars:
            raise RenderTooLarge(f"the messages render to a prompt of more than {self.max_chars} characters")


def find_chat_template(model_path: str | Path | None, explicit: str | Path | None = None) -> tuple[str, Path]:
    """(template source, where it came from) for the model, or ChatTemplateNotFound naming the places looked at."""
    if explicit is not None:
        p = Path(explicit)
        if not p.exists():
            raise ChatTemplateNotFound(f"chat template file {p} does not exist")
        return _read(p), p
    if model_path is None:
        raise ChatTemplateNotFound("no model path to look for a chat template beside; pass --chat-template FILE")
    model = Path(model_path)
    looked = [model.with_suffix(".chat_template.jinja"), model.parent / "chat_template.jinja"]
    for p in looked:
        if p.exists():
            return _read(p), p
    config = model.parent / "tokenizer_config.json"
    looked.append(config)
    if config.exists():
        template = _template_from_config(config)
        if template is not None:
            return template, config
    raise ChatTemplateNotFound("the model has no chat template (looked for " + ", ".join(map(str, looked))
                               + "); pass --chat-template FILE")


def _read(path: Path) -> str:
    try:
        return read_regular_text(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e


def _template_from_config(config: Path) -> str | None:
    text = _read(config)
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"cannot read {config}: {e}") from e
    template = data.get("chat_template") if isinstance(data, dict) else None
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def special_token_strings(tokenizer: Tokenizer, model_path: str | Path | None = None) -> dict[str, str]:
    """bos_token/eos_token/… for the template: from tokenizer_config.json beside the model when it names them,
    else the tokenizer's own `<bos>`/`<eos>`/`<unk>`/`<pad>` tokens when it has them."""
    found: dict[str, str] = {}
    if model_path is not None:
        config = Path(model_path).parent / "tokenizer_config.json"
        if config.exists():
            text = _read(config)
            try:
                data = json.loads(text)
            except ValueError as e:
                raise ValueError(f"cannot read {config}: {e}") from e
            for key in _SPECIAL_TOKEN_KEYS:
                value = data.get(key)
                if isinstance(value, dict):  # the serialised AddedToken form
                    value = value.get("content")
                if isinstance(value, str):
                    found[key] = value
    for key in _SPECIAL_TOKEN_KEYS:
        if key not in found:
            text = "<" + key.split("_")[0] + ">"
            if tokenizer.token_to_id(text) is not None:
                found[key] = text
    return found


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` marks assistant text for training masks in transformers; rendering
    only needs its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson escapes <, >, & and ' for HTML; chat templates want the plain JSON text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


# The variables the template is rendered with: chat_template_kwargs may not replace them (one would put tools into
# the prompt that the request's own `tools` field is refused for, another the messages or the BOS token).
RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                                *_SPECIAL_TOKEN_KEYS, *_environment().globals})


# continue_final_message: the last message's text gets this tag, the render is cut where the tag is, so that the
# model continues that message instead of closing it (an answer begun by the client). transformers' own tag and
# rule: cut at its last occurrence; if the template trimmed the tag's trailing space, the message's trailing
# whitespace went too (rstrip).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final(messages: list[dict]) -> list[dict]:
    if not messages:
        raise ChatTemplateError("continue_final_message needs a message to continue")
    final = dict(messages[-1])
    content = final.get("content")
    if isinstance(content, str):
        final["content"] = content + _CONTINUE_TAG
    elif isinstance(content, list):  # content parts: the last text part
        at = next((k for k in range(len(content) - 1, -1, -1)
                   if isinstance(content[k], dict) and isinstance(content[k].get("text"), str)), None)
        if at is None:
            raise ChatTemplateError("continue_final_message: the last message has no text part to continue")
        content = list(content)
        content[at] = {**content[at], "text": content[at]["text"] + _CONTINUE_TAG}
        final["content"] = content
    else:
        raise ChatTemplateError("continue_final_message: the last message has no content to continue")
    return [*messages[:-1], final]


def _cut_at_tag(text: str) -> str:
    at = text.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise ChatTemplateError("continue_final_message: the last message's text is not in the rendered prompt "
                                "(the chat template leaves it out or rewrites it)")
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


# Names a message's reasoning comes under; templates read different ones (Gemma 4: reasoning, reasoning_content).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict) -> dict:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class ChatTemplate:
    """A compiled chat template plus the tokenizer it renders for."""

    def __init__(self, source: str, tokenizer: Tokenizer, special_tokens: dict[str, str] | None = None):
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"invalid chat template (line {e.lineno}): {e.message}") from e
        self.source = source
        self.tokenizer = tokenizer
        self.special_tokens = dict(special_tokens or {})
        # The control tokens: the special added tokens (<bos>, turn markers, <unusedN>...), which the template may
        # write and the messages may not. An added token that is not special is text the tokenizer makes from text
        # (Gemma 3's whitespace runs "\n\n", "\t\t", its HTML tags: SentencePiece's user-defined pieces), so a
        # message writes it as transformers would encode it; counting those as control refused every chat message
        # with a newline on the default model.
        added = sorted(control_tokens(tokenizer).values(), key=len, reverse=True)
        self._control_re = re.compile("|".join(map(re.escape, added))) if added else None
        inner = self._control_re.pattern if self._control_re else "(?!)"
        self._pieces_re = re.compile(f"{_MARK_START}({inner}){_MARK_END}|[{_MARK_START}{_MARK_END}]")

    @classmethod
    def for_model(cls, tokenizer: Tokenizer, model_path: str | Path | None,
                  explicit: str | Path | None = None) -> "ChatTemplate":
        source, _ = find_chat_template(model_path, explicit)
        return cls(source, tokenizer, special_token_strings(tokenizer, model_path))

    # -- rendering ----------------------------------------------------------------------------------------------

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, tools: list[dict] | None = None,
               continue_final_message: bool = False, **kwargs: Any) -> str:
        """The prompt text exactly as transformers' apply_chat_template(tokenize=False) renders it."""
        return self._render(messages, tools, add_generation_prompt, kwargs, mark=False,
                            continue_final=continue_final_message)

    def encode(self, messages: list[dict], budget: RenderBudget | None = None, /, *, add_generation_prompt: bool = True,
               tools: list[dict] | None = None, continue_final_message: bool = False, **kwargs: Any) -> list[int]:
        """Token ids of the rendered prompt, with control-token text from user strings encoded as plain text.
        (`budget` is positional so that no template variable in kwargs can be taken for it.)"""
        text = self._render(messages, tools, add_generation_prompt, kwargs, mark=True, budget=budget,
                            continue_final=continue_final_message)
        if budget is not None:
            budget.check(len(text))  # a last look at `cancelled` before the tokenizer, which cannot be interrupted
        return self._encode_marked(text)

    def _render(self, messages, tools, add_generation_prompt, kwargs, *, mark: bool,
                budget: RenderBudget | None = None, continue_final: bool = False) -> str:
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ChatTemplateError("messages must be a list of objects")
        if continue_final and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set: the "
                                    "first continues the last message, the second starts a new one")
        taken = sorted(RESERVED_VARIABLES.intersection(kwargs))
        if taken:
            raise ChatTemplateError(f"template variables cannot be replaced: {', '.join(taken)}")
        messages = [_alias_reasoning(m) for m in messages]
        if continue_final:
            messages = _tag_final(messages)
        if mark:
            messages, tools, kwargs = self._mark(messages), self._mark(tools), self._mark(kwargs)
        variables = {**self.special_tokens, **kwargs}
        try:
            if budget is None:
                text = self._template.render(messages=messages, tools=tools, documents=None,
                                             add_generation_prompt=add_generation_prompt, **variables)
            else:
                pieces, chars = [], 0
                for piece in self._template.generate(messages=messages, tools=tools, documents=None,
                                                     add_generation_prompt=add_generation_prompt, **variables):
                    chars += len(piece)
                    budget.check(chars)
                    pieces.append(piece)
                text = "".join(pieces)
            return _cut_at_tag(text) if continue_final else text
        except RenderTooLarge:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            # A message shape the template does not expect (e.g. content of the wrong type).
            # (The exception's own text, without its class: the client gets what is wrong, not our internals.)
            raise ChatTemplateError(f"chat template cannot render these messages: {e}") from e

    def _mark(self, obj):
        if isinstance(obj, str):
            obj = obj.replace(_MARK_START, "").replace(_MARK_END, "")  # no forged markers
            if self._control_re is None:
                return obj
            return self._control_re.sub(lambda m: _MARK_START + m.group(0) + _MARK_END, obj)
        if isinstance(obj, dict):
            return {k: self._mark(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self._mark(v) for v in obj]
        return obj

    # -- encoding -----------------------------------------------------------------------------------------------

    @cached_property
    def _plain_tokenizer(self) -> Tokenizer:
        """The same tokenizer without its added tokens: encodes `<turn|>` as the text it is."""
        data = json.loads(self.tokenizer.to_str())
        data["added_tokens"] = []
        return Tokenizer.from_str(json.dumps(data))

    @cached_property
    def _newline_ids(self) -> list[int]:
        return self.tokenizer.encode("\n", add_special_tokens=False).ids

    def _encode_piece(self, tok: Tokenizer, piece: str) -> list[int]:
        # A piece from the middle of the prompt is encoded after a newline and the newline's ids removed again:
        # SentencePiece-style tokenizers add a prefix space at the start of an input, not in the middle of one.
        ids = tok.encode("\n" + piece, add_special_tokens=False).ids
        n = len(self._newline_ids)
        if ids[:n] == self._newline_ids:
            return ids[n:]
        return tok.encode(piece, add_special_tokens=False).ids

    def _encode_as_text(self, token: str) -> list[int]:
        """A control token's text from the messages as plain-text ids. Some vocabularies hold the token's string
        as an ordinary piece too (Gemma 4's `<|"|>`), which the plain tokenizer then produces: the text is then
        encoded in two parts that cannot join into it (the first split that works; the decoded text is the same).
        A model's answer that wrote such a string can so be sent back in a later turn."""
        own = self.tokenizer.token_to_id(token)
        ids = self._encode_piece(self._plain_tokenizer, token)
        if own is None or own not in ids:
            return ids
        for cut in range(1, len(token)):
            ids = self._encode_piece(self._plain_tokenizer, token[:cut]) + \
                self._encode_piece(self._plain_tokenizer, token[cut:])
            if own not in ids:
                return ids
        raise ChatTemplateError(f"cannot encode {token!r} from the messages as plain text: this tokenizer "
                                "produces the control token from every part of its text")

    def _encode_marked(self, text: str) -> list[int]:
        # split() with one group gives [text, marked token or None, text, marked token or None, ..., text].
        pieces = self._pieces_re.split(text)
        ids = self.tokenizer.encode(pieces[0], add_special_tokens=False).ids
        for i, piece in enumerate(pieces[1:], start=1):
            if not piece:
                continue
            if i % 2 == 1:
                piece_ids = self._encode_as_text(piece)
            else:
                piece_ids = self._encode_piece(self.tokenizer, piece)
            ids += piece_ids
        return ids
