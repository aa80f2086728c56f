"""The decode worker's weight-free multi-token paths (docs/speculation.md): what a sequence feeds in one step
beyond its next token.

* Forced tokens: where a sequence's constraint admits exactly one token, that token is taken without the model
  (the Sample a sampled row would give: grammar.forced_sample), and a run of them is fed in the next step as one
  multi-token run whose rows compute no logits (Model.decode's logits flags), except the last one's.
* Prompt lookup: a draft of up to k tokens copied from what followed the most recent earlier occurrence of the
  sequence's last n tokens (n = 3, else 2) in its prompt and output so far; the step computes logits for every
  draft row and the batch loop keeps the drafts its own choice confirms, one by one. Only for greedy rows without
  logits processing: the choice is then a function of the logits row alone, so the tokens are those of plain
  decoding. Sampled rows are not speculated (no rejection sampling: off, not approximate).

This module owns the per-sequence lookup index and the rule for when to draft; batch.py owns the step.
"""

from __future__ import annotations

from dataclasses import dataclass

NGRAM_SIZES = (3, 2)  # longest first: a longer match predicts better


@dataclass(frozen=True)
class SpeculationConfig:
    forced: bool = True  # take grammar-forced tokens without the model, fed as one run
    lookup_k: int = 4  # longest draft (0: no prompt lookup); at most 8
    # Draft only in steps with at most this many sequences: at batch 1 a step is bound by reading the weights, so
    # extra rows are almost free; in a wide batch they cost compute every row pays (docs/benchmarks.md).
    lookup_max_batch: int = 2
    # A sequence whose drafts are accepted less often than this, once it has drafted `probe` tokens, stops drafting.
    min_acceptance: float = 0.1
    probe: int = 32

    def __post_init__(self):
        if not 0 <= self.lookup_k <= 8:
            raise ValueError(f"lookup_k must be in [0, 8], got {self.lookup_k}")
        if self.lookup_max_batch < 1:
            raise ValueError(f"lookup_max_batch must be at least 1, got {self.lookup_max_batch}")


class NgramIndex:
    """Prompt + output so far, with the position after each n-gram's most recent occurrence: draft() looks up the
    last n tokens in O(1) per size."""

    def __init__(self, tokens):
        self.tokens: list[int] = []
        self._last: dict[tuple, int] = {}
        for t in tokens:
            self.append(int(t))

    def append(self, token: int) -> None:
        t = self.tokens
        t.append(token)
        # The n-gram ending just before `token` was followed by it: record where (never the live suffix, whose
        # follower is not known yet, so a lookup never finds itself).
        for n in NGRAM_SIZES:
            if len(t) > n:
                self._last[(n,) + tuple(t[-n - 1:-1])] = len(t) - 1

    def draft(self, k: int) -> list[int]:
        t = self.tokens
        for n in NGRAM_SIZES:
            if len(t) >= n:
                i = self._last.get((n,) + tuple(t[-n:]))
                if i is not None:
                    return t[i:i + k]
        return []


@dataclass
class LookupState:
    """One sequence's lookup: its index and its own acceptance (the rule that turns drafting off for it)."""
    index: NgramIndex
    drafted: int = 0
    accepted: int = 0

    def worth_drafting(self, cfg: SpeculationConfig) -> bool:
        return self.drafted < cfg.probe or self.accepted >= cfg.min_acceptance * self.drafted
