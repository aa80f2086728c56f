"""The prompt's side of a completion: OpenAI's legacy `echo` (the prompt before the completion in `text`, and its
tokens first in `logprobs`) and vLLM's `prompt_logprobs`, rendered from the prefill worker's PromptLogprob entries
(PrefillResponse.prompt_logprobs: positions 1 … T-1 of the prompt, under the raw model distribution); and `best_of`,
the choice of the n candidates to return.

Shapes:
* echo with logprobs (OpenAI completions): `tokens` the prompt's tokens then the completion's, `token_logprobs` and
  `top_logprobs` null for the first prompt token (nothing precedes it), `text_offset` the offset of each token's
  text in `text` (for the prompt's tokens, the running length of their texts, as vLLM counts them).
* prompt_logprobs (vLLM): a list with null first, then per position a dict from the token id (a string, as JSON
  keys are) to {"logprob", "rank", "decoded_token"} holding the prompt's own token and the top n.
"""

from __future__ import annotations

from dataclasses import dataclass

# OpenAI's (and vLLM's) logprob for a token of probability 0 (an excluded token): JSON has no -Infinity. The
# renderers (render.py) answer the same.
MIN_LOGPROB = -9999.0


def _lp(v: float) -> float:
    return max(v, MIN_LOGPROB)


@dataclass
class PromptPart:
    """One prompt's share of its choices' output: the echoed text and the per-position logprobs."""

    text: str                # the prompt as echoed ("" without echo)
    prompt_ids: list[int]
    entries: list            # pb.PromptLogprob of positions 1 … T-1 ([] when none were asked for)

    def echo_logprobs(self, token_text, top_n: int) -> dict:
        """The prompt's part of the completions `logprobs` object (OpenAI's echo with logprobs)."""
        tokens = [token_text(t) for t in self.prompt_ids]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(min(at, len(self.text)))
            at += len(t)
        tops = [None] + [{token_text(a.token_id): _lp(a.logprob) for a in e.top_logprobs[:top_n]}
                         for e in self.entries]
        return {"tokens": tokens, "token_logprobs": [None] + [_lp(e.logprob) for e in self.entries],
                "top_logprobs": tops if top_n else None, "text_offset": offsets}

    def vllm_prompt_logprobs(self, token_text) -> list:
        """vLLM's prompt_logprobs: null for the first position, then {token id: {logprob, rank, decoded_token}}."""
        out: list = [None]
        for e in self.entries:
            d = {str(e.token_id): {"logprob": _lp(e.logprob), "rank": e.rank, "decoded_token": token_text(e.token_id)}}
            for rank, a in enumerate(e.top_logprobs, 1):
                d.setdefault(str(a.token_id), {"logprob": _lp(a.logprob), "rank": rank,
                                               "decoded_token": token_text(a.token_id)})
            out.append(d)
        return out


def echoed(part: PromptPart, text: str, tail: dict | None, token_text, top_n: int) -> tuple[str, dict | None]:
    """A completion's text and logprobs with the prompt before them (tail: the completion's logprobs, its offsets
    counted from the end of the prompt's text)."""
    if tail is None:
        return part.text + text, None
    head = part.echo_logprobs(token_text, top_n)
    return part.text + text, {"tokens": head["tokens"] + tail["tokens"],
                              "token_logprobs": head["token_logprobs"] + tail["token_logprobs"],
                              "top_logprobs": None if head["top_logprobs"] is None
                              else head["top_logprobs"] + tail["top_logprobs"],
                              "text_offset": head["text_offset"] + tail["text_offset"]}


def best_of(cumulative: list[float], n_prompts: int, best: int, n: int) -> list[int]:
    """The candidates to return, in order: per prompt (candidates p*best … p*best+best-1) the n with the highest
    cumulative logprob, best first (ties: the lower index), as OpenAI's best_of."""
    out = []
    for p in range(n_prompts):
        cands = range(p * best, (p + 1) * best)
        out += sorted(cands, key=lambda i: (-cumulative[i], i))[:n]
    return out
