"""Grammar libraries on Gemma's vocabulary: tokenizer build time, compile time and mask time per step.

Measures llguidance (the library splitgemma uses, src/splitgemma/serving/grammar.py) and, when it is installed,
outlines-core, on the same tokenizer.json and the same constraints. xgrammar is not measured: its PyPI package
requires torch, transformers and triton (Requires-Dist), which the workers must not need at run time.

A "step" is what a constrained row costs the decode worker per token: compute the allowed-token mask for the
current state, then advance the state by the token taken. The token walked is a fixed valid output (tokenized
with the model's tokenizer), so every library does the same steps.

    .venv/bin/python bench/bench_grammar.py [--tokenizer PATH] [--repeat 3]

(outlines-core is measured when installed: `.venv/bin/pip install outlines-core`.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

DEFAULT_TOKENIZER = Path.home() / ".cache/splitgemma/peer/models/e2b-random/hf/tokenizer.json"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
# As json.dumps writes it: the separators splitgemma's JSON constraints use.
INSTANCE = json.dumps({"name": "Ada Lovelace", "age": 36, "score": 99.5, "role": "admin", "tags": ["math", "engines"],
                       "address": {"city": "London", "zip": "12345"}})
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}"
REGEX_TEXT = "555-123-4567"
CHOICES = ["positive", "negative", "neutral"]


def _ms(xs):
    xs = sorted(xs)
    return {"median_ms": round(statistics.median(xs) * 1e3, 4), "p99_ms": round(xs[int(0.99 * (len(xs) - 1))] * 1e3, 4),
            "max_ms": round(xs[-1] * 1e3, 4), "steps": len(xs)}


def bench_llguidance(tok_path: Path, hf, repeat: int) -> dict:
    import llguidance as llg

    text = tok_path.read_text()
    t0 = time.perf_counter()
    tok = llg.LLTokenizer(text, eos_token=1)
    out = {"library": f"llguidance {llg.get_version() if hasattr(llg, 'get_version') else ''}".strip(),
           "tokenizer_build_s": round(time.perf_counter() - t0, 3), "vocab": tok.vocab_size}
    cases = {"json_schema": (llg.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)), INSTANCE),
             "regex": (llg.LLMatcher.grammar_from_regex(REGEX), REGEX_TEXT),
             "choice": (llg.grammar_from("choice", CHOICES), CHOICES[1])}
    for name, (grammar, target) in cases.items():
        ids = hf.encode(target, add_special_tokens=False).ids
        compiles, steps = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            m = llg.LLMatcher(tok, grammar)
            compiles.append(time.perf_counter() - t0)
            assert not m.is_error(), m.get_error()
            for t in ids:
                t0 = time.perf_counter()
                mask = m.compute_bitmask()
                ok = m.consume_token(t)
                steps.append(time.perf_counter() - t0)
                assert ok and mask, m.get_error()
            assert m.is_accepting(), name
        out[name] = {"compile_ms_median": round(statistics.median(compiles) * 1e3, 3), **_ms(steps)}
    return out


def _outlines_vocabulary(hf, eos: int):
    """outlines-core's Vocabulary from a SentencePiece-style tokenizer.json: '▁' is a space, <0xNN> one byte."""
    from outlines_core import Vocabulary

    special = {t.content for t in hf.get_added_tokens_decoder().values() if t.special}
    vocab: dict[bytes, list[int]] = {}
    for piece, i in hf.get_vocab(with_added_tokens=True).items():
        if i == eos or piece in special:
            continue
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            b = bytes([int(piece[3:5], 16)])
        else:
            b = piece.replace("\u2581", " ").encode()
        vocab.setdefault(b, []).append(i)
    return Vocabulary(eos, vocab)


def bench_outlines(hf, repeat: int) -> dict:
    import importlib.metadata

    from outlines_core import Guide, Index
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    vocab = _outlines_vocabulary(hf, 1)
    out = {"library": f"outlines-core {importlib.metadata.version('outlines-core')}",
           "tokenizer_build_s": round(time.perf_counter() - t0, 3)}
    cases = {"json_schema": (build_regex_from_schema(json.dumps(SCHEMA)), INSTANCE),
             "regex": (REGEX, REGEX_TEXT), "choice": ("(" + "|".join(CHOICES) + ")", CHOICES[1])}
    for name, (regex, target) in cases.items():
        ids = hf.encode(target, add_special_tokens=False).ids
        compiles, steps = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            index = Index(regex, vocab)
            compiles.append(time.perf_counter() - t0)
            guide = Guide(index)
            for t in ids:
                t0 = time.perf_counter()
                allowed = guide.get_tokens()
                guide.advance(t)
                steps.append(time.perf_counter() - t0)
                assert allowed
        out[name] = {"compile_ms_median": round(statistics.median(compiles) * 1e3, 3), **_ms(steps)}
    return out


def bench_splitgemma(tok_path: Path, hf, repeat: int) -> dict:
    """The decode worker's own per-step work for a constrained row (splitgemma.serving.grammar): the masks of a
    batch of rows in one llguidance call, then the rows' samples in one native call (sample_rows with each row's
    bitmask), on random logits rows of the full vocabulary."""
    import numpy as np

    from splitgemma.engine import RowSampler, sample_rows
    from splitgemma.serving.grammar import Grammars, compute_masks
    from splitgemma.v1 import serving_pb2 as pb

    n_vocab = hf.get_vocab_size(with_added_tokens=True)
    g = Grammars(tok_path, (1, 106, 50), n_vocab)
    t0 = time.perf_counter()
    g.tokenizer
    out = {"library": "splitgemma.serving.grammar (llguidance)", "tokenizer_build_s": round(time.perf_counter() - t0, 3)}
    ids = hf.encode(INSTANCE, add_special_tokens=False).ids
    logits = np.random.default_rng(0).standard_normal(n_vocab).astype(np.float32)
    c = pb.Constraint(json_schema=json.dumps(SCHEMA))
    for rows in (1, 8):
        masks, picks = [], []
        for _ in range(repeat):
            ms = [g.matcher(c) for _ in range(rows)]
            samplers = [RowSampler(n_vocab, temperature=1.0, rng_state=1) for _ in range(rows)]
            for t in ids:
                t0 = time.perf_counter()
                compute_masks(ms)
                masks.append(time.perf_counter() - t0)
                batch = np.tile(logits, (rows, 1))
                t0 = time.perf_counter()
                sample_rows(batch, samplers, [m.bits for m in ms])
                picks.append((time.perf_counter() - t0) / rows)
                for m in ms:
                    m.advance(t)
        out[f"json_schema_{rows}_rows"] = {"mask_all_rows": _ms(masks), "sample_per_row": _ms(picks)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(args.tokenizer))
    results = [bench_llguidance(args.tokenizer, hf, args.repeat)]
    try:
        import splitgemma.serving.grammar  # noqa: F401
    except ImportError:
        results.append({"library": "splitgemma.serving.grammar", "skipped": "splitgemma not installed"})
    else:
        results.append(bench_splitgemma(args.tokenizer, hf, args.repeat))
    try:
        import outlines_core  # noqa: F401
    except ImportError:
        results.append({"library": "outlines-core", "skipped": "not installed"})
    else:
        results.append(bench_outlines(hf, args.repeat))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
