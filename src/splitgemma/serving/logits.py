"""Logits processing before a token is drawn, shared by the prefill worker (first token) and the decode worker
(every later one): logit_bias, presence/frequency penalties (OpenAI), repetition_penalty, min_p and min_tokens
(vLLM), in vLLM's order: bias, then the penalties, then the exclusions (min_tokens' stop tokens, then min_p over
what is left, at the request's temperature). The constraint of structured outputs is one more exclusion.

Exclusions become an `allowed` id set for grammar.sample_allowed, so the logprobs reported are those of the
distribution actually drawn from (renormalised over the allowed ids); the penalties and the bias change the row
itself. A request with none of these parameters has no processor (`processor()` returns None) and keeps the
workers' fast paths (the greedy argmax).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from splitgemma.engine import Sample, sample
from splitgemma.serving.grammar import sample_allowed
from splitgemma.serving.worker import InvalidRequest

MAX_BIAS = 100.0
MAX_PENALTY = 2.0


class LogitsProcessor:
    """One sequence's processing state: what it generated so far (the penalties and min_tokens depend on it)."""

    def __init__(self, p, *, vocab_size: int, prompt_ids, stop_ids):
        self.presence, self.frequency = float(p.presence_penalty), float(p.frequency_penalty)
        self.repetition = float(p.repetition_penalty) if p.repetition_penalty not in (0.0, 1.0) else 1.0
        self.min_p = float(p.min_p)
        self.min_tokens = int(p.min_tokens)
        self.stop_ids = np.array(sorted(stop_ids), dtype=np.int64) if self.min_tokens else None
        self._unbanned: np.ndarray | None = None  # the vocabulary without stop_ids, while min_tokens holds
        self.vocab_size = vocab_size
        items = sorted(p.logit_bias.items())
        self.bias_ids = np.array([k for k, _ in items], dtype=np.int64)
        self.bias = np.array([v for _, v in items], dtype=np.float32)
        self.counts: Counter = Counter()  # generated token -> occurrences
        # repetition_penalty counts the prompt too (vLLM, transformers): each distinct id once
        self.seen = set(int(t) for t in prompt_ids) if self.repetition != 1.0 else set()
        self.generated = 0

    def observe(self, token: int) -> None:
        """The sequence took `token`."""
        self.generated += 1
        if self.generated >= self.min_tokens:
            self._unbanned = None
        self.counts[token] += 1
        if self.repetition != 1.0:
            self.seen.add(token)

    def apply(self, row: np.ndarray, allowed: np.ndarray | None, temperature: float):
        """(the processed logits row, the allowed ids ascending or None for all)."""
        row = np.array(row, dtype=np.float32)  # a copy: the engine's buffer stays as it was
        if len(self.bias_ids):
            row[self.bias_ids] += self.bias
        if self.seen:
            ids = np.fromiter(self.seen, dtype=np.int64, count=len(self.seen))
            v = row[ids]
            row[ids] = np.where(v > 0, v / self.repetition, v * self.repetition)
        if self.counts and (self.presence or self.frequency):
            ids = np.fromiter(self.counts.keys(), dtype=np.int64, count=len(self.counts))
            n = np.fromiter(self.counts.values(), dtype=np.float32, count=len(self.counts))
            row[ids] -= self.frequency * n + self.presence
        banned = self.stop_ids is not None and self.generated < self.min_tokens and len(self.stop_ids)
        cut = self.min_p > 0 and temperature > 0  # greedy keeps the maximum, which min_p never drops
        if banned:
            if allowed is None:
                if self._unbanned is None:  # built once per sequence: a vocabulary-sized array
                    self._unbanned = np.setdiff1d(np.arange(self.vocab_size, dtype=np.int32),
                                                  self.stop_ids)
                allowed = self._unbanned
            else:
                rest = allowed[~np.isin(allowed, self.stop_ids)]
                # A constraint that admits nothing but a stop token has its output whole: it ends the sequence
                # rather than min_tokens leaving no token at all.
                allowed = rest if len(rest) else allowed
        if cut:
            z = row if allowed is None else row[allowed]
            # p_i >= min_p * p_max  <=>  z_i / T >= z_max / T + log(min_p): the maximum always stays
            keep = np.flatnonzero(z >= z.max() + temperature * math.log(self.min_p))
            allowed = keep if allowed is None else allowed[keep]
        return row, allowed


def processor(p, *, vocab_size: int, prompt_ids=(), stop_ids=()) -> LogitsProcessor | None:
    """The processor for a proto SamplingParams, None when it asks for no processing; InvalidRequest naming the
    field when a value is out of range."""
    for name, limit in (("presence_penalty", MAX_PENALTY), ("frequency_penalty", MAX_PENALTY)):
        v = getattr(p, name)
        if not math.isfinite(v) or abs(v) > limit:
            raise InvalidRequest(f"sampling.{name} must be in [-{limit}, {limit}], got {v}")
    if not math.isfinite(p.repetition_penalty) or p.repetition_penalty < 0:
        raise InvalidRequest(f"sampling.repetition_penalty must be > 0 (0 = off), got {p.repetition_penalty}")
    if not math.isfinite(p.min_p) or not 0 <= p.min_p <= 1:
        raise InvalidRequest(f"sampling.min_p must be in [0, 1], got {p.min_p}")
    for t, v in p.logit_bias.items():
        if t >= vocab_size:
            raise InvalidRequest(f"sampling.logit_bias: token {t} is outside the vocabulary (0..{vocab_size - 1})")
        if not math.isfinite(v) or abs(v) > MAX_BIAS:
            raise InvalidRequest(f"sampling.logit_bias[{t}] must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {v}")
    if not (p.logit_bias or p.presence_penalty or p.frequency_penalty or p.repetition_penalty not in (0.0, 1.0)
            or p.min_p or p.min_tokens):
        return None
    return LogitsProcessor(p, vocab_size=vocab_size, prompt_ids=prompt_ids, stop_ids=stop_ids)


def choose(row: np.ndarray, *, allowed: np.ndarray | None, proc: LogitsProcessor | None, argmax_only: bool,
           rng_state: int, sampling: dict) -> Sample:
    """The token for one logits row: processed (proc), restricted to `allowed` (a constraint's ids, or None),
    then drawn with the sample() keywords `sampling`. argmax_only: greedy with no logprobs to report."""
    if proc is not None:
        row, allowed = proc.apply(row, allowed, sampling["temperature"])
    if allowed is not None:
        return sample_allowed(row, allowed, argmax_only=argmax_only, rng_state=rng_state, sampling=sampling)
    if argmax_only:
        s = argmax(row, rng_state)
        if s is not None:
            return s
    return sample(row, rng_state=rng_state, **sampling)


def argmax(row, rng_state: int) -> Sample | None:
    """sample(row, temperature=0) without its logprobs: the lowest id among the maxima (numpy's argmax takes the
    first), no draw. None for a row with a NaN or an infinity, which sample() refuses with its own error."""
    t = int(row.argmax())
    if not (math.isfinite(row[t]) and math.isfinite(row.min())):
        return None
    return Sample(t, rng_state, 0.0, [])
