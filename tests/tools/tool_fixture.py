"""Shared by tests/test_tools*.py: the tools declared in the tests, an llguidance tokenizer for the chat fixture's
tokenizer.json, a sampler that walks a grammar by picking random allowed tokens, and a model folder that serves the
random-weight fixture model with the Gemma 4 control tokens (the chat fixture's tokenizer beside it)."""

from __future__ import annotations

import json
import random
import shutil
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


def chat_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER))


def ll_tokenizer(tok: Tokenizer):
    """llguidance's tokenizer for `tok`. llguidance cannot read the Metaspace decoder of the fixture's tokenizer.json,
    so it is given each token's bytes ("▁" is a space) and an encoder that, like the chat template's, encodes text
    as it is encoded in the middle of a prompt (no prefix space)."""
    import llguidance

    newline = tok.encode("\n", add_special_tokens=False).ids

    class Wrapped:
        eos_token_id = tok.token_to_id("<eos>")
        bos_token_id = tok.token_to_id("<bos>")
        tokens = [tok.id_to_token(i).replace("\u2581", " ").encode() for i in range(tok.get_vocab_size())]
        special_token_ids = sorted(tok.get_added_tokens_decoder())

        def __call__(self, text):
            text = text.decode() if isinstance(text, bytes) else text
            return tok.encode("\n" + text, add_special_tokens=False).ids[len(newline):]

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapped()))


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
    shutil.copy(TOKENIZER, folder / "tokenizer.json")
    stops = [tok.token_to_id(t) for t in ("<eos>", "<turn|>", "<|tool_response>")]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    return model
