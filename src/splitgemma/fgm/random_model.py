"""Full-size .fgm files with random weights, written directly in the published layout.

For benchmarks and engine tests that need the real shapes but not real weights: the inventory,
offsets and header are exactly what the converter writes for the same config (both use
inventory.build_inventory and the same writer), only the values are random. Random codes and scales
are drawn directly (no float weights, no quantisation), so the 4.34 GB E2B file takes about as long
as writing 4.34 GB.

Values: the dequantised weights of every linear and table have standard deviation ~0.03 (codes
uniform over their range, scales ±0.03/std(codes) × U(0.8, 1.2), random signs as real int4 scales
have); norm weights and layer_scalar are 1 + 0.02·N(0, 1); the RoPE tables are the real ones.
The FFN int4 scales are constant along each row, so an ``.i8`` twin (codes × 15, scale / 15) holds
exactly the same weights as its int4 original and both GEMM paths compute the same model. q8g weights
(--weights int8g) get uniform int8 codes and a positive scale per (row, group).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from .hf_config import FULL, SLIDING, TextConfig, parse_text_config
from .inventory import Linear, Plain, Rope, Table, build_inventory, check_options, default_group, entries_of, \
    header_hadamard, header_kv_cache_dtype, layout_problems, quant_bits
from .errors import ConversionError
from .progress import byte_progress
from .quant import Q4_TABLE_GROUP, unpack_nibbles
from .writer import FgmWriter

WEIGHT_STD = 0.03
_Q4_CODE_STD = float(np.sqrt((16 ** 2 - 1) / 12))     # uniform over -8..7
_Q8_CODE_STD = float(np.sqrt((255 ** 2 - 1) / 12))    # uniform over -127..127
_TWIN_FACTOR = 15                                     # int4 code × 15 stays inside ±127
_CHUNK_BYTES = 1 << 25

# Hugging Face-style text configs (fed through the same parser as a real config.json).
PRESETS: dict[str, dict] = {
    # google/gemma-4-E2B: gemma4-e2b-spec §1
    "e2b": {
        "hidden_size": 1536, "num_hidden_layers": 35, "intermediate_size": 6144, "use_double_wide_mlp": True,
        "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512,
        "layer_types": ([SLIDING] * 4 + [FULL]) * 7, "num_kv_shared_layers": 20,
        "hidden_size_per_layer_input": 256, "vocab_size": 262144, "vocab_size_per_layer_input": 262144,
        "sliding_window": 512, "rms_norm_eps": 1e-6, "final_logit_softcapping": 30.0,
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
    },
    # google/gemma-4-E4B as quoted by several public configs and code bases: five sliding layers
    # per full one (full layers 5, 11, …, 41), 2 KV heads, 18 KV-shared layers, no double-wide MLP.
    "e4b": {
        "hidden_size": 2560, "num_hidden_layers": 42, "intermediate_size": 10240, "use_double_wide_mlp": False,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "global_head_dim": 512,
        "layer_types": ([SLIDING] * 5 + [FULL]) * 7, "num_kv_shared_layers": 18,
        "hidden_size_per_layer_input": 256, "vocab_size": 262144, "vocab_size_per_layer_input": 262144,
        "sliding_window": 512, "rms_norm_eps": 1e-6, "final_logit_softcapping": 30.0,
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
    },
}


def preset_config(name: str) -> TextConfig:
    if name not in PRESETS:
        raise ConversionError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return parse_text_config(PRESETS[name], f"preset {name}")


class _Filler:
    def __init__(self, cfg: TextConfig, writer: FgmWriter, seed: int):
        self.cfg, self.w, self.seed = cfg, writer, seed

    def rng(self, index: int) -> np.random.Generator:
        # One stream per item: the data of an item does not depend on chunking or on other items.
        return np.random.default_rng([self.seed, index])

    def run(self, items) -> None:
        for index, it in enumerate(items):
            rng = self.rng(index)
            if isinstance(it, Plain):
                self.w.write(it.name, (1 + 0.02 * rng.standard_normal(it.shape)).astype(np.float32))
            elif isinstance(it, Rope):
                self.w.write(it.name, self.cfg.rope_inv_freq(it.layer_type))
            elif isinstance(it, Table):
                self.table(it, rng)
            else:
                self.linear(it, rng)

    @staticmethod
    def _bytes(rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n]

    @staticmethod
    def _signed_scales(rng, shape, code_std) -> np.ndarray:
        mag = WEIGHT_STD / code_std * rng.uniform(0.8, 1.2, shape)
        return np.where(rng.random(shape) < 0.5, -mag, mag)

    def _q8_codes(self, rng, n: int) -> np.ndarray:
        codes = self._bytes(rng, n).view(np.int8)
        np.maximum(codes, -127, out=codes)   # -128 never occurs in the format
        return codes

    def table(self, it: Table, rng) -> None:
        if it.dtype == "q8g":
            self._q8g(it.name, it.rows, it.k, it.group, rng)
            return
        # Every packed byte is two independent uniform int4 codes, in any order.
        rows_per_chunk = max(1, _CHUNK_BYTES // (it.k // 2))
        for r0 in range(0, it.rows, rows_per_chunk):
            r1 = min(it.rows, r0 + rows_per_chunk)
            self.w.write(it.name, self._bytes(rng, (r1 - r0) * it.k // 2))
            s = self._signed_scales(rng, (r1 - r0, it.k // Q4_TABLE_GROUP), _Q4_CODE_STD)
            self.w.write(it.name + ".scale", s.astype(np.float16))

    def _q8g(self, name: str, n: int, k: int, group: int, rng) -> None:
        # Uniform codes in any order are a valid panel stream; scales [K/G, N].
        self._stream(name, n * k, lambda count: self._q8_codes(rng, count))
        self.w.write(name + ".scale",
                     np.abs(self._signed_scales(rng, (k // group, n), _Q8_CODE_STD)).astype(np.float32))

    def linear(self, it: Linear, rng) -> None:
        if it.dtype == "q8g":
            self._q8g(it.name, it.n, it.k, it.group, rng)
            return
        if it.dtype == "q8c":
            self._stream(it.name, it.n * it.k, lambda n: self._q8_codes(rng, n))
            self.w.write(it.name + ".scale",
                         np.abs(self._signed_scales(rng, (it.n,), _Q8_CODE_STD)).astype(np.float32))
            return
        row = self._signed_scales(rng, (it.n,), _Q4_CODE_STD).astype(np.float16)
        self.w.write(it.name + ".scale", np.broadcast_to(row, (it.k // it.group, it.n)).copy())
        if not it.twin:
            self._stream(it.name, it.n * it.k // 2, lambda n: self._bytes(rng, n))
            return
        # The twin's tile stream is the int4 tile stream unpacked, element for element.
        step = _CHUNK_BYTES // 64 * 64
        total = it.n * it.k // 2
        for a in range(0, total, step):
            packed = self._bytes(rng, min(step, total - a))
            self.w.write(it.name, packed)
            twin = unpack_nibbles(packed)
            twin *= _TWIN_FACTOR
            self.w.write(it.name + ".i8", twin)
        self.w.write(it.name + ".i8.scale", row.astype(np.float32) / _TWIN_FACTOR)

    def _stream(self, name: str, total: int, make) -> None:
        for a in range(0, total, _CHUNK_BYTES):
            self.w.write(name, make(min(_CHUNK_BYTES, total - a)))


def write_random_model(cfg: TextConfig, out: str | os.PathLike, seed: int = 0, weights: str = "dual",
                       group: int | None = None, progress: bool = True, label: str = "custom") -> dict:
    """Write a .fgm for ``cfg`` with random weights; same layout as converting a real checkpoint.
    group: default 256 (int4), 32 for int8g."""
    t0 = time.perf_counter()
    group = default_group(weights) if group is None else group
    check_options(weights, group)
    items = build_inventory(cfg, weights, group)
    problems = layout_problems(items)
    if problems:
        raise ConversionError(f"this model cannot be stored with --weights {weights} --group {group}", problems)
    header_config = cfg.fgm_config(hadamard=header_hadamard(weights), group=group, quant=quant_bits(weights),
                                   kv_cache_dtype=header_kv_cache_dtype(weights))
    entries = entries_of(items)
    out = Path(out)
    with FgmWriter(out) as writer:
        writer.plan(entries, header_config)
        bar = byte_progress(writer.payload_bytes, f"random-model {out.name}", progress)
        writer.on_write = bar.update
        try:
            _Filler(cfg, writer, seed).run(items)
            seconds = time.perf_counter() - t0
            writer.finish(header_config, {"convert_s": round(seconds, 1),
                                          "random_weights": {"preset": label, "seed": seed}})
        finally:
            bar.close()
    return {"path": str(out), "bytes": writer.size, "tensors": len(entries), "seconds": time.perf_counter() - t0}
