"""Makes tests/fixtures/tools/renders.json: transformers' apply_chat_template(tokenize=False) of tool conversations
for the Gemma 4 template (tests/fixtures/chat), the expected renders of tests/test_tools.py. Not run by the tests.

Run once in a throwaway venv (python3 -m venv /tmp/tf && /tmp/tf/bin/pip install torch==2.13.0 transformers jinja2):
    /tmp/tf/bin/python tests/tools/make_tool_renders.py
Each case keeps the messages as an OpenAI client sends them (tool call arguments as JSON text); transformers is given
the same messages with the arguments as mappings, the form its templates take.
"""
import copy
import json
from pathlib import Path

import transformers
from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[1]
CHAT = ROOT / "fixtures" / "chat"
OUT = ROOT / "fixtures" / "tools" / "renders.json"

WEATHER = {"type": "function", "function": {
    "name": "get_current_weather", "description": "Gets the current weather in a given location.",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "City and country, e.g. Tokyo, JP"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}}
EVENT = {"type": "function", "function": {
    "name": "create_event", "description": "Creates a calendar event.",
    "parameters": {"type": "object", "properties": {
        "title": {"type": "string", "description": "What it is"},
        "attendees": {"type": "array", "items": {"type": "string"}, "description": "Who comes"},
        "hours": {"type": "number", "description": "How long"},
        "private": {"type": "boolean"},
        "place": {"type": "object", "properties": {"room": {"type": "string"}, "floor": {"type": "integer"}},
                  "required": ["room"]}},
        "required": ["title", "hours"]}}}
ASK = {"role": "user", "content": "What's the weather in Tokyo?"}


def call(id_, name, args):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


CASES = {
    "declarations": dict(messages=[{"role": "system", "content": "You are terse."}, ASK], tools=[WEATHER, EVENT]),
    "round_trip": dict(messages=[
        ASK,
        {"role": "assistant", "content": None,
         "tool_calls": [call("call_1", "get_current_weather", {"location": "Tokyo, JP", "unit": "celsius"})]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 15, "sky": "clear"}'},
        {"role": "assistant", "content": "It is 15 C and clear in Tokyo."},
        {"role": "user", "content": "Thanks"}], tools=[WEATHER]),
    "result_pending": dict(messages=[
        ASK,
        {"role": "assistant", "content": None,
         "tool_calls": [call("call_1", "get_current_weather", {"location": "Tokyo, JP"})]},
        {"role": "tool", "tool_call_id": "call_1", "content": "15 C, clear"}], tools=[WEATHER]),
    "parallel": dict(messages=[
        {"role": "user", "content": "Weather in Tokyo, and book a 1.5 hour meeting"},
        {"role": "assistant", "content": None, "tool_calls": [
            call("call_a", "get_current_weather", {"location": "Tokyo, JP"}),
            call("call_b", "create_event", {"title": "sync", "hours": 1.5, "attendees": ["ann", "bo"],
                                            "private": False, "place": {"room": "A", "floor": -2}})]},
        {"role": "tool", "tool_call_id": "call_a", "content": "15 C"},
        {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "booked"}]},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Thanks"}], tools=[WEATHER, EVENT]),
}


def for_transformers(messages):
    out = copy.deepcopy(messages)
    for m in out:
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return out


def main():
    template = (CHAT / "chat-template-e2b.jinja").read_text()
    hf = PreTrainedTokenizerFast(tokenizer_file=str(CHAT / "tokenizer.json"), bos_token="<bos>", eos_token="<eos>",
                                 unk_token="<unk>", pad_token="<pad>")
    out = {"transformers": transformers.__version__, "cases": {}}
    for name, case in CASES.items():
        text = hf.apply_chat_template(for_transformers(case["messages"]), tools=case["tools"], tokenize=False,
                                      add_generation_prompt=True, chat_template=template)
        out["cases"][name] = {**case, "text": text}
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
