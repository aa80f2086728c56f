"""The decode worker's weight-free multi-token paths (docs/speculation.md): what a sequence feeds in one step
beyond its next token.

* Forced tokens: where a sequence's constraint admits exactly one token, that token is taken without the model
  (the Sample a sampled row would give: grammar.forced_sample), and a run of them is fed in the next step as one
  multi-token run whose rows compute no logits (Model.decode's logits flags), except the last one's.
* Prompt lookup: a draft of up to k tokens (k chosen per step from the sequence's acceptance and the measured cost
  of a step with that many more logits rows: choose_k) copied from what followed the most recent earlier occurrence of the
  sequence's last n tokens (n = 3, else 2) in its prompt and output so far; the step computes logits for every
  draft row and the batch loop keeps the drafts its own choice confirms, one by one. A row's choice is a function of
  its logits row and its sampler's state (history; for a sampled row the random state, one draw per token), and
  each draft row is sampled only once the one before was taken: the tokens are those of plain decoding, greedy or
  sampled. (For a sampled row a draft token is accepted with the probability the model gives it, as rejection
  sampling against a one-token draft would accept it.)

This module owns the per-sequence lookup index and the rule for when to draft; batch.py owns the step.
"""

from __future__ import annotations

from dataclasses import dataclass

NGRAM_SIZES = (3, 2)  # longest first: a longer match predicts better


@dataclass(frozen=True)
class SpeculationConfig:
    forced: bool = True  # take grammar-forced tokens without the model, fed as one run
    lookup_k: int = 4  # longest draft (0: no prompt lookup); at most 8
    # Draft only in steps with at most this many sequences: a draft's rows are paid by the whole step, and the
    # draft length is chosen for one sequence's acceptance against the step's measured cost (choose_k).
    lookup_max_batch: int = 1
    # "adaptive": the draft length choose_k picks from the acceptance and the measured step costs; "fixed": the
    # longest draft the index has, every step (a policy that does not depend on timing: tests, measurements).
    lookup_policy: str = "adaptive"

    def __post_init__(self):
        if not 0 <= self.lookup_k <= 8:
            raise ValueError(f"lookup_k must be in [0, 8], got {self.lookup_k}")
        if self.lookup_max_batch < 1:
            raise ValueError(f"lookup_max_batch must be at least 1, got {self.lookup_max_batch}")
        if self.lookup_policy not in ("adaptive", "fixed"):
            raise ValueError(f"lookup_policy must be adaptive or fixed, got {self.lookup_policy!r}")


class StepCosts:
    """Model.decode's time by the number of logits rows in the step (a moving average per count), measured by the
    batch loop as it runs: what a draft's extra rows cost on this host, with these kernels, at this load. Rows
    without logits are nearly free (no LM head, no shared layers), so they do not count."""

    def __init__(self, alpha: float = 0.2):
        self.alpha = alpha
        self.seconds: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else old + self.alpha * (seconds - old)

    def ratio(self, rows: int, base: int) -> float | None:
        """cost(rows) / cost(base), None while either is unmeasured."""
        a, b = self.seconds.get(rows), self.seconds.get(base)
        return a / b if a is not None and b else None


def choose_k(p: float, costs: StepCosts, base_rows: int, k_max: int) -> int:
    """The draft length that maximises expected tokens per second for a sequence whose drafted tokens are accepted
    with probability p each (given the previous one was): a step with a k-token draft yields 1 + p + … + p^k tokens
    and costs ratio(base_rows + k) plain steps. Lengths are explored one row at a time: an unmeasured length counts
    at the cost of the one below it, and only once that one is measured, so the table fills only as far as longer
    drafts could still pay."""
    best, best_rate = 0, 1.0
    expect, prev = 1.0, 1.0
    for k in range(1, k_max + 1):
        expect += p ** k
        r = costs.ratio(base_rows + k, base_rows)
        rate = expect / (r if r is not None else prev)
        if rate > best_rate:
            best, best_rate = k, rate
        if r is None:
            break
        prev = r
    return best


class NgramIndex:
    """Prompt + output so far, with the position after each n-gram's most recent occurrence: draft() looks up the
    last n tokens in O(1) per size.

    The table is built at the first draft(), not at admission: every sequence gets an index, but one decoded in
    batches wider than --lookup-max-batch never drafts, and the build is O(prompt) on the decode loop's thread
    (~10 ms for 4,096 ids one append at a time; the comprehension below takes about a third of that)."""

    def __init__(self, tokens):
        self.tokens: list[int] = list(tokens)
        self._last: dict[tuple, int] | None = None

    def append(self, token: int) -> None:
        t = self.tokens
        t.append(token)
        if self._last is not None:
            # The n-gram ending just before `token` was followed by it: record where (never the live suffix, whose
            # follower is not known yet, so a lookup never finds itself).
            for n in NGRAM_SIZES:
                if len(t) > n:
                    self._last[(n,) + tuple(t[-n - 1:-1])] = len(t) - 1

    def draft(self, k: int) -> list[int]:
        t = self.tokens
        if self._last is None:
            # What append() would have recorded token by token: for each n-gram, the position after its most recent
            # occurrence (a later key overwrites an earlier one in the comprehension as in the dict).
            self._last = {}
            for n in NGRAM_SIZES:
                self._last.update({(n, *t[i - n:i]): i for i in range(n, len(t))})
        for n in NGRAM_SIZES:
            if len(t) >= n:
                i = self._last.get((n,) + tuple(t[-n:]))
                if i is not None:
                    return t[i:i + k]
        return []


@dataclass
class LookupState:
    """One sequence's lookup: its index and its own acceptance, counted as a geometric rate (drafted tokens
    accepted, against the drafts that ended in a rejection), starting from one accept and one reject."""
    index: NgramIndex
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0

    @property
    def p(self) -> float:
        return (self.accepted + 1) / (self.accepted + self.rejections + 2)
