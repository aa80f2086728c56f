"""The decode worker's weight-free multi-token paths (docs/speculation.md): what a sequence feeds in one step
beyond its next token.

* Forced tokens: where a sequence's constraint admits exactly one token, that token is taken without the model
  (the Sample a sampled row would give: grammar.forced_sample), and a run of them is fed in the next step as one
  multi-token run whose rows compute no logits (Model.decode's logits flags), except the last one's.
* Prompt lookup: a draft of up to k tokens (k chosen per step for all the step's sequences at once from their
  acceptances and the measured cost of a step with that many more logits rows: choose_drafts) copied from what
  followed the most recent earlier occurrence of the sequence's last n tokens (n = 3, else 2) in its prompt and
  output so far; the step computes logits for every draft row and the batch loop keeps the drafts its own choice
  confirms, one by one. A row's choice is a function of its logits row and its sampler's state (history; for a
  sampled row the random state, one draw per token), and each draft row is sampled only once the one before was
  taken: the tokens are those of plain decoding, greedy or sampled. (For a sampled row a draft token is accepted
  with the probability the model gives it, as rejection sampling against a one-token draft would accept it.)

This module owns the per-sequence lookup index and the rule for when to draft; batch.py owns the step.
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections import deque
from dataclasses import dataclass

NGRAM_SIZES = (3, 2)  # longest first: a longer match predicts better
# The longest draft: --lookup-k's bound, and the length of every draft from a predicted output (a request's own
# prediction is right for long runs when it is right at all: measured 1.58x at 8 against 1.28x at 4, and no loss
# where it is wrong all through: docs/benchmarks.md, session 38).
MAX_DRAFT = 8


@dataclass(frozen=True)
class SpeculationConfig:
    forced: bool = True  # take grammar-forced tokens without the model, fed as one run
    lookup_k: int = 4  # longest draft (0: no prompt lookup); at most MAX_DRAFT
    # Draft only in steps with at most this many sequences (0: in any step). choose_drafts weighs a step's draft
    # rows against its measured cost, yet where extra rows cost about what they yield it still lost a little: on
    # AVX2, any step against none gave 1.15x at 4 clients, 1.00x at 8, 0.96x at 32 (docs/speculation.md).
    lookup_max_batch: int = 8
    # "adaptive": the draft lengths choose_drafts picks from the acceptances and the measured step costs; "fixed":
    # the longest draft the index has, every step (a policy that does not depend on timing: tests, measurements).
    lookup_policy: str = "adaptive"

    def __post_init__(self):
        if not 0 <= self.lookup_k <= MAX_DRAFT:
            raise ValueError(f"lookup_k must be in [0, {MAX_DRAFT}], got {self.lookup_k}")
        if self.lookup_max_batch < 0:
            raise ValueError(f"lookup_max_batch must be 0 (no limit) or positive, got {self.lookup_max_batch}")
        if self.lookup_policy not in ("adaptive", "fixed"):
            raise ValueError(f"lookup_policy must be adaptive or fixed, got {self.lookup_policy!r}")


class StepCosts:
    """A step's time (Model.decode, then sampling and verifying its rows) by the number of logits rows in it,
    measured by the batch loop as it runs: what a draft's extra rows cost on this host, with these kernels, at this
    load. Rows without logits are nearly free (no LM head, no shared layers), so they do not count. A count's cost
    is the median of its last `window` steps, and counts as measured once `min_samples` were seen: a step that ran
    beside a prefill (the workers share the cores) takes up to twice as long, and one such reading must not price a
    draft length out for good (a length that is not chosen is not measured again)."""

    def __init__(self, window: int = 8, min_samples: int = 3):
        self.window, self.min_samples = window, min_samples
        self._seconds: dict[int, deque] = {}

    def observe(self, rows: int, seconds: float) -> None:
        self._seconds.setdefault(rows, deque(maxlen=self.window)).append(seconds)

    def cost(self, rows: int) -> float | None:
        """The median step time with `rows` logits rows, None while fewer than min_samples were seen."""
        s = self._seconds.get(rows)
        return statistics.median(s) if s is not None and len(s) >= self.min_samples else None


def choose_drafts(ps: list[float], lengths: list[int], costs: StepCosts, base_rows: int) -> list[int]:
    """How many tokens of each sequence's draft the step feeds: the choice that maximises the whole step's expected
    tokens per unit of time. Sequence i's j-th draft token is taken with probability ps[i]**j (its acceptance p per
    token, given the one before was taken), lengths[i] are the drafts the index offered, and a step of base_rows + x
    logits rows (base_rows: one per sequence, one token each) costs what StepCosts measured. Every draft row costs
    the same, so the x rows fed are the x most likely draft tokens (each sequence's in its own order, as p**j falls
    with j), and x is the count with the most expected tokens per second: with one sequence, the draft length that
    maximises (1 + p + … + p**k) / cost(1 + k).

    The cost is not smooth in the rows (the GEMM kernels take rows in blocks: on AVX2 with 8 sequences, 12 rows cost
    1.40x a plain step, 13 rows 1.59x; and a reading can be taken while the host is busy), so one dear count must
    not end the search: a count not measured yet is assumed to cost what the largest measured count below it costs
    (more rows should not cost less), and the smallest count that could beat the best measured one on that
    assumption is tried next. Once the counts that could pay are measured, the best of them is fed. No drafts until
    a plain step of base_rows rows is measured."""
    base = costs.cost(base_rows)
    if base is None:
        return [0] * len(ps)
    worth = sorted(((p ** j, i) for i, (p, n) in enumerate(zip(ps, lengths)) for j in range(1, n + 1)),
                   key=lambda w: w[0], reverse=True)
    expects = list(itertools.accumulate((w for w, _ in worth), initial=float(base_rows)))
    measured = [costs.cost(base_rows + x) for x in range(len(worth) + 1)]
    best, best_rate = 0, base_rows / base
    for x, c in enumerate(measured):
        if c is not None and expects[x] / c > best_rate:
            best, best_rate = x, expects[x] / c
    below = base
    for x, c in enumerate(measured):
        if c is not None:
            below = c
        elif expects[x] / below > best_rate:
            best = x  # try it: the most it could cost is unknown, the least is `below`
            break
    ks = [0] * len(ps)
    for _, i in worth[:best]:
        ks[i] += 1
    return ks


class NgramIndex:
    """Prompt + output so far, with the position after each n-gram's most recent occurrence: draft() looks up the
    last n tokens in O(1) per size.

    The table is built at the first draft(), not at admission: every sequence gets an index, but one decoded in
    batches wider than --lookup-max-batch (or with lookup off) never drafts, and the build is O(prompt) on the decode
    loop's thread (~10 ms for 4,096 ids one append at a time; the comprehension below takes about a third of that).

    A predicted output (`prediction`: OpenAI's, text the answer is expected to repeat) is looked up first: there an
    n-gram's occurrences are all kept, and the first one past the place the last draft from the prediction came
    from is taken (else the last one before it), so that an answer that follows the prediction drafts from its place
    in it rather than from an earlier repeat of the same n-gram."""

    def __init__(self, tokens, prediction=()):
        self.tokens: list[int] = list(tokens)
        self._last: dict[tuple, int] | None = None
        self.prediction: list[int] = list(prediction)
        self._places: dict[tuple, list[int]] | None = None
        self._cursor = 0

    def append(self, token: int) -> None:
        t = self.tokens
        t.append(token)
        if self._last is not None:
            # The n-gram ending just before `token` was followed by it: record where (never the live suffix, whose
            # follower is not known yet, so a lookup never finds itself).
            for n in NGRAM_SIZES:
                if len(t) > n:
                    self._last[(n,) + tuple(t[-n - 1:-1])] = len(t) - 1

    def draft(self, k: int, k_predicted: int | None = None) -> list[int]:
        """Up to `k_predicted` (default k) tokens from the prediction, else up to k from the prompt and output."""
        return self._predicted(k if k_predicted is None else k_predicted) or self._looked_up(k)

    def _predicted(self, k: int) -> list[int]:
        t, p = self.tokens, self.prediction
        if not p:
            return []
        if self._places is None:
            self._places = {}
            for n in NGRAM_SIZES:
                for i in range(n, len(p)):
                    self._places.setdefault((n, *p[i - n:i]), []).append(i)
        for n in NGRAM_SIZES:
            if len(t) >= n:
                places = self._places.get((n,) + tuple(t[-n:]))
                if places:
                    at = bisect.bisect_left(places, self._cursor)
                    i = places[at] if at < len(places) else places[-1]
                    self._cursor = i + 1  # the output grows before the next draft: its place there is later
                    return p[i:i + k]
        return []

    def _looked_up(self, k: int) -> list[int]:
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
