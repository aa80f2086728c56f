"""A request's sampler, shared by the prefill worker (first token) and the decode worker (every later one): the
proto SamplingParams checked and turned into the native RowSampler (native/src/engine/row_sampler.h), which does
the logits processing (logit_bias, presence/frequency penalties, repetition_penalty, min_tokens, the constraint's
mask, min_p) and the draw in C++, for the rows of a decode step in one call without the GIL (docs/sampling.md).

The sampler keeps the sequence's history (token counts, the distinct ids repetition_penalty covers, how many tokens
it took) and its random state, so a step does no Python work that grows with the sequence.
"""

from __future__ import annotations

import math

from splitgemma.engine import RowSampler
from splitgemma.serving.worker import InvalidRequest, sampling_kwargs

MAX_BIAS = 100.0
MAX_PENALTY = 2.0


def check(p, vocab_size: int) -> None:
    """InvalidRequest naming the field of a proto SamplingParams whose logits-processing value is out of range."""
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


def row_sampler(p, *, vocab_size: int, rng_state: int, want_logprob: bool, prompt_ids=(),
                stop_ids=()) -> RowSampler:
    """The sampler of one sequence for a proto SamplingParams (InvalidRequest naming the field when a value is out
    of range). prompt_ids: what repetition_penalty counts besides the output (read only when it is on); stop_ids:
    what min_tokens holds off; want_logprob: the caller reads the token's logprob (else a greedy row is a plain
    argmax)."""
    kw = sampling_kwargs(p)
    check(p, vocab_size)
    repetition = float(p.repetition_penalty) if p.repetition_penalty not in (0.0, 1.0) else 1.0
    return RowSampler(vocab_size, temperature=kw["temperature"], top_k=kw["top_k"], top_p=kw["top_p"],
                      n_logprobs=kw["n_logprobs"], want_logprob=want_logprob, min_p=float(p.min_p),
                      presence_penalty=float(p.presence_penalty), frequency_penalty=float(p.frequency_penalty),
                      repetition_penalty=repetition, min_tokens=int(p.min_tokens), logit_bias=dict(p.logit_bias),
                      stop_ids=sorted(stop_ids) if p.min_tokens else [],
                      prompt_ids=list(prompt_ids) if repetition != 1.0 else [], rng_state=rng_state)
