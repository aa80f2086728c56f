"""llama.cpp's top-1 at every position of the Gemma 3 270M passage (tests/fixtures/gemma3-270m/reference.json), for
test_gemma3's fidelity floor of the int8-activation path: an oracle from the peer engine, not from us.

llama-server from bench/peer_llamacpp.py's cached build (built from the llama-cpp-python sdist on PyPI) on the same
Q4_K_M GGUF that the default model is converted from. For each position i it evaluates the passage's first i+1 ids
(its prompt cache makes that one new token a request) and keeps the id of the highest logprob (n_probs, greedy).
llama.cpp quantises activations against these weights itself (Q8_0 / Q8_K blocks), so its agreement with
transformers' float32 forward is the fidelity a user of the peer gets.

    python tests/tools/make_llamacpp_picks.py            # writes tests/fixtures/gemma3-270m/llamacpp-top1.json
"""
from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from peer_llamacpp import build_info, cache_root, start_llama_server, stop_llama_server  # noqa: E402

from splitgemma.default_model import GGUF_NAME, model_dir  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "gemma3-270m"


def main() -> None:
    ref = json.loads((FIXTURE / "reference.json").read_text())
    ids = [int(i) for i in ref["passage"]["ids"]]
    gguf = model_dir() / GGUF_NAME
    p, base = start_llama_server(str(gguf), parallel=1, threads=2)
    try:
        url = base.removesuffix("/v1") + "/completion"
        picks = []
        for i in range(len(ids)):
            body = json.dumps({"prompt": ids[:i + 1], "n_predict": 1, "n_probs": 1, "temperature": 0,
                               "cache_prompt": True}).encode()
            with urllib.request.urlopen(urllib.request.Request(url, body, {"Content-Type": "application/json"})) as r:
                picks.append(json.load(r)["completion_probabilities"][0]["top_logprobs"][0]["id"])
    finally:
        stop_llama_server(p)
    chosen = json.loads((cache_root() / "chosen.json").read_text())
    out = {"gguf": GGUF_NAME, "llama_cpp": build_info(chosen["version"], chosen["variant"]), "threads": 2,
           "passage_top1": picks}
    (FIXTURE / "llamacpp-top1.json").write_text(json.dumps(out, indent=1) + "\n")
    top = [t[0] for t in ref["passage"]["top_ids"]]
    agree = sum(a == b for a, b in zip(picks, top)) / len(top)
    print(f"llama.cpp top-1 = transformers' at {agree:.2%} of {len(top)} positions")


if __name__ == "__main__":
    main()
