"""Constrained decoding: a pb.Constraint compiled to a per-sequence matcher that says, step by step, which tokens may
come next (structured outputs, docs/structured-outputs.md).

The library is llguidance (chosen by measuring, docs/benchmarks.md: ~1 ms to compile a JSON schema against
Gemma's 262k vocabulary where outlines-core takes seconds, tens of microseconds per mask; no torch). Its tokenizer
view is built once per process from the model's tokenizer.json (seconds for 262k tokens, so lazily, on the first
constrained request, and off the event loop), with the model's stop tokens as its end-of-sequence tokens: once a
constraint is complete the mask admits only those, and sampling one ends the sequence with finish_reason "stop".

Every process that sees a constraint compiles it: the gateway to answer a bad one with a 400 before any slot is
taken (cached by constraint), the prefill worker for the first token, the decode worker for the rest.
"""

from __future__ import annotations

import json
import logging
import threading
from functools import lru_cache
from pathlib import Path

import llguidance as llg
import numpy as np

from splitgemma.engine import Sample
from splitgemma.v1 import serving_pb2 as pb

from .files import read_regular_text

log = logging.getLogger("splitgemma.grammar")

# JSON as json.dumps writes it: a separator is ", " or ": " and no whitespace elsewhere. llguidance's default lets
# whitespace in anywhere, where a model (a random-weight one above all) can spend its whole budget on newlines; a
# schema's own "x-guidance" options still override these.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# {"type": "object"} compiles to any JSON object (llguidance's own advice for json_object).
_ANY_OBJECT = '{"type": "object"}'
# A matcher may not run away with a worker: llguidance's own bounds on the work of one mask and on grammar size.
_LIMITS = llg.LLParserLimits()
# One pool computes the masks of all constrained rows of a step in parallel, without the GIL.
_EXECUTOR = llg.LLExecutor()


_UNREADABLE = ("constrained outputs are not available for this model: its tokenizer is neither byte-level nor "
               "byte-fallback")


class ConstraintError(ValueError):
    """The constraint does not compile (or is empty): the message says why; a gateway answers 400, a worker
    INVALID_ARGUMENT."""


def constraint_kind(c) -> str | None:
    """The Constraint's oneof field name, or None for an unset (absent) constraint."""
    return c.WhichOneof("kind") if c is not None else None


def _grammar_text(c) -> str:
    body = _body_text(c)
    return _with_thought(body, c.thought) if c.HasField("thought") else body


def _with_thought(body: str, thought) -> str:
    """`body` (a grammar as the llguidance constructors return it: top-level JSON, or Lark text) behind an optional
    thought block: the open marker, any text (a text lexeme never matches a special token, so the close marker ends
    it) of at most `thought.max_tokens` tokens when set, the close marker. The body becomes a named sub-grammar; a
    JSON schema goes in through Lark's %json, as a named json_schema grammar cannot be referenced."""
    top = json.loads(body) if body.lstrip().startswith("{") else {"grammars": [{"lark_grammar": body}]}
    inner = top["grammars"][0]  # every Constraint kind compiles to one grammar
    if inner.get("json_schema") is not None:
        inner = {"lark_grammar": "start: %json " + json.dumps(inner["json_schema"])}
    if not thought.HasField("max_tokens"):
        main = (f"start: thought? @body\nthought: <[{thought.open}]> THOUGHT <[{thought.close}]>\n"
                "THOUGHT: /(?s:.*)/\n")
    elif thought.max_tokens == 0:
        main = f"start: thought? @body\nthought: <[{thought.open}]> <[{thought.close}]>\n"
    else:  # a budget: llguidance ends the text lexeme after max_tokens tokens, leaving only the close marker
        main = (f"start: thought? @body\nthought: <[{thought.open}]> thought_text <[{thought.close}]>\n"
                f"thought_text[max_tokens={thought.max_tokens}]: /(?s:.*)/\n")
    return json.dumps({"grammars": [{"name": "main", "lark_grammar": main}, {**inner, "name": "body"}]})


def _body_text(c) -> str:
    kind = constraint_kind(c)
    try:
        if kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(c.json_schema, defaults=_JSON_OPTIONS)
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=_JSON_OPTIONS)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(c.regex)
        if kind == "lark":
            return llg.LLMatcher.grammar_from_lark(c.lark)
    except ValueError as e:  # grammar_from_json_schema: not a JSON object
        raise ConstraintError(f"the JSON schema is not valid: {e}") from None
    raise ConstraintError("the constraint is empty (set one of json_schema, json_object, regex, lark)")


def worker_grammars(model_path: str, tokenizer: str | None, vocab_size: int) -> "Grammars":
    """A worker's Grammars: the tokenizer.json beside the model (or --tokenizer) and the model's stop tokens. A
    worker without a tokenizer refuses constraints (ConstraintError) but serves everything else."""
    from .stop_tokens import model_stop_tokens
    from .tokenizer import TokenizerNotFound, find_tokenizer

    try:
        path = find_tokenizer(model_path, tokenizer)
    except TokenizerNotFound:
        if tokenizer is not None:
            raise
        path = None
    return Grammars(path, model_stop_tokens(model_path)[0], vocab_size)


class Grammars:
    """The process's grammar compiler: the llguidance tokenizer (built on first use) and compiled constraints."""

    def __init__(self, tokenizer_path: str | Path | None, stop_tokens, vocab_size: int):
        self.tokenizer_path = tokenizer_path
        self.stop_tokens = tuple(stop_tokens)
        self.vocab_size = vocab_size
        self._tok: llg.LLTokenizer | None = None
        self._unreadable = False  # llguidance refused the tokenizer: said once, not re-read per request
        self._lock = threading.Lock()
        # Compiled grammars by constraint: a schema is compiled once, however many requests send it.
        self._check = lru_cache(maxsize=256)(self._check_uncached)

    @property
    def ready(self) -> bool:
        """The tokenizer is built: compiling a constraint is now cheap."""
        return self._tok is not None

    @property
    def tokenizer(self) -> llg.LLTokenizer:
        with self._lock:
            if self._tok is None:
                if self._unreadable:
                    raise ConstraintError(_UNREADABLE)
                if self.tokenizer_path is None:
                    raise ConstraintError("constrained outputs need the model's tokenizer; this process runs "
                                          "without one (start it with --tokenizer)")
                text = read_regular_text(Path(self.tokenizer_path))
                try:
                    self._tok = llg.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=list(self.stop_tokens))
                except ValueError as e:
                    # llguidance reads byte-level and byte-fallback (SentencePiece-style, Gemma's) tokenizers. The
                    # message reaches clients: it names no path.
                    log.warning("llguidance cannot read the tokenizer", extra={"path": str(self.tokenizer_path),
                                                                               "reason": str(e)})
                    self._unreadable = True
                    raise ConstraintError(_UNREADABLE) from None
            return self._tok

    def check(self, c) -> str:
        """The compiled grammar text of `c` (cached by the constraint's bytes), or ConstraintError."""
        return self._check(c.SerializeToString(deterministic=True))

    def _check_uncached(self, key: bytes) -> str:
        grammar = _grammar_text(pb.Constraint.FromString(key))
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer, limits=_LIMITS)
        if is_error:
            raise ConstraintError(messages[0] if messages else "the constraint does not compile")
        return grammar

    def matcher(self, c) -> "Matcher":
        """A fresh matcher for one sequence (compiles `c`; ConstraintError when it does not)."""
        tok = self.tokenizer
        m = llg.LLMatcher(tok, self.check(c), limits=_LIMITS, log_level=0)
        if m.is_error():
            raise ConstraintError(m.get_error())
        # The mask covers the tokenizer's ids (ids past it, a model's padding rows, are never allowed).
        return Matcher(m, min(tok.vocab_size, self.vocab_size), (tok.vocab_size + 31) // 32)


class Matcher:
    """One sequence's place in its constraint. Each step: fill the mask (compute_masks, or mask()), sample with
    its bits, then advance() by the token taken."""

    def __init__(self, m: llg.LLMatcher, vocab_size: int, words: int):
        self._m = m
        self.vocab_size = vocab_size
        self.words = words  # 32-bit words of llguidance's mask
        self._bits: np.ndarray | None = None

    def mask(self) -> None:
        """Compute the mask for the next token (llguidance drops the GIL while it works)."""
        self._bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)

    def set_mask(self, row: np.ndarray) -> None:
        self._bits = row.view(np.uint8)

    @property
    def has_mask(self) -> bool:
        return self._bits is not None

    def forced(self) -> int | None:
        """The one token the mask admits, or None when it admits several (or none). Cheaper than reading the
        whole mask: it looks at the nonzero bytes only."""
        if self._bits is None:
            raise RuntimeError("forced() before the mask was computed")
        nz = np.flatnonzero(self._bits)
        if len(nz) != 1:
            return None
        byte = int(self._bits[nz[0]])
        if byte & (byte - 1):
            return None
        token = int(nz[0]) * 8 + byte.bit_length() - 1
        return token if token < self.vocab_size else None

    @property
    def bits(self) -> np.ndarray:
        """The mask of the last mask() / compute_masks as 32-bit words (bit i of word i/32 allows id i): what the
        native sampler reads (splitgemma.engine.sample_rows)."""
        if self._bits is None:
            raise RuntimeError("bits before the mask was computed")
        return self._bits.view(np.uint32)

    def advance(self, token: int) -> None:
        self._bits = None
        if not self._m.consume_token(token):
            raise ConstraintError(f"token {token} violates the constraint: {self._m.get_error()}")

    @property
    def complete(self) -> bool:
        """Nothing but a stop token may follow (the constraint's output is whole)."""
        return self._m.is_stopped()


def compute_masks(matchers: list[Matcher]) -> None:
    """Fill every matcher's mask in one call, in parallel on llguidance's threads, without the GIL (so the decode
    thread can run Model.decode meanwhile)."""
    if not matchers:
        return
    words = matchers[0].words
    out = np.zeros((len(matchers), words), dtype=np.int32)
    _EXECUTOR.unsafe_compute_mask_ptr([(m._m, i) for i, m in enumerate(matchers)], out.ctypes.data, words * 4,
                                      len(matchers))
    for i, m in enumerate(matchers):
        m.set_mask(out[i])


def forced_sample(token: int, sampler) -> Sample:
    """The Sample of a token the constraint forces (the only one it admits), as the native sampler gives it for a
    mask of one id: no draw (the sampler's random state unchanged), logprob 0. The decode worker takes forced tokens
    without computing their logits at all (docs/speculation.md); the stream is the same either way."""
    return Sample(token, sampler.rng_state, 0.0, [(token, 0.0)] if sampler.n_logprobs else [])
