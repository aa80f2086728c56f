"""Incremental detokenization with stop strings, for token streams.

TextStream turns one sequence's generated token ids into text pieces as they arrive:

* Pieces never split a UTF-8 character: text that ends in an incomplete character (U+FFFD from the bytes of a
  character spread over several byte-fallback tokens) is held back until a later token completes it. Bytes that can
  never form a character (a lead byte followed by a plain token) come out as U+FFFD (a whole decode turns every byte
  token of such a run into U+FFFD, valid ones before it included; the stream has released those already);
  tokenizers' own DecodeStream raises "Invalid prefix" there and ended the stream, so the stream decodes the ids
  itself, by the prefix/read offsets TGI and vLLM use: the ids since the last piece are decoded together with the
  piece before them, so the separators and spaces the decoder puts between tokens come out as in a whole decode.
* The pieces concatenate to ``tokenizer.decode(ids, skip_special_tokens=...)`` of the ids pushed: special tokens
  (<unk>, <bos>, control tokens) are skipped by default, as OpenAI-style servers do; a caller that needs them (e.g.
  to see markers the model emits) asks for them. The model's stop tokens are never pushed.
* Stop strings are matched on the decoded text, across piece boundaries. Text that could be the start of a stop
  string is held back until it either completes the stop string (then the match and everything after it are
  dropped, or with include_stop, vLLM's include_stop_str_in_output, the match is kept and what follows dropped) or
  can no longer match (then it is released with a later piece, or by flush()).
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stops: Iterable[str] = (), skip_special_tokens: bool = True,
                 include_stop: bool = False):
        self._tokenizer = tokenizer
        self._include_stop = include_stop
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        # ids[_prefix:_read] is the last piece released; ids[_read:] have not been released yet.
        self._prefix = self._read = 0
        self._stops = sorted({s for s in stops if s}, key=len, reverse=True)
        self._held = ""

    def push(self, token_id: int) -> tuple[str, str | None]:
        """Feed one token. Returns (text released now, the stop string matched or None). After a match the
        stream is finished: the caller stops feeding it."""
        self._ids.append(token_id)
        piece = self._next_piece(final=False)
        if not self._stops:
            return piece, None
        text = self._held + piece
        match = None
        for s in self._stops:  # longest first, so at equal positions the longer stop string wins
            i = text.find(s)
            if i >= 0 and (match is None or i < match[0]):
                match = (i, s)
        if match is not None:
            self._held = ""
            return text[: match[0] + (len(match[1]) if self._include_stop else 0)], match[1]
        keep = self._partial_match_len(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], None

    def flush(self) -> str:
        """Release the text held back (for a possible stop string, or an incomplete character): the sequence ended
        otherwise."""
        text, self._held = self._held + self._next_piece(final=True), ""
        return text

    def _next_piece(self, final: bool) -> str:
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""  # nothing new yet (a skipped special token), or a character still incomplete
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before):]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""

    def _partial_match_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
