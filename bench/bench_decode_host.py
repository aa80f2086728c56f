"""The decode worker's batch loop on a real model: Model.decode's time per step beside the loop's own work per step
(sampling every row, stop checks, detokenizing with TextStream, building the events, call_soon_threadsafe), as
the worker's metrics split them (splitgemma_decode_step_seconds / splitgemma_decode_host_seconds).

    python bench/bench_decode_host.py --model /tmp/e2b.fgm --tokenizer tok.json [--batches 1,8,32] [--steps 8]

It runs services/decode/batch.py's BatchLoop itself, in process, over an anonymous arena: every batch size B
admits B sequences (prompts of --prompt-tokens random ids, prefilled once) and decodes --steps tokens each. Six
sampling arms, alternated and repeated (--repeats): greedy without logprobs (the argmax path), greedy with the
token's logprob, temperature 1 over the whole vocabulary (the OpenAI API's defaults), sampled (temperature 1, top-k 64, top-p 0.95) with logprobs and 5 alternatives, and the greedy and
sampled arms with the logits-processing parameters on (docs/sampling.md: 16 logit_bias entries, presence and
frequency penalties 0.5, repetition_penalty 1.2 over the prompt and output, min_tokens holding off two stop ids for
the whole run; the sampled one also min_p 0.05). Medians per step are printed, with the load average (the machine is
shared) and the streams that ended with an error (they leave the batch).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics

import numpy as np

from splitgemma.engine import Model, Sample, open_arena
from splitgemma.serving.detokenize import TextStream
from splitgemma.serving.logits import row_sampler
from splitgemma.services.decode.batch import BatchLoop, Sequence, StreamError
from splitgemma.services.decode.slots import SlotTable
from splitgemma.v1 import serving_pb2 as pb

_PARAMS = {"logit_bias": {1000 + 37 * i: 0.5 for i in range(16)}, "presence_penalty": 0.5, "frequency_penalty": 0.5,
           "repetition_penalty": 1.2, "min_tokens": 1 << 20}
ARMS = {"greedy": pb.SamplingParams(temperature=0.0),
        "greedy+logprobs": pb.SamplingParams(temperature=0.0, logprobs=True),
        "temperature 1": pb.SamplingParams(temperature=1.0),
        "sampled+logprobs": pb.SamplingParams(temperature=1.0, top_k=64, top_p=0.95, logprobs=True, top_logprobs=5),
        "greedy+params": pb.SamplingParams(temperature=0.0, **_PARAMS),
        "sampled+params": pb.SamplingParams(temperature=1.0, top_k=64, top_p=0.95, logprobs=True, top_logprobs=5,
                                            min_p=0.05, **_PARAMS)}
STOP_IDS = (1, 106)


class Recorder:
    """The two DecodeMetrics calls the batch loop makes, kept as lists."""

    def __init__(self):
        self.steps, self.hosts = [], []
        self.failed = 0  # streams that ended with an error

    def step(self, seconds: float, batch: int, tokens: int) -> None:
        self.steps.append(seconds)

    def host(self, seconds: float) -> None:
        self.hosts.append(seconds)


async def run_round(model, arena, tokenizer, batch: int, arm: str, steps: int, prompts) -> Recorder:
    loop = asyncio.get_running_loop()
    rec = Recorder()
    table = SlotTable(batch, stamp=lambda s, g, secret: None, revoke=lambda s: True, writing=lambda s: False)
    bl = BatchLoop(model, arena, table, loop, rec)
    bl.start()
    p = ARMS[arm]
    seqs = [Sequence(request_id=f"r{i}", slot=i, prompt_tokens=len(prompts[i]), first=Sample(1000 + i, 1, 0.0, []),
                     sampler=row_sampler(p, vocab_size=model.vocab_size, rng_state=1 + i, want_logprob=p.logprobs,
                                         prompt_ids=prompts[i], stop_ids=STOP_IDS),
                     max_tokens=steps + 1, max_context=model.max_context, stop_ids=frozenset(),
                     text=TextStream(tokenizer) if tokenizer is not None else None, token_name=str,
                     queue=asyncio.Queue()) for i in range(batch)]
    for s in seqs:
        bl.admit(s)
    for s in seqs:
        while True:
            item = await s.queue.get()
            if isinstance(item, StreamError):  # the row left the batch (e.g. its text was not UTF-8)
                rec.failed += 1
                break
            if item.finish_reason:
                break
    bl.stop()
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer", help="tokenizer.json for TextStream (default: none, no detokenizing)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per round (default: 8)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    tokenizer = None
    if args.tokenizer:
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(args.tokenizer)
    model = Model(args.model, threads=args.threads, max_context=1024, chunk=256, max_batch=max(batches),
                  weights="int4")
    arena = open_arena(model, max(batches))
    rng = np.random.default_rng(0)
    # Ids past the byte-fallback tokens (Gemma's <0x..> are 238-493), so that the text stays valid UTF-8.
    prompts = [rng.integers(1000, 20000, args.prompt_tokens).tolist() for _ in range(max(batches))]
    for s, prompt in enumerate(prompts):
        model.prefill(arena, s, prompt)
    print(f"model {args.model}: backend {model.backend}, {model.threads} threads, vocab {model.vocab_size}, "
          f"load average {os.getloadavg()[0]:.1f}")
    got: dict = {}
    for _ in range(args.repeats):
        for b in batches:
            for arm in ARMS:
                rec = asyncio.run(run_round(model, arena, tokenizer, b, arm, args.steps, prompts))
                got.setdefault((b, arm), Recorder())
                got[(b, arm)].steps += rec.steps
                got[(b, arm)].hosts += rec.hosts
                got[(b, arm)].failed += rec.failed
    print(f"{'B':>3} {'arm':<17} {'Model.decode ms':>16} {'host ms/step':>13} {'host share':>10} {'tok/s':>7} "
          f"{'failed':>6}")
    for (b, arm), rec in got.items():
        d, h = statistics.median(rec.steps), statistics.median(rec.hosts)
        print(f"{b:>3} {arm:<17} {d * 1e3:>16.1f} {h * 1e3:>13.2f} {h / (d + h):>9.1%} {b / (d + h):>7.1f} "
              f"{rec.failed:>6}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
