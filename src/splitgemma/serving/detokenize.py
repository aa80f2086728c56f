"""Incremental detokenization with stop strings, for token streams.

TextStream turns one sequence's generated token ids into text pieces as they arrive:

* Pieces never split a UTF-8 character: the tokenizers library's DecodeStream holds back the bytes of a
  character spread over several byte-fallback tokens until it is complete.
* The pieces concatenate to ``tokenizer.decode(ids, skip_special_tokens=...)`` of the ids pushed: special tokens
  (<unk>, <bos>, control tokens) are skipped by default, as OpenAI-style servers do; a caller that needs them (e.g.
  to see markers the model emits) asks for them. The model's stop tokens are never pushed.
* Stop strings are matched on the decoded text, across piece boundaries. Text that could be the start of a stop
  string is held back until it either completes the stop string (then the match and everything after it are
  dropped) or can no longer match (then it is released with a later piece, or by flush()).
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stops: Iterable[str] = (), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._decoder = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stops = sorted({s for s in stops if s}, key=len, reverse=True)
        self._held = ""

    def push(self, token_id: int) -> tuple[str, str | None]:
        """Feed one token. Returns (text released now, the stop string matched or None). After a match the
        stream is finished: the caller stops feeding it."""
        piece = self._decoder.step(self._tokenizer, token_id) or ""
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
            return text[: match[0]], match[1]
        keep = self._partial_match_len(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], None

    def flush(self) -> str:
        """Release the text held back for a possible stop string (the sequence ended otherwise)."""
        text, self._held = self._held, ""
        return text

    def _partial_match_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
