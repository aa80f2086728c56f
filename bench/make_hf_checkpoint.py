#!/usr/bin/env python3
"""Write a full-size random Gemma 4 checkpoint in Hugging Face layout, for converter benchmarks.

The output directory gets a ``config.json`` nested like Google's release (architecture
Gemma4ForConditionalGeneration, decoder fields under ``text_config``, explicit ``global_head_dim``)
and bf16 safetensors with the release's tensor names (``model.language_model.*``), including the
dead k/v projections and k-norms of the KV-shared layers that the release ships. Weights are
0.03·N(0, 1) (norms and layer scalars 1 + 0.2·N(0, 1)), rounded to bf16.

The tensor list comes from splitgemma's own inventory (the tensors the converter reads) plus the dead
shared-layer k/v, so this script cannot drift from what the converter expects. Everything is
streamed: memory stays small even for the 262144×8960 per-layer embedding table.

    python bench/make_hf_checkpoint.py /tmp/e2b-hf                 # E2B, one model.safetensors (~10.2 GB)
    python bench/make_hf_checkpoint.py /tmp/e4b-hf --preset e4b --shards 4
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from pathlib import Path

import numpy as np

from splitgemma.fgm.hf_config import TextConfig
from splitgemma.fgm.inventory import Plain, Rope, build_inventory
from splitgemma.fgm.random_model import PRESETS, preset_config

PREFIX = "model.language_model."
CHUNK_ELEMS = 1 << 23


def checkpoint_tensors(cfg: TextConfig) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, is_norm) for every stored tensor of the release, in a stable order."""
    out, seen = [], set()
    for it in build_inventory(cfg, "int4"):
        if isinstance(it, Rope) or it.source in seen:
            continue
        seen.add(it.source)
        out.append((PREFIX + it.source, tuple(it.shape), isinstance(it, Plain)))
    for i in range(cfg.first_shared_layer, cfg.num_hidden_layers):
        hd = cfg.layer_head_dim(i)
        kv = cfg.num_key_value_heads * hd
        pre = f"{PREFIX}layers.{i}.self_attn."
        out += [(pre + "k_proj.weight", (kv, cfg.hidden_size), False),
                (pre + "v_proj.weight", (kv, cfg.hidden_size), False),
                (pre + "k_norm.weight", (hd,), True)]
    return sorted(out)


def hf_config(preset: str) -> dict:
    text = dict(PRESETS[preset])
    text.update({"model_type": "gemma4_text", "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
                 "attention_k_eq_v": False, "enable_moe_block": False, "tie_word_embeddings": True,
                 "dtype": "bfloat16", "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0,
                 "max_position_embeddings": 131072,
                 # the release's config.json names the MoE fields of a dense model as null; llama.cpp's converter
                 # reads expert_intermediate_size as a required key
                 "num_experts": None, "top_k_experts": None, "expert_intermediate_size": None})
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
            "tie_word_embeddings": True, "text_config": text}


def write_shard(path: Path, tensors, rng: np.random.Generator, done: list[int], total: int, t0: float) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in tensors:
        n = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape, is_norm in tensors:
            numel = int(np.prod(shape))
            for a in range(0, numel, CHUNK_ELEMS):
                n = min(CHUNK_ELEMS, numel - a)
                x = rng.standard_normal(n, dtype=np.float32)
                if is_norm:
                    x = 1 + 0.2 * x
                else:
                    x *= 0.03
                # round to nearest bf16 (ties away are fine for random data)
                f.write(((x.view(np.uint32) + 0x8000) >> 16).astype("<u2").tobytes())
                done[0] += 2 * n
            print(f"\r{done[0] / 1e9:6.2f} / {total / 1e9:.2f} GB  {time.perf_counter() - t0:5.0f} s",
                  end="", file=sys.stderr, flush=True)
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="output directory (created)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="e2b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=1,
                    help="1 = a single model.safetensors (like the release); N > 1 = N shards + index.json")
    args = ap.parse_args(argv)

    cfg = preset_config(args.preset)
    tensors = checkpoint_tensors(cfg)
    total = sum(2 * int(np.prod(s)) for _, s, _ in tensors)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(hf_config(args.preset), indent=2))
    rng = np.random.default_rng(args.seed)
    t0, done = time.perf_counter(), [0]
    if args.shards <= 1:
        write_shard(args.out / "model.safetensors", tensors, rng, done, total, t0)
    else:
        # Split by bytes into roughly equal shards, keeping tensors whole.
        target, shards, cur, size = total / args.shards, [], [], 0
        for t in tensors:
            cur.append(t)
            size += 2 * int(np.prod(t[1]))
            if size >= target * (len(shards) + 1) and len(shards) < args.shards - 1:
                shards.append(cur)
                cur = []
        shards.append(cur)
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_shard(args.out / fname, shard, rng, done, total, t0)
            weight_map.update({name: fname for name, _, _ in shard})
        (args.out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    print(f"\nwrote {args.out}: {len(tensors)} tensors, {total:,} bytes of bf16, "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
