"""splitgemma score: the logits of every prompt position, saved as a .npy file (for comparisons with references)."""
from __future__ import annotations

import argparse


def register(subparsers) -> None:
    from splitgemma.commands.generate import add_engine_options
    p = subparsers.add_parser(
        "score", help="write the logits of every prompt position to a .npy file",
        description="Run the token ids through the engine in one prefill that keeps every position's logits "
                    "(Model.prefill(..., all_logits=True): every row through every layer, no KV-shared "
                    "shortcut) and save them as float32 [T, V] with numpy.save. Row t holds the logits that "
                    "predict token t+1. Under --weights auto:M a pass of fewer than M rows (a short prompt or a "
                    "short last chunk) uses the int4 FFN weights; fix --weights for comparisons.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_options(p)
    p.add_argument("--tokens", required=True, metavar="IDS", help="token ids: comma-separated, or a .npy file")
    p.add_argument("--out", required=True, metavar="LOGITS.npy", help="output file (replaced if it exists)")
    p.set_defaults(func=run)


def run(args) -> int:
    import time

    import numpy as np

    from splitgemma.commands.generate import check_token_ids, open_model, parse_token_ids, use_default_model
    from splitgemma.engine import open_arena

    use_default_model(args)
    prompt = parse_token_ids(args.tokens)
    model = open_model(args, max_context=len(prompt))
    ids = check_token_ids(prompt, model.vocab_size)
    arena = open_arena(model, 1)
    t0 = time.perf_counter()
    logits = model.prefill(arena, 0, ids, all_logits=True)
    seconds = time.perf_counter() - t0
    with open(args.out, "wb") as f:  # a file object: np.save(path) would append .npy to other names
        np.save(f, logits)
    print(f"wrote {args.out}: float32 {list(logits.shape)} logits, {seconds:.3f} s "
          f"({len(prompt) / seconds:.1f} tok/s, {model.backend}, weights {model.weights}, {model.threads} threads)")
    return 0
