"""Shared by tests/test_tools*.py: the tools declared in the tests, the chat fixture's tokenizer in a form llguidance
reads, a sampler that walks a grammar by picking random allowed tokens, and a model folder that serves the
random-weight fixture model with the Gemma 4 control tokens (the chat fixture's tokenizer beside it)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

FIX = Path(__file__).resolve().parents[1] / "fixtures"
CHAT = FIX / "chat"
TOKENIZER = CHAT / "tokenizer.json"
TEMPLATE = CHAT / "chat-template-e2b.jinja"
MODEL = FIX / "fastgemma" / "mini-e2b-tame" / "mini-e2b-tame.fgm"

# The fixture tokenizer's vocabulary has the letters of these names and strings, and the digits 1, 2 and 5.
WEATHER = {"name": "get_current_weather", "description": "Gets the current weather in a given location.",
           "parameters": {"type": "object", "properties": {
               "location": {"type": "string", "description": "City and country, e.g. Tokyo, JP"},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}
EVENT = {"name": "create_event", "description": "Creates a calendar event.",
         "parameters": {"type": "object", "properties": {
             "title": {"type": "string"},
             "attendees": {"type": "array", "items": {"type": "string"}},
             "hours": {"type": "number"},
             "private": {"type": "boolean"},
             "place": {"type": "object", "properties": {"room": {"type": "string"}, "floor": {"type": "integer"}},
                       "required": ["room"]}},
             "required": ["title", "hours"]}}
# A name that is a prefix of another: both must stay reachable.
GET = {"name": "get", "description": "Gets a thing.",
       "parameters": {"type": "object", "properties": {"what": {"type": "string"}}, "required": ["what"]}}
TOOLS = [WEATHER, EVENT, GET]


def openai_tools(functions=TOOLS) -> list[dict]:
    return [{"type": "function", "function": f} for f in functions]


def schema_of(name: str) -> dict:
    return next(t["parameters"] for t in TOOLS if t["name"] == name)


def tokenizer_json() -> str:
    """The chat fixture's tokenizer.json with Gemma's own decoder (each "▁" a space, byte fallback) in place of its
    Metaspace one, which llguidance cannot read: encoding is unchanged, and a token's text is its bytes, as with the
    real Gemma tokenizer."""
    data = json.loads(TOKENIZER.read_text())
    data["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}]}
    return json.dumps(data, ensure_ascii=False)


def chat_tokenizer() -> Tokenizer:
    return Tokenizer.from_str(tokenizer_json())


def ll_tokenizer():
    import llguidance

    tok = chat_tokenizer()
    return llguidance.LLTokenizer(tokenizer_json(), eos_token=tok.token_to_id("<eos>"))


def matcher(lltok, grammar: str):
    import llguidance

    m = llguidance.LLMatcher(lltok, grammar)
    assert not m.is_error(), m.get_error()
    return m


def accepts(lltok, grammar: str, text: str) -> bool:
    """The grammar admits `text` (special tokens in it as their ids) as a whole output."""
    m = matcher(lltok, grammar)
    ids = lltok.tokenize_str(text, parse_special=True)
    if m.validate_tokens(ids) != len(ids):  # (validate_tokens only looks ahead; consume_tokens advances)
        return False
    assert m.consume_tokens(ids), m.get_error()
    return m.is_accepting()


def sample(lltok, grammar: str, rng: random.Random, prefer: set[int], max_steps: int = 400) -> list[int]:
    """Token ids drawn at random from what the grammar allows at each step, a token of `prefer` (closing syntax)
    with probability 1/2 when one is allowed, so that walks end; until the grammar stops or only EOS is left."""
    m = matcher(lltok, grammar)
    out = []
    for _ in range(max_steps):
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[:lltok.vocab_size])
        assert len(allowed), m.get_error()
        closing = [int(t) for t in allowed if int(t) in prefer]
        token = rng.choice(closing) if closing and rng.random() < 0.5 else int(rng.choice(allowed))
        if token == lltok.eos_token:
            return out
        assert m.consume_token(token), m.get_error()
        out.append(token)
        if m.is_stopped():
            return out
    raise AssertionError(f"no end after {max_steps} tokens")


def model_folder(folder: Path) -> Path:
    """The fixture model with the chat tokenizer beside it and Gemma 4's stop tokens (<eos>, <turn|>,
    <|tool_response>) in the fixture vocabulary's ids; returns the .fgm path."""
    tok = chat_tokenizer()
    folder.mkdir(parents=True, exist_ok=True)
    model = folder / MODEL.name
    model.symlink_to(MODEL)
    (folder / "tokenizer.json").write_text(tokenizer_json())
    stops = [tok.token_to_id(t) for t in ("<eos>", "<turn|>", "<|tool_response>")]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    return model


def gemma4_stack(folder: Path):
    """A decode + prefill + gateway stack (test_gateway.Stack) serving model_folder's model with Gemma 4's chat
    template."""
    from test_gateway import Stack

    return Stack(folder, model=model_folder(folder / "model"), gateway_args=("--chat-template", str(TEMPLATE)))
