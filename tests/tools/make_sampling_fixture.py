"""Builds tests/fixtures/sampling/processors.npz: transformers' own logits processors and warpers applied to fixed
logits rows, the oracle tests/test_row_sampler.py holds the native sampler (native/src/engine/row_sampler.h) to.

    /work/wt/sampler-fixture-venv/bin/python tests/tools/make_sampling_fixture.py

Needs torch (2.13, CPU) and transformers (5.x); nothing of splitgemma is imported. Each case is a float32 logits row
of V = 96 ids (seeded normal x 3, no ties), a prompt and an output history, and the parameters; the processors are
composed in vLLM's order, which is the server's (docs/sampling.md):

    SequenceBiasLogitsProcessor (logit_bias, single-token sequences)
    RepetitionPenaltyLogitsProcessor (over prompt + output)
    MinNewTokensLengthLogitsProcessor (min_tokens: the stop ids while fewer were generated)
    TemperatureLogitsWarper (not for greedy), MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

and the fixture keeps, per case, `processed` (the row after the bias and the repetition penalty: what the native
sampler writes back) and `logprobs` (log_softmax of the final scores: the distribution a token is drawn from, -inf
for the ids the warpers dropped). presence/frequency penalties have no transformers processor; the test checks them
against OpenAI's formula. Cases hold no presence/frequency, so transformers alone is the oracle here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers.generation.logits_process import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                                                    MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

OUT = Path(__file__).resolve().parents[1] / "fixtures" / "sampling" / "processors.npz"
V = 96

CASES = [
    {"name": "logit_bias", "temperature": 0.0, "logit_bias": {"5": 4.0, "17": -3.0, "40": 10.0}},
    {"name": "repetition_1.3_greedy", "temperature": 0.0, "repetition_penalty": 1.3,
     "prompt": [1, 2, 3, 5, 8, 13, 13, 60], "output": [21, 5, 34, 21]},
    {"name": "repetition_0.7_sampled", "temperature": 0.8, "repetition_penalty": 0.7,
     "prompt": [4, 9, 16, 25, 36], "output": [49, 64, 81]},
    {"name": "min_p_0.1", "temperature": 1.0, "min_p": 0.1},
    {"name": "min_p_0.05_t0.7_top_k_20", "temperature": 0.7, "min_p": 0.05, "top_k": 20},
    {"name": "top_k_10_t1.3", "temperature": 1.3, "top_k": 10},
    {"name": "top_p_0.8", "temperature": 1.0, "top_p": 0.8},
    {"name": "top_k_30_top_p_0.9_t0.9", "temperature": 0.9, "top_k": 30, "top_p": 0.9},
    {"name": "min_tokens_holding", "temperature": 1.0, "top_p": 0.95, "min_tokens": 5, "stop_ids": [0, 7, 9],
     "output": [11, 12]},
    {"name": "min_tokens_reached", "temperature": 1.0, "min_tokens": 3, "stop_ids": [0, 7, 9],
     "output": [11, 12, 13]},
    {"name": "min_tokens_greedy", "temperature": 0.0, "min_tokens": 2, "stop_ids": [3, 50], "output": [8]},
    {"name": "everything", "temperature": 1.1, "logit_bias": {"2": 2.5, "70": -1.0, "88": 6.0},
     "repetition_penalty": 1.2, "prompt": [2, 30, 31, 70], "output": [44, 2, 88], "min_tokens": 8,
     "stop_ids": [1, 6], "min_p": 0.02, "top_k": 40, "top_p": 0.9},
]


def processors(case: dict, prompt_len: int) -> LogitsProcessorList:
    out = LogitsProcessorList()
    if case.get("logit_bias"):
        out.append(SequenceBiasLogitsProcessor([[[int(k)], float(v)] for k, v in case["logit_bias"].items()]))
    if case.get("repetition_penalty", 1.0) != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(case["repetition_penalty"]))
    return out


def warpers(case: dict, prompt_len: int) -> LogitsProcessorList:
    out = LogitsProcessorList()
    if case.get("min_tokens"):
        out.append(MinNewTokensLengthLogitsProcessor(prompt_len, case["min_tokens"], case["stop_ids"]))
    t = case["temperature"]
    if t > 0:
        out.append(TemperatureLogitsWarper(t))
        if case.get("min_p"):
            out.append(MinPLogitsWarper(case["min_p"]))
        if case.get("top_k"):
            out.append(TopKLogitsWarper(case["top_k"]))
        if case.get("top_p", 1.0) < 1.0:
            out.append(TopPLogitsWarper(case["top_p"]))
    return out


def main() -> None:
    rng = np.random.default_rng(20261202)
    rows = (rng.standard_normal((len(CASES), V)) * 3).astype(np.float32)
    assert all(len(np.unique(r)) == V for r in rows)  # no ties: top-k's tie rule never matters
    processed, logprobs = [], []
    for case, row in zip(CASES, rows):
        prompt = case.get("prompt", [1])
        ids = torch.tensor([prompt + case.get("output", [])], dtype=torch.long)
        scores = torch.from_numpy(row.copy())[None, :]
        scores = processors(case, len(prompt))(ids, scores)
        processed.append(scores[0].numpy().astype(np.float32))
        final = warpers(case, len(prompt))(ids, scores.clone())
        logprobs.append(torch.log_softmax(final.double(), dim=-1)[0].numpy())
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, rows=rows, processed=np.stack(processed), logprobs=np.stack(logprobs),
                        cases=np.array(json.dumps(CASES)),
                        made_with=np.array(f"torch {torch.__version__}, transformers {transformers.__version__}"))
    print(f"wrote {OUT} ({len(CASES)} cases, V {V})")


if __name__ == "__main__":
    main()
