"""Build the transformers-made test fixtures tests/fixtures/g4-*: small random Gemma 4 text models in the released
checkpoint's format, with transformers' fp32 logits as the reference.

Run from the repository root with the torch environment (torch and transformers are never runtime dependencies):

    /work/fxenv/bin/python -m tests.tools.make_fixtures [--only g4-e2b ...] [--project-python .venv/bin/python]

For each fixture it writes config.json, model.safetensors, reference.npz and README.txt (the README records exactly
how the files were made and what was observed). The `fgm_*` references are transformers run with every weight
replaced by its value decoded from the .fgm that the project's converter makes of the checkpoint; that conversion and
the decoding (tools.fgm_decode, which needs splitgemma._native) run in the project's venv, in a subprocess
(`--fgm-stage`). The digest of the converted tensors is stored so that tests can tell when a converter change made
the fgm_* references stale.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .reference_forward import HF_PREFIX, LM_HEAD, forward, live_weights, load_hf_checkpoint, max_rel_err

REPO = Path(__file__).resolve().parents[2]
FIXTURES_DIR = REPO / "tests" / "fixtures"
GREEDY_STEPS = 16
CANDIDATES = 128  # random prompts tried per prompt length
CLEAR_MARGIN = 0.05  # a top1-top2 logit gap an int8-activation engine should not flip (logit std ~0.57)
S, F = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Spec:
    why: str
    vocab: int
    hidden: int
    layer_types: tuple
    n_shared: int  # num_kv_shared_layers
    heads: int
    kv_heads: int
    head_dim: int
    global_head_dim: int
    intermediate: int
    double_wide: bool
    ple_dim: int
    window: int
    qk_scale: float  # factor on every q_norm/k_norm weight: attention logits ~ qk_scale^2 * sqrt(hd)
    group: int  # int4 group of the conversion
    seed: int
    prompt_lengths: tuple


SPECS = {
    "g4-e2b": Spec(
        why="well-conditioned E2B-like model: MQA, double-wide MLP on the KV-shared layers, KV producers of both "
        "types (sliding fs-2, full fs-1 as in E2B), every linear K a multiple of 128 (all rotated)",
        vocab=512, hidden=128, layer_types=(S, S, F, S, S, F), n_shared=3, heads=4, kv_heads=1, head_dim=64,
        global_head_dim=128, intermediate=128, double_wide=True, ple_dim=128, window=16, qk_scale=0.3, group=128,
        seed=4201, prompt_lengths=(24, 64, 100),
    ),
    "g4-e2b-sharp": Spec(
        why="stress case: g4-e2b with q/k-norm weights ~1 (razor-sharp attention, attention scale 1.0), same draws",
        vocab=512, hidden=128, layer_types=(S, S, F, S, S, F), n_shared=3, heads=4, kv_heads=1, head_dim=64,
        global_head_dim=128, intermediate=128, double_wide=True, ple_dim=128, window=16, qk_scale=1.0, group=128,
        seed=4201, prompt_lengths=(24, 64, 100),
    ),
    "g4-e4b": Spec(
        why="well-conditioned E4B-like model: 2 KV heads (GQA), no double-wide MLP, pattern s,s,s,F x2 with 3 shared "
        "layers (sliding producer after the full one), head_dim 32/64, vocab 768, int4 group 64, sliding window 24 "
        "(= the shortest prompt); down_proj (K=192) and per_layer_projection (K=64) are not multiples of 128, so "
        "the converter stores them unrotated (hadamard 0)",
        vocab=768, hidden=128, layer_types=(S, S, S, F, S, S, S, F), n_shared=3, heads=4, kv_heads=2, head_dim=32,
        global_head_dim=64, intermediate=192, double_wide=False, ple_dim=64, window=24, qk_scale=0.3, group=64,
        seed=4202, prompt_lengths=(24, 64, 100),
    ),
}


def text_config(spec: Spec) -> dict:
    """The decoder fields, as the released config.json spells them (explicit global_head_dim, no per_layer_config)."""
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_k_eq_v": False,
        "bos_token_id": 2,
        "dtype": "bfloat16",
        "enable_moe_block": False,
        "eos_token_id": [1, 106],
        "final_logit_softcapping": 30.0,
        "global_head_dim": spec.global_head_dim,
        "head_dim": spec.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": spec.hidden,
        "hidden_size_per_layer_input": spec.ple_dim,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate,
        "layer_types": list(spec.layer_types),
        "max_position_embeddings": 4096,
        "model_type": "gemma4_text",
        "moe_intermediate_size": None,
        "num_attention_heads": spec.heads,
        "num_experts": None,
        "num_global_key_value_heads": None,
        "num_hidden_layers": len(spec.layer_types),
        "num_key_value_heads": spec.kv_heads,
        "num_kv_shared_layers": spec.n_shared,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
        "sliding_window": spec.window,
        "tie_word_embeddings": True,
        "top_k_experts": None,
        "use_bidirectional_attention": None,
        "use_cache": True,
        "use_double_wide_mlp": spec.double_wide,
        "vocab_size": spec.vocab,
        "vocab_size_per_layer_input": spec.vocab,
    }


def full_config(tc: dict, transformers_version: str) -> dict:
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "tie_word_embeddings": True,
        "transformers_version": transformers_version,
        "text_config": tc,
    }


# ---------------------------------------------------------------------------------------------------------------
# torch side


def hf_model(tc: dict, weights: dict[str, np.ndarray] | None = None):
    """An fp32 eager-attention Gemma4ForCausalLM; with `weights` (HF names), loaded strictly from them.

    If the weights carry their own `lm_head.weight` (a decoded .fgm), the head is untied and loaded separately.
    """
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    cfg_kwargs = dict(tc)
    untied = weights is not None and LM_HEAD in weights
    if untied:
        cfg_kwargs["tie_word_embeddings"] = False
    config = Gemma4TextConfig(**cfg_kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(0)  # the initial values are overwritten; seeding only keeps runs reproducible
    model = Gemma4ForCausalLM(config).float().eval()
    assert model.config._attn_implementation == "eager"
    if weights is not None:
        state = {}
        for name, arr in weights.items():
            key = name if name == LM_HEAD else "model." + name[len(HF_PREFIX):]
            state[key] = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
        result = model.load_state_dict(state, strict=False)
        allowed_missing = set() if untied else {LM_HEAD}  # a tied head follows embed_tokens
        if set(result.missing_keys) != allowed_missing or result.unexpected_keys:
            raise RuntimeError(f"weights do not fit the model: missing {result.missing_keys[:5]}, "
                               f"unexpected {result.unexpected_keys[:5]}")
        tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        if tied == untied:
            raise RuntimeError(f"lm_head tying is {tied}, expected {not untied}")
    return model


def random_checkpoint(spec: Spec, tc: dict) -> dict[str, np.ndarray]:
    """Every weight, norm and layer_scalar drawn at random and rounded to bf16; HF names, float32 values.

    norms 1 + 0.2 N(0,1); q_norm/k_norm then x qk_scale; other weights 0.05 N(0,1); layer_scalar U(0.8, 1.2).
    The KV-shared layers also get dead k_proj/v_proj/k_norm, as the released checkpoint ships them.
    """
    import torch

    def bf16(t):
        return t.to(torch.bfloat16).to(torch.float32)

    model = hf_model(tc)
    gen = torch.Generator().manual_seed(spec.seed)
    shapes = [(k, tuple(v.shape)) for k, v in model.state_dict().items() if k != LM_HEAD]
    first_shared = len(spec.layer_types) - spec.n_shared
    for i in range(first_shared, len(spec.layer_types)):
        hd = spec.global_head_dim if spec.layer_types[i] == F else spec.head_dim
        for p in ("k_proj", "v_proj"):
            shapes.append((f"model.layers.{i}.self_attn.{p}.weight", (spec.kv_heads * hd, spec.hidden)))
        shapes.append((f"model.layers.{i}.self_attn.k_norm.weight", (hd,)))
    out = {}
    for name, shape in shapes:
        if name.endswith("layer_scalar"):
            t = bf16(0.8 + 0.4 * torch.rand(shape, generator=gen))
        elif name.endswith("norm.weight"):
            t = bf16(1.0 + 0.2 * torch.randn(shape, generator=gen))
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                t = bf16(t * spec.qk_scale)
        else:
            t = bf16(0.05 * torch.randn(shape, generator=gen))
        out[HF_PREFIX + name[len("model."):]] = t.numpy()
    return out


def save_checkpoint(out_dir: Path, spec: Spec, weights: dict[str, np.ndarray]) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = full_config(text_config(spec), transformers.__version__)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tensors = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in sorted(weights.items())}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def run_logits(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([list(ids)]), use_cache=False).logits[0].numpy().astype(np.float32)


def greedy_nocache(model, prompt, steps=GREEDY_STEPS):
    seq, ids, step_logits = list(prompt), [], []
    for _ in range(steps):
        last = run_logits(model, seq)[-1]
        tok = int(np.argmax(last))
        ids.append(tok)
        step_logits.append(last)
        seq.append(tok)
    return np.asarray(ids, np.int32), np.stack(step_logits)


def greedy_cached(model, prompt, steps=GREEDY_STEPS):
    """Incremental decoding with transformers' KV cache: (ids, step logits). Used to screen prompts quickly and to
    check the no-cache references against HF's own cache."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(prompt)]), use_cache=True)
        ids, step_logits = [], []
        for _ in range(steps):
            last = out.logits[0, -1]
            ids.append(int(last.argmax()))
            step_logits.append(last.numpy().astype(np.float32))
            out = model(input_ids=torch.tensor([[ids[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return np.asarray(ids, np.int32), np.stack(step_logits)


def margins(step_logits: np.ndarray) -> np.ndarray:
    top2 = np.sort(step_logits, axis=-1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def clear_prefix(step_logits: np.ndarray) -> int:
    """How many leading greedy steps have a top1-top2 margin of at least CLEAR_MARGIN."""
    fragile = np.flatnonzero(margins(step_logits) < CLEAR_MARGIN)
    return int(fragile[0]) if fragile.size else len(step_logits)


def choose_prompt(models: dict, vocab: int, length: int, seed: int):
    """Among CANDIDATES seeded random prompts (<bos> then ids uniform in [4, vocab)), pick by, in order: both .fgm
    greedy paths have >= 8 distinct tokens (no degenerate loop); the longest prefix of steps clear on both paths
    (margin >= CLEAR_MARGIN); the largest smallest margin over both paths.

    Only the .fgm paths count: an engine reads the .fgm and runs with int8 activations, so it can follow these paths
    only while their margins exceed its error, and a random model's margins are too small for all 16 steps to be
    clear; the float64 oracle, the only consumer of the checkpoint path, is ~1e-6 from transformers."""
    best = None
    for j in range(CANDIDATES):
        rng = np.random.default_rng(seed + 1000 * j + length)
        prompt = np.concatenate([[2], rng.integers(4, vocab, size=length - 1)]).astype(np.int32)
        paths = [greedy_cached(models[name], prompt) for name in ("fgm_int4", "fgm_int8")]
        key = (all(len(set(ids.tolist())) >= 8 for ids, _ in paths),
               min(clear_prefix(logits) for _, logits in paths),
               min(float(margins(logits).min()) for _, logits in paths))
        if best is None or key > best[0]:
            best = (key, j, prompt)
    return best[1], best[2]


# ---------------------------------------------------------------------------------------------------------------
# project side (runs in the project's venv)


def fgm_stage(ckpt: str, fgm_out: str, group: int, npz_out: str) -> None:
    """Convert with the project's converter, decode with tools.fgm_decode, save int4/int8 HF-named weights."""
    from splitgemma.fgm.convert import convert_checkpoint

    from .fgm_decode import FgmReader

    convert_checkpoint(ckpt, fgm_out, weights="dual", group=group, progress=False)
    reader = FgmReader(fgm_out)
    arrays = {"sha256": np.array(reader.tensor_sha256())}
    for ffn in ("int4", "int8"):
        for k, v in reader.hf_weights(ffn=ffn).items():
            arrays[f"{ffn}:{k}"] = v
    np.savez(npz_out, **arrays)


def decoded_fgm(ckpt: Path, group: int, project_python: str, work: Path):
    fgm, npz = work / "model.fgm", work / "decoded.npz"
    cmd = [project_python, "-m", "tests.tools.make_fixtures", "--fgm-stage", str(ckpt), str(fgm), str(group), str(npz)]
    subprocess.run(cmd, cwd=REPO, check=True)
    data = np.load(npz)
    weights = {ffn: {k.split(":", 1)[1]: data[k] for k in data.files if k.startswith(ffn + ":")}
               for ffn in ("int4", "int8")}
    return str(data["sha256"]), fgm.stat().st_size, weights


# ---------------------------------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_fixture(name: str, spec: Spec, project_python: str) -> None:
    import safetensors
    import torch
    import transformers

    torch.set_num_threads(1)
    out = FIXTURES_DIR / name
    tc = text_config(spec)
    weights = random_checkpoint(spec, tc)
    save_checkpoint(out, spec, weights)

    # The checkpoint as written must rebuild the model: reload it exactly as a test would.
    cfg_loaded, w_loaded = load_hf_checkpoint(out)
    assert cfg_loaded == tc and set(w_loaded) == set(weights)
    assert all(np.array_equal(w_loaded[k], weights[k]) for k in weights)
    live = live_weights(weights, tc)

    with tempfile.TemporaryDirectory() as tmp:
        sha, fgm_size, decoded = decoded_fgm(out, spec.group, project_python, Path(tmp))
    models = {"bf16": hf_model(tc, live), "fgm_int4": hf_model(tc, decoded["int4"]),
              "fgm_int8": hf_model(tc, decoded["int8"])}
    oracle_weights = {"bf16": live, "fgm_int4": decoded["int4"], "fgm_int8": decoded["int8"]}
    prefix = {"bf16": "", "fgm_int4": "fgm_int4_", "fgm_int8": "fgm_int8_"}

    arrays = {"prompt_lengths": np.asarray(spec.prompt_lengths, np.int32), "fgm_group": np.int32(spec.group),
              "fgm_tensor_sha256": np.array(sha)}
    notes = []
    for j, length in enumerate(spec.prompt_lengths):
        cand, prompt = choose_prompt(models, spec.vocab, length, spec.seed + 7)
        arrays[f"prompt_ids_{j}"] = prompt
        arrays[f"prompt_candidate_index_{j}"] = np.int32(cand)
        notes.append(f"  prompt {j}: {length} tokens, candidate {cand} of {CANDIDATES}")
        for kind, model in models.items():
            logits = run_logits(model, prompt)
            ids, step_logits = greedy_nocache(model, prompt)
            if not np.array_equal(greedy_cached(model, prompt)[0], ids):
                raise RuntimeError(f"{name} prompt {j} {kind}: cached decoding differs from the no-cache greedy")
            p = prefix[kind]
            arrays[f"{p}logits_{j}"] = logits
            arrays[f"{p}greedy_ids_{j}"] = ids
            arrays[f"{p}greedy_step_logits_{j}"] = step_logits
            # The float64 oracle against transformers, here as in tests/test_reference.py.
            err = max_rel_err(forward(oracle_weights[kind], tc, prompt), logits)
            seq = np.concatenate([prompt, ids[:-1]])
            err_steps = max_rel_err(forward(oracle_weights[kind], tc, seq)[length - 1:], step_logits)
            m = margins(step_logits)
            notes.append(
                f"    {kind:9s} logit std {logits.std():.3f}; greedy min top1-top2 margin {m.min():.4f} "
                f"(steps < {CLEAR_MARGIN}: {np.flatnonzero(m < CLEAR_MARGIN).tolist()}); prompt-position min margin "
                f"{margins(logits).min():.4f}; float64 reference vs transformers: prompt {err:.2e}, steps "
                f"{err_steps:.2e}")
        agree4 = float(np.mean(arrays[f"fgm_int4_logits_{j}"].argmax(1) == arrays[f"logits_{j}"].argmax(1)))
        agree8 = float(np.mean(arrays[f"fgm_int8_logits_{j}"].argmax(1) == arrays[f"logits_{j}"].argmax(1)))
        rms4 = float(np.sqrt(np.mean((arrays[f"fgm_int4_logits_{j}"] - arrays[f"logits_{j}"]) ** 2)))
        rms8 = float(np.sqrt(np.mean((arrays[f"fgm_int8_logits_{j}"] - arrays[f"logits_{j}"]) ** 2)))
        notes.append(f"    fgm vs checkpoint logits: int4 RMS {rms4:.3f} argmax agreement {agree4:.3f}; "
                     f"int8 RMS {rms8:.3f} argmax agreement {agree8:.3f}")
    np.savez(out / "reference.npz", **arrays)

    versions = (f"Python {platform.python_version()}, torch {torch.__version__}, transformers "
                f"{transformers.__version__}, safetensors {safetensors.__version__}, numpy {np.__version__}")
    write_readme(out, name, spec, tc, versions, sha, fgm_size, notes)
    print(f"{name}: done")


def write_readme(out: Path, name: str, spec: Spec, tc: dict, versions: str, sha: str, fgm_size: int, notes) -> None:
    first_shared = len(spec.layer_types) - spec.n_shared
    producers = {t: max(i for i in range(first_shared) if spec.layer_types[i] == t) for t in set(spec.layer_types)}
    types = "".join("s" if t == S else "F" for t in spec.layer_types)
    widths = [spec.intermediate * (2 if spec.double_wide and i >= first_shared else 1) for i in range(len(types))]
    files = "\n".join(f"  {sha256_file(out / f)}  {f}  ({(out / f).stat().st_size:,} bytes)"
                      for f in ("config.json", "model.safetensors", "reference.npz"))
    keys = "\n".join(f"  {line}" for line in (
        "prompt_lengths          int32 [3]",
        "prompt_ids_{j}          int32 [T_j]  token 0 is 2 (<bos>), the others uniform in [4, vocab), seeded",
        "prompt_candidate_index_{j} int32   which of the candidates was chosen (rule below)",
        "logits_{j}              float32 [T_j, V]  transformers fp32, eager attention, use_cache=False, every "
        "prompt position, after the final softcap",
        f"greedy_ids_{{j}}          int32 [{GREEDY_STEPS}]  argmax continuation (no eos stop), no-cache recompute "
        "per step; identical to transformers' cached incremental decoding (checked)",
        f"greedy_step_logits_{{j}}  float32 [{GREEDY_STEPS}, V]  the last-position logits that chose each greedy token",
        "fgm_int4_{logits,greedy_ids,greedy_step_logits}_{j}: the same with every weight replaced by its value decoded "
        "from the .fgm (dequantised, Hadamard rotation undone; embedding from the q4r table, LM head from the "
        "separate q4g lm_head tensor, untied), FFN weights int4 (q4g)",
        "fgm_int8_*_{j}          the same with the .i8 int8 twins of the FFN weights",
        "fgm_group               int32  the --group of the conversion",
        "fgm_tensor_sha256       str    tools.fgm_decode.FgmReader.tensor_sha256() of that .fgm (all tensors: name, "
        "dtype, shape, hadamard, group, bytes; not offsets or header meta): tests re-convert and compare, and a "
        "mismatch means the fgm_* arrays are stale",
    ))
    text = f"""{name}: small random Gemma 4 text decoder + transformers reference logits
(made by tests/tools/make_fixtures.py)

WHY: {spec.why}.

MODEL
  vocab {spec.vocab} (PLE vocab {spec.vocab}), hidden {spec.hidden}, {len(types)} layers [{','.join(types)}],
  {spec.heads} query heads, {spec.kv_heads} KV head(s),
  head_dim {spec.head_dim} (sliding) / global_head_dim {spec.global_head_dim} (full),
  intermediate {spec.intermediate}, use_double_wide_mlp {spec.double_wide} (per-layer MLP widths {widths}),
  num_kv_shared_layers {spec.n_shared} (first shared layer {first_shared};
  KV producers: sliding {producers.get(S)}, full {producers.get(F)}),
  hidden_size_per_layer_input {spec.ple_dim}, sliding_window {spec.window}, RoPE theta 1e4 (sliding, default) /
  1e6 proportional with partial_rotary_factor 0.25 (full), final_logit_softcapping 30.0, tied embeddings,
  attention scaling 1.0 (Gemma 4), q_norm/k_norm weights scaled by {spec.qk_scale}.

HOW EACH FILE WAS MADE
  Environment: {versions}; torch.set_num_threads(1).
  Command: cd <repo> && /work/fxenv/bin/python -m tests.tools.make_fixtures --only {name}
  Weights: Gemma4ForCausalLM(Gemma4TextConfig(**text_config)) gives the tensor names and shapes; every tensor is
    then drawn with torch.Generator().manual_seed({spec.seed}) in state_dict order (then the dead tensors below):
    *norm.weight = 1 + 0.2*N(0,1), every other weight = 0.05*N(0,1), layer_scalar = U(0.8, 1.2), each rounded
    to bfloat16; then q_norm/k_norm weights w <- bf16(w * {spec.qk_scale}). The fp32 models hold exactly these
    bf16 values.
  config.json: nested like the released google/gemma-4-E2B-it config (model_type gemma4, architectures
    Gemma4ForConditionalGeneration, decoder fields under text_config with an explicit global_head_dim and no
    per_layer_config). Gemma4TextConfig(**text_config) rebuilds the model.
  model.safetensors: one file, every tensor BF16, names model.language_model.<Gemma4TextModel name>, sorted,
    metadata {{"format": "pt"}}, lm_head not stored (tied). The KV-shared layers {first_shared}..{len(types) - 1} also
    carry dead self_attn.k_proj/v_proj/k_norm tensors (random), as the released checkpoint does; transformers
    ignores them and a converter must drop them.
  .fgm (not stored; tests re-create it): splitgemma.fgm.convert.convert_checkpoint(<this dir>, out,
    weights="dual", group={spec.group}); {fgm_size:,} bytes; tensor digest {sha}.
  Prompts: for each length, {CANDIDATES} candidates (numpy default_rng(seed {spec.seed + 7} + 1000*j + length)),
    screened by their greedy paths under the two .fgm-decoded models (fgm int4, fgm int8); chosen by, in order:
    both paths have >= 8 distinct tokens; the longest prefix of steps whose top1-top2 margin is >= {CLEAR_MARGIN} on
    both paths; the largest smallest margin. The checkpoint path is not optimised (its only consumer, the float64
    oracle, is ~1e-6 from transformers). A random model's margins are too small for every step to be clear: an
    engine with int8 activations can be expected to follow a greedy path up to its first step with a margin
    below its logit error ("steps < {CLEAR_MARGIN}" below), and beyond that should compare teacher-forced step
    logits with a tolerance.

reference.npz (np.savez, uncompressed; j = 0..2 indexes the prompts)
{keys}

OBSERVED NUMBERS (V = {spec.vocab})
{chr(10).join(notes)}

SHA-256
{files}
"""
    (out / "README.txt").write_text(text)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", choices=sorted(SPECS), help="fixtures to build (default: all)")
    ap.add_argument("--project-python", default=str(REPO / ".venv" / "bin" / "python"),
                    help="python of the project's venv (has splitgemma._native) for the conversion stage")
    ap.add_argument("--fgm-stage", nargs=4, metavar=("CKPT", "FGM", "GROUP", "NPZ"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.fgm_stage:
        ckpt, fgm, group, npz = args.fgm_stage
        fgm_stage(ckpt, fgm, int(group), npz)
        return
    for name in args.only or sorted(SPECS):
        make_fixture(name, SPECS[name], args.project_python)


if __name__ == "__main__":
    main(sys.argv[1:])
