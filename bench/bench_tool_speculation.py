#!/usr/bin/env python3
"""Grammar-constrained tool calling on the full-size random E2B: decode tok/s with the decode worker's weight-free
multi-token paths off and on (baseline, forced tokens, prompt lookup, both), outputs compared token for token,
beside fastgemma's 7.87 -> 9.19 tok/s (+16.8%, seed 000).

    .venv/bin/python bench/bench_tool_speculation.py --tokenizer TOKENIZER.json [--requests 25] [--max-tokens 48]

The workload is the seed's shape: 12 tools x 4 parameters (string, integer, enum, boolean) declared in Gemma 4's
native format in a system turn (~1.6k tokens, prefilled once and copied per request: KvArena.copy_slot), 25 user
requests, tool_choice required (the constraint splitgemma.serving.tool_calls.gemma_tools_lark builds), greedy. Each
request is decoded by the decode worker's own batch loop (services/decode/batch.py, in process, one sequence at a
time as in the seed's single-stream figure) once per arm, the arms alternated in a rotating order (the host is
shared). Decode tok/s = generated tokens / wall time from admission to the last token (prefill excluded, host work,
mask time and sampling included). Gemma 3's tokenizer.json (262,144 ids, what `splitgemma convert` writes beside a
Gemma 3 GGUF) stands in for Gemma 4's: its <unusedN> ids sit where Gemma 4 has its tool markers (46-52), and
<start_of_turn>/<end_of_turn> are 105/106 in both.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path

TOOLS = {
    "get_weather": "Get the current weather and a short forecast for a city.",
    "send_email": "Send an email message to a recipient on behalf of the user.",
    "create_event": "Create a calendar event in the user's primary calendar.",
    "search_flights": "Search for available flights between two airports on a date.",
    "convert_currency": "Convert an amount of money from one currency to another at today's rate.",
    "book_hotel": "Book a hotel room in a city for a number of nights.",
    "translate_text": "Translate a piece of text into another language.",
    "set_reminder": "Set a reminder that notifies the user at a given time.",
    "query_database": "Run a read-only query against the analytics database.",
    "play_music": "Play a song, an album or a playlist on the user's speakers.",
    "order_food": "Order food for delivery from a nearby restaurant.",
    "get_stock_price": "Look up the latest trading price of a stock by its ticker.",
}
PARAMS = {"city": ("string", "The city or place the request is about, e.g. Paris."),
          "count": ("integer", "How many items, days, nights or units the request needs."),
          "mode": ("enum", "How to carry the request out: fast, slow or auto."),
          "flag": ("boolean", "Whether to confirm with the user before acting.")}
CITIES = "Tokyo Paris Lima Oslo Cairo Austin Seoul Lagos Quito Perth Dublin Hanoi Rome".split()


def tools_spec():
    props = {"city": {"type": "string"}, "count": {"type": "integer"},
             "mode": {"type": "string", "enum": ["fast", "slow", "auto"]}, "flag": {"type": "boolean"}}
    return [{"name": n, "parameters": {"type": "object", "properties": props,
                                       "required": ["city", "count", "flag", "mode"]}} for n in TOOLS]


def prompt_ids(enc, user: str) -> tuple[list[int], list[int]]:
    """(shared prefix: bos + the system turn with the declarations, this request's user and model turns)."""
    d = 52
    ids = [2, 105] + enc("system\nYou are a helpful assistant. Call exactly one tool.\n")
    for name, desc in TOOLS.items():
        ids += [46] + enc(f"declaration:{name}{{description:") + [d] + enc(desc) + [d] + enc(",parameters:{properties:{")
        for i, (p, (typ, pdesc)) in enumerate(PARAMS.items()):
            ids += enc(f"{',' if i else ''}{p}:{{description:") + [d] + enc(pdesc) + [d] + enc(",type:") + [d]
            ids += enc("STRING" if typ in ("string", "enum") else typ.upper()) + [d]
            if typ == "enum":
                ids += enc(",enum:[") + [d] + enc("fast") + [d, *enc(",")] + [d] + enc("slow") + [d, *enc(",")]
                ids += [d] + enc("auto") + [d] + enc("]")
            ids += enc("}")
        ids += enc("},required:[") + [d] + enc("city") + [d] + enc("],type:") + [d] + enc("OBJECT") + [d]
        ids += enc("}}") + [47]
    ids += [106] + enc("\n")
    return ids, [105] + enc("user\n" + user) + [106] + enc("\n") + [105] + enc("model\n")


def user_messages(n: int) -> list[str]:
    names = list(TOOLS)
    out = []
    for i in range(n):
        tool, city = names[i % len(names)], CITIES[i % len(CITIES)]
        out.append(f"Please use {tool} for {city}: count {i + 2}, mode {['fast', 'slow', 'auto'][i % 3]}, and "
                   f"{'do' if i % 2 else 'do not'} confirm first. The city is {city}, the count is {i + 2}.")
    return out


class _Slots:
    """What the batch loop asks of the slot table: nothing to free here (the bench owns its arena)."""

    def finish(self, slot: int) -> None:
        pass

    def counts(self) -> dict:
        return {"free": 0, "leased": 0, "running": 0, "quarantine": 0}


async def decode_one(batch, seq) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    batch.admit(seq)
    toks = []
    while True:
        ev = await seq.queue.get()
        if isinstance(ev, Exception):
            raise ev
        toks += [t.token_id for t in ev.tokens]
        if ev.finish_reason:
            return toks, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(Path.home() / ".cache/splitgemma/shared/e2b-random.fgm"))
    ap.add_argument("--tokenizer", required=True, help="a 262,144-id Gemma tokenizer.json")
    ap.add_argument("--requests", type=int, default=25)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--lookup-k", type=int, default=4)
    ap.add_argument("--arms", default="baseline,forced,lookup,both")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import numpy as np
    from prometheus_client import CollectorRegistry
    from tokenizers import Tokenizer

    from splitgemma.engine import Model, open_arena
    from splitgemma.serving.grammar import Grammars
    from splitgemma.serving.logits import choose
    from splitgemma.serving.tool_calls import MarkerIds, gemma_tools_lark
    from splitgemma.serving.worker import sampling_kwargs
    from splitgemma.services.decode.batch import BatchLoop, Sequence
    from splitgemma.services.decode.server import DecodeMetrics
    from splitgemma.services.decode.speculation import SpeculationConfig
    from splitgemma.v1 import serving_pb2 as pb

    tok = Tokenizer.from_file(args.tokenizer)

    def enc(s):
        return tok.encode(s, add_special_tokens=False).ids

    model = Model(args.model, max_context=4096, chunk=256, max_batch=8)
    arena = open_arena(model, 3)
    stop = (1, 106)
    grammars = Grammars(args.tokenizer, stop, model.vocab_size)
    t0 = time.perf_counter()
    grammars.tokenizer
    tok_build = time.perf_counter() - t0
    grammar = gemma_tools_lark(tools_spec(), MarkerIds(call_open=48, call_close=49, string_delim=52,
                                                       tool_response=None), required=True, parallel=False)
    constraint = pb.Constraint(lark=grammar)
    t0 = time.perf_counter()
    grammars.matcher(constraint)
    compile_s = time.perf_counter() - t0

    prefix, _ = prompt_ids(enc, "")
    t0 = time.perf_counter()
    model.prefill(arena, 0, prefix)
    prefix_s = time.perf_counter() - t0
    sampling = sampling_kwargs(pb.SamplingParams(temperature=0))
    loop = asyncio.new_event_loop()
    arms = args.arms.split(",")
    configs = {"baseline": SpeculationConfig(forced=False, lookup_k=0),
               "forced": SpeculationConfig(forced=True, lookup_k=0),
               "lookup": SpeculationConfig(forced=False, lookup_k=args.lookup_k),
               "both": SpeculationConfig(forced=True, lookup_k=args.lookup_k)}
    loops = {}
    for a in arms:
        metrics = DecodeMetrics(CollectorRegistry(), _Slots())
        loops[a] = BatchLoop(model, arena, _Slots(), loop, metrics, configs[a])
        loops[a].start()
    res = {a: {"tokens": 0, "seconds": 0.0, "outputs": [], "rates": []} for a in arms}
    for i, user in enumerate(user_messages(args.requests)):
        _, suffix = prompt_ids(enc, user)
        arena.copy_slot(1, arena, 0)
        last = model.prefill(arena, 1, suffix, pos0=len(prefix))
        n_prompt = len(prefix) + len(suffix)
        order = arms[i % len(arms):] + arms[:i % len(arms)]
        for a in order:
            arena.copy_slot(2, arena, 1)
            m = grammars.matcher(constraint)
            m.mask()
            first = choose(np.asarray(last), allowed=m.allowed(), proc=None, argmax_only=True, rng_state=0,
                           sampling=sampling)
            seq = Sequence(request_id=f"r{i}-{a}", slot=2, prompt_tokens=n_prompt, first=first, sampling=sampling,
                           logprobs=False, rng_state=0, max_tokens=args.max_tokens, max_context=model.max_context,
                           stop_ids=frozenset(stop), text=None, token_name=str, queue=asyncio.Queue(), matcher=m,
                           prompt_ids=tuple(prefix + suffix))
            toks, secs = loop.run_until_complete(decode_one(loops[a], seq))
            res[a]["tokens"] += len(toks) - 1  # the first token is the prefill's
            res[a]["seconds"] += secs
            res[a]["outputs"].append(toks)
            res[a]["rates"].append((len(toks) - 1) / secs)
    for a in arms:
        loops[a].stop()
    ref = res[arms[0]]["outputs"]
    report = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "backend": model.backend, "load_average": os.getloadavg(), "requests": args.requests,
              "max_tokens": args.max_tokens, "prompt_tokens": len(prefix) + len(suffix),
              "prefix_prefill_s": round(prefix_s, 2), "tokenizer_build_s": round(tok_build, 2),
              "grammar_compile_ms": round(compile_s * 1000, 2), "arms": {}}
    for a in arms:
        r, st = res[a], loops[a].stats
        mask = loops[a].metrics.mask_seconds
        samples = {s.name: s.value for s in mask.collect()[0].samples}
        report["arms"][a] = {
            "decode_tok_s": round(r["tokens"] / r["seconds"], 3), "tokens": r["tokens"],
            "steps": st.steps, "engine_s": round(st.decode_seconds, 2), "host_s": round(st.host_seconds, 2),
            "forced_tokens": st.forced_tokens, "drafted": st.drafted, "accepted": st.accepted,
            "mask_ms_per_call": round(1000 * samples.get("splitgemma_decode_grammar_mask_seconds_sum", 0)
                                      / max(1, samples.get("splitgemma_decode_grammar_mask_seconds_count", 0)), 3),
            "identical_to_" + arms[0]: r["outputs"] == ref,
            "finished_by_grammar": sum(1 for o in r["outputs"] if o and o[-1] in stop or len(o) < args.max_tokens)}
    report["tok_s_vs_" + arms[0]] = {a: round(report["arms"][a]["decode_tok_s"]
                                              / report["arms"][arms[0]]["decode_tok_s"], 3) for a in arms}
    # Paired per request (the arms of one request ran back to back, so they saw about the same load): the median
    # and range of each arm's tok/s over the first arm's.
    for a in arms:
        ratios = sorted(x / b for x, b in zip(res[a]["rates"], res[arms[0]]["rates"]))
        report["arms"][a]["per_request_tok_s_median"] = round(statistics.median(res[a]["rates"]), 3)
        report["arms"][a]["paired_ratio_median"] = round(statistics.median(ratios), 3)
        report["arms"][a]["paired_ratio_range"] = [round(ratios[0], 3), round(ratios[-1], 3)]
    report["sample_output"] = tok.decode(ref[0], skip_special_tokens=False)
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
