"""Gemma 4's thought channel: what a thinking model writes before its answer, told apart from the answer.

With `enable_thinking` the chat template opens the system turn with `<|think|>`, and the model answers
`<|channel>thought\\n…<channel|>` and then its answer (docs/reasoning.md). `<|channel>` and `<channel|>` are special
tokens, so the split is made on token ids: text that merely spells a marker stays text. The template replays a past
turn's thought (a message's `reasoning` or `reasoning_content`) as `<|channel>thought\\n` + text + `\\n<channel|>`;
the splitter returns the text between those, so a thought goes back into the prompt as it came out.
"""

from __future__ import annotations

from dataclasses import dataclass

CHANNEL_OPEN = "<|channel>"
CHANNEL_CLOSE = "<channel|>"
THINKING_SWITCH = "enable_thinking"  # the template variable that turns thinking on

CHANNEL_NAME = "thought\n"  # the line a thought block opens with


@dataclass(frozen=True)
class ThoughtMarkers:
    open: int
    close: int

    @classmethod
    def from_tokenizer(cls, tokenizer, template_source: str) -> "ThoughtMarkers | None":
        """The markers when the tokenizer has both and the chat template writes thought blocks; else None (the model
        has no thought channel: Gemma 3, or a template that knows none)."""
        ids = [tokenizer.token_to_id(t) for t in (CHANNEL_OPEN, CHANNEL_CLOSE)]
        if any(i is None for i in ids) or CHANNEL_OPEN not in template_source:
            return None
        return cls(*ids)


class ThoughtSplitter:
    """One output, token by token (its id and its text as the decode worker sent it, special tokens included so
    that text held back before a marker comes out with the marker): pieces of thought and pieces of answer. Tokens
    from an opening marker to its closing one (both included) count as reasoning tokens; the markers' spelling and
    the name line ("thought" and a newline) are dropped; the newline before a closing marker is held back until the
    thought goes on, and dropped when it closes. `hide_thought` / `hide_answer`: special tokens (id -> spelling)
    whose spelling is dropped from that part (a request that skips special tokens; the answer's are left to the
    tool parser when it reads the answer)."""

    def __init__(self, markers: ThoughtMarkers, hide_thought: dict[int, str] | None = None,
                 hide_answer: dict[int, str] | None = None):
        self.markers = markers
        self.hide_thought = hide_thought or {}
        self.hide_answer = hide_answer or {}
        self.tokens = 0          # reasoning tokens so far
        self.seen = False        # a thought block was opened
        self._state = "answer"   # answer | name (reading the channel's name line) | thought
        self._name = ""
        self._newline = False    # a held "\n" at the thought's end so far

    def push(self, token_id: int, text: str) -> list[tuple[str, str]]:
        """(kind, text) pieces, kind "thought" or "answer", in order."""
        m = self.markers
        if token_id == m.open or (token_id == m.close and self._state != "answer"):
            # Text the decode worker held back (a possible stop string, a split character) comes out before the
            # marker's spelling, and belongs to what came before the marker.
            out = self._route(_unspelled(text, CHANNEL_OPEN if token_id == m.open else CHANNEL_CLOSE))
            self.tokens += 1
            if token_id == m.close:
                self._state, self._name, self._newline = "answer", "", False
            else:
                self.seen = True
                if self._state == "answer":
                    self._state, self._name = "name", ""
            return out
        if self._state != "answer":
            self.tokens += 1
        hide = self.hide_answer if self._state == "answer" else self.hide_thought
        return self._route(_unspelled(text, hide[token_id]) if token_id in hide else text)

    def _route(self, text: str) -> list[tuple[str, str]]:
        if not text:
            return []
        if self._state == "answer":
            return [("answer", text)]
        if self._state == "name":
            self._name += text
            if self._name.startswith(CHANNEL_NAME):
                self._state, rest, self._name = "thought", self._name[len(CHANNEL_NAME):], ""
                return self._thought(rest)
            if CHANNEL_NAME.startswith(self._name):
                return []  # the name line so far
            self._state, text, self._name = "thought", self._name, ""  # no name line: all of it is thought
        return self._thought(text)

    def _thought(self, text: str) -> list[tuple[str, str]]:
        if not text:
            return []
        out = "\n" + text if self._newline else text
        self._newline = out.endswith("\n")
        if self._newline:
            out = out[:-1]
        return [("thought", out)] if out else []

    def finish(self) -> list[tuple[str, str]]:
        """The held newline of a thought the output ended inside (the token limit, a stop); a name line cut off
        is only (part of) a name."""
        held, self._newline = self._newline and self._state == "thought", False
        return [("thought", "\n")] if held else []


def _unspelled(text: str, spelling: str) -> str:
    """A special token's text without its own spelling (which ends it when special tokens are kept)."""
    return text[:-len(spelling)] if text.endswith(spelling) else text
