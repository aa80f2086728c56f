#!/usr/bin/env python3
"""What the tool-call grammar costs with llguidance on a full Gemma vocabulary: compiling it, and the token mask per
step along one well-formed call, for a fastgemma-shaped workload (12 tools × 4 parameters: string, integer, enum,
boolean; tool_choice required).

    python bench/bench_tool_grammar.py --tokenizer ~/.cache/splitgemma/gemma-3-270m/gemma-3-270m.tokenizer.json

Gemma 3's tokenizer (262,144 tokens, what `splitgemma up` converts) holds <unusedN> placeholders at the ids where
Gemma 4 has its tool markers (48, 49, 50, 52), which stand in for them here. Rows: tokenizer load, grammar compile,
mask time per step (median, max), steps whose mask admits a single token.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

TOOL_NAMES = ("get_weather send_email create_event search_flights convert_currency book_hotel translate_text "
              "set_reminder query_database play_music order_food get_stock_price").split()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="a Gemma tokenizer.json")
    args = ap.parse_args(argv)

    import llguidance
    from tokenizers import Tokenizer

    from splitgemma.serving.tool_calls import MarkerIds, gemma_tools_lark

    with open(args.tokenizer) as f:
        text = f.read()
    tok = Tokenizer.from_str(text)
    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(text, eos_token=[1, 106])
    load = time.perf_counter() - t0

    ids = MarkerIds(call_open=48, call_close=49, string_delim=52, tool_response=50)
    tools = [{"name": name, "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "count": {"type": "integer"},
        "mode": {"type": "string", "enum": ["fast", "slow", "auto"]}, "flag": {"type": "boolean"}},
        "required": ["city", "count", "flag", "mode"]}} for name in TOOL_NAMES]
    grammar = gemma_tools_lark(tools, ids, required=True, parallel=False)
    t0 = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    assert not matcher.is_error(), matcher.get_error()

    def enc(s):
        return tok.encode(s, add_special_tokens=False).ids

    d = ids.string_delim
    call = ([ids.call_open] + enc("call:search_flights{city:") + [d] + enc("Paris") + [d]
            + enc(",count:12,flag:true,mode:") + [d] + enc("slow") + [d] + enc("}") + [ids.call_close,
                                                                                  ids.tool_response])
    times, single = [], 0
    for token in call:
        t0 = time.perf_counter()
        mask = matcher.compute_bitmask()
        times.append(time.perf_counter() - t0)
        bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:lltok.vocab_size]
        single += int(bits.sum() == 1)
        assert matcher.consume_token(token), matcher.get_error()
    assert matcher.is_accepting()
    print(f"llguidance {llguidance.__version__}, vocabulary {lltok.vocab_size}")
    print(f"tokenizer load          {load:8.3f} s")
    print(f"grammar compile         {compile_s * 1000:8.2f} ms  (12 tools x 4 parameters)")
    print(f"mask per step           {statistics.median(times) * 1000:8.3f} ms median, {max(times) * 1000:.3f} ms max "
          f"over {len(call)} steps")
    print(f"single-token steps      {single:8d} of {len(call)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
