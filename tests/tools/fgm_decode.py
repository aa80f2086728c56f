"""An independent numpy decoder of FASTGEM1 (.fgm) weight files, for tests and fixture generation.

Written from the byte-level format descriptions (shared/reference/fgm-format.md, and docs/fgm-extensions.md for the
q8g type) only, deliberately without looking at the project's converter (splitgemma/fgm/): the converter packs, this
module unpacks, and each checks the other.
It also decodes fastgemma's own files, which is how it is validated against a converter we did not write.

The container is read through the native reader (`splitgemma._native.FgmFile`: magic, header, offsets, bounds), so
only the tensor encodings are decoded here. Dequantised values are exact in float64 (int code x f16/f32 scale);
un-rotating adds float64 rounding only.
"""

from __future__ import annotations

import hashlib
import json
import math
import re

import numpy as np

from splitgemma._native import FgmFile

# Dtype -> bytes per element of the blob, as a fraction (numerator, denominator).
_BLOB_BYTES = {"f32": (4, 1), "f16": (2, 1), "q8c": (1, 1), "q8g": (1, 1), "q8ga": (1, 1), "q8r": (1, 1), "q4g": (1, 2),
               "q4r": (1, 2)}
_QUANTISED = ("q8c", "q4g", "q8g", "q8ga", "q8r", "q4r")
TILE_N = 16  # rows of one AMX tile
TILE_K = 64  # int8 codes along K of one tile (16 tile rows x 4 consecutive k)
PANEL_N = 16  # q8g: output rows of one panel (16 consecutive bytes hold them at one k)
Q4R_GROUP = 64  # the q4r scale group is fixed by the format, whatever the converter's --group was

# .fgm per-layer suffix -> Hugging Face Gemma 4 name suffix (after "layers.{i}.").
_LAYER_HF = {
    "input_layernorm": "input_layernorm.weight",
    "post_attention_layernorm": "post_attention_layernorm.weight",
    "pre_feedforward_layernorm": "pre_feedforward_layernorm.weight",
    "post_feedforward_layernorm": "post_feedforward_layernorm.weight",
    "post_per_layer_input_norm": "post_per_layer_input_norm.weight",
    "layer_scalar": "layer_scalar",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
    "per_layer_input_gate": "per_layer_input_gate.weight",
    "per_layer_projection": "per_layer_projection.weight",
}
_GLOBAL_HF = {
    "embed_tokens": "embed_tokens.weight",
    "embed_tokens_per_layer": "embed_tokens_per_layer.weight",
    "per_layer_model_projection": "per_layer_model_projection.weight",
    "per_layer_projection_norm": "per_layer_projection_norm.weight",
    "norm": "norm.weight",
}
FFN_SUFFIXES = ("gate_proj", "up_proj", "down_proj")
HF_PREFIX = "model.language_model."
LM_HEAD = "lm_head.weight"
_LAYER_RE = re.compile(r"^l(0|[1-9][0-9]*)\.([a-z_]+)$")


def hadamard_matrix(n: int) -> np.ndarray:
    """Sylvester-ordered Hadamard matrix H_n / sqrt(n) (symmetric, orthogonal, its own inverse)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


def rotate_k(w: np.ndarray, block: int) -> np.ndarray:
    """W -> W . Hb along the last axis (K), block-diagonal H of size `block`; it is also its own inverse."""
    k = w.shape[-1]
    if k % block:
        raise ValueError(f"K={k} is not a multiple of the Hadamard block {block}")
    blocks = w.reshape(*w.shape[:-1], k // block, block)
    return (blocks @ hadamard_matrix(block)).reshape(w.shape)


def _nibbles_to_stream(packed: np.ndarray) -> np.ndarray:
    """Unpack 32-byte blocks into 64-code blocks: byte j -> code j (low nibble) and code j+32 (high nibble).

    Nibbles are 4-bit two's complement (8..15 mean -8..-1), not offset-8.
    """
    blocks = packed.reshape(-1, 32)
    low = (blocks & 0x0F).astype(np.int8)
    high = (blocks >> 4).astype(np.int8)
    codes = np.concatenate([low, high], axis=1)
    return ((codes ^ 8) - 8).astype(np.int8).reshape(-1)


def _tile_order_to_rows(stream: np.ndarray, n: int, k: int) -> np.ndarray:
    """Inverse of the AMX B-operand order: addr = ((n/16)*(K/64) + k/64)*1024 + ((k%64)/4)*64 + (n%16)*4 + k%4."""
    tiles = stream.reshape(n // TILE_N, k // TILE_K, TILE_K // 4, TILE_N, 4)
    # axes: n-block, k-tile, tile row (k%64 div 4), n%16, k%4  ->  n-block, n%16, k-tile, tile row, k%4
    return np.ascontiguousarray(tiles.transpose(0, 3, 1, 2, 4)).reshape(n, k)


def _panels_to_rows(stream: np.ndarray, n: int, k: int) -> np.ndarray:
    """Inverse of the q8g panel order: addr = (n/16)*K*16 + k*16 + n%16."""
    panels = stream.reshape(n // PANEL_N, k, PANEL_N)
    # axes: panel, k, n%16  ->  panel, n%16, k
    return np.ascontiguousarray(panels.transpose(0, 2, 1)).reshape(n, k)


def hf_name(name: str, prefix: str = HF_PREFIX) -> str | None:
    """The Hugging Face name of the weight an .fgm tensor encodes (an `.i8` twin maps to its primary's name);
    None for `.scale` companions and RoPE tables. Unknown names raise ValueError."""
    if name.endswith(".scale") or (name.startswith("rope.") and name.endswith(".inv_freq")):
        return None
    base = name[: -len(".i8")] if name.endswith(".i8") else name
    if base == "lm_head":
        return LM_HEAD
    if base in _GLOBAL_HF:
        return prefix + _GLOBAL_HF[base]
    m = _LAYER_RE.match(base)
    if not m or m.group(2) not in _LAYER_HF:
        raise ValueError(f"unknown .fgm tensor name {name!r}")
    return f"{prefix}layers.{m.group(1)}.{_LAYER_HF[m.group(2)]}"


class FgmReader:
    """Decodes the tensors of one .fgm file. Bad or inconsistent entries raise ValueError with the tensor name."""

    def __init__(self, path):
        self.path = str(path)
        self.file = FgmFile(self.path)
        self.header = json.loads(self.file.header_json)
        self.config = self.header["config"]
        self.names = list(self.file.tensor_names)

    def info(self, name: str) -> dict:
        if name not in self.file:
            raise ValueError(f"{self.path}: no tensor {name!r}")
        info = self.file.tensor_info(name)
        dtype, shape = info["dtype"], tuple(info["shape"])
        if dtype not in _BLOB_BYTES:
            raise ValueError(f"{name}: unknown dtype {dtype!r}")
        num, den = _BLOB_BYTES[dtype]
        expect = math.prod(shape) * num // den
        if info["nbytes"] != expect:
            raise ValueError(f"{name}: nbytes {info['nbytes']} != {expect} for {dtype} {list(shape)}")
        return info

    def _plain(self, name: str, dtype: str) -> np.ndarray:
        info = self.info(name)
        if info["dtype"] != dtype:
            raise ValueError(f"{name}: expected dtype {dtype}, found {info['dtype']}")
        np_dtype = np.float32 if dtype == "f32" else np.float16
        return self.file.raw(name).view(np_dtype).reshape(info["shape"])

    def _q8g_scale_dtype(self, name: str) -> str:
        dtype = self.info(name + ".scale")["dtype"]
        if dtype not in ("f32", "f16"):
            raise ValueError(f"{name}.scale: dtype {dtype}, expected f32 or f16")
        return dtype

    def codes_and_scales(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """Integer codes [N, K] in row-major order (int8, int4 widened) and the `.scale` array as stored."""
        info = self.info(name)
        dtype = info["dtype"]
        if dtype not in _QUANTISED:
            raise ValueError(f"{name}: dtype {dtype} is not quantised")
        if len(info["shape"]) != 2:
            raise ValueError(f"{name}: quantised tensor must be 2-D, shape is {list(info['shape'])}")
        n, k = info["shape"]
        raw = self.file.raw(name)
        if dtype in ("q8c", "q4g"):
            if n % TILE_N or k % TILE_K:
                raise ValueError(f"{name}: {dtype} needs N % {TILE_N} == 0 and K % {TILE_K} == 0, shape [{n}, {k}]")
            stream = raw.view(np.int8) if dtype == "q8c" else _nibbles_to_stream(raw)
            codes = _tile_order_to_rows(stream, n, k)
        elif dtype in ("q8g", "q8ga"):
            if n % PANEL_N:
                raise ValueError(f"{name}: {dtype} needs N % {PANEL_N} == 0, shape [{n}, {k}]")
            codes = _panels_to_rows(raw.view(np.int8), n, k)
        else:
            if k % 64:
                raise ValueError(f"{name}: {dtype} needs K % 64 == 0, shape [{n}, {k}]")
            codes = raw.view(np.int8).reshape(n, k) if dtype == "q8r" else _nibbles_to_stream(raw).reshape(n, k)

        if dtype == "q4g":
            group = info["group"] or 64  # files from converter 4fd8522 carry no group: it was always 64
            if group % 64 or k % group:
                raise ValueError(f"{name}: int4 group {group} must be a multiple of 64 dividing K={k}")
            scale_dtype, scale_shape = "f16", (k // group, n)
        elif dtype in ("q8g", "q8ga"):
            group = info["group"]
            if group <= 0 or k % group:
                raise ValueError(f"{name}: {dtype} group {group} must be a positive divisor of K={k}")
            # f32, or f16 where the source's block scales were f16 (docs/fgm-extensions.md)
            scale_dtype, scale_shape = self._q8g_scale_dtype(name), (k // group, n)
        elif dtype == "q4r":
            scale_dtype, scale_shape = "f16", (n, k // Q4R_GROUP)
        else:
            scale_dtype, scale_shape = "f32", (n,)
        scales = self._plain(name + ".scale", scale_dtype)
        if tuple(scales.shape) != scale_shape:
            raise ValueError(f"{name}.scale: shape {list(scales.shape)}, expected {list(scale_shape)} for {dtype}")
        return codes, scales

    def dequantize(self, name: str) -> np.ndarray:
        """The stored matrix in float64: W' (still rotated if meta.hadamard > 0) or a plain f32/f16 tensor."""
        info = self.info(name)
        dtype = info["dtype"]
        if dtype in ("f32", "f16"):
            return self._plain(name, dtype).astype(np.float64)
        codes, scales = self.codes_and_scales(name)
        if dtype == "q8ga":  # docs/fgm-extensions.md: W = fl(fl(code * s) + o), two float32 steps
            n, k = codes.shape
            offsets = self._plain(name + ".offset", "f32")
            if offsets.shape != scales.shape:
                raise ValueError(f"{name}.offset: shape {list(offsets.shape)}, expected {list(scales.shape)}")
            group = k // scales.shape[0]
            cs = codes.reshape(n, k // group, group).astype(np.float32) * scales.T.astype(np.float32)[:, :, None]
            return (cs + offsets.T[:, :, None]).reshape(n, k).astype(np.float64)
        q = codes.astype(np.float64)
        s = scales.astype(np.float64)
        n, k = q.shape
        if dtype in ("q4g", "q8g"):  # scales stored transposed, [K/G, N]
            group = k // s.shape[0]
            return (q.reshape(n, k // group, group) * s.T[:, :, None]).reshape(n, k)
        if dtype == "q4r":
            return (q.reshape(n, k // Q4R_GROUP, Q4R_GROUP) * s[:, :, None]).reshape(n, k)
        return q * s[:, None]

    def panel_rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows [r0, r1) (multiples of 16) of a q8g/q8ga tensor in float32 as the format defines them: fl(code * s),
        then + o in a second float32 step (docs/fgm-extensions.md). Its 16-row panels are contiguous and its scales
        (offsets) [K/G, N], so a slice of the 262,144-row embedding is decoded without the rest."""
        info = self.info(name)
        n, k = info["shape"]
        g = info["group"]
        if info["dtype"] not in ("q8g", "q8ga") or r0 % PANEL_N or (r1 % PANEL_N and r1 != n) or not 0 <= r0 < r1 <= n:
            raise ValueError(f"{name}: rows [{r0}, {r1}) of a {info['dtype']} tensor of {n} rows")
        codes = _panels_to_rows(self.file.raw(name).view(np.int8)[r0 * k:r1 * k], r1 - r0, k).astype(np.float32)

        def groups(suffix):
            dtype = self._q8g_scale_dtype(name) if suffix == ".scale" else "f32"
            return self._plain(name + suffix, dtype).astype(np.float32).reshape(k // g, n)[:, r0:r1].T[:, :, None]

        v = codes.reshape(r1 - r0, k // g, g) * groups(".scale")
        if info["dtype"] == "q8ga":
            v = v + groups(".offset")
        return v.reshape(r1 - r0, k)

    def weight(self, name: str) -> np.ndarray:
        """The tensor in float64 in the checkpoint's own basis: dequantised and, if rotated, un-rotated."""
        w = self.dequantize(name)
        block = self.info(name)["hadamard"]
        return rotate_k(w, block) if block else w

    def rope_inv_freq(self) -> dict[str, np.ndarray]:
        """layer type -> the stored RoPE inverse-frequency table (f32)."""
        out = {}
        for name in self.names:
            if name.startswith("rope.") and name.endswith(".inv_freq"):
                out[name[len("rope."):-len(".inv_freq")]] = self._plain(name, "f32").astype(np.float64)
        return out

    def hf_weights(self, ffn: str = "int4", prefix: str = HF_PREFIX) -> dict[str, np.ndarray]:
        """Every decoder tensor under its Hugging Face name, float32, un-rotated.

        `embed_tokens.weight` comes from the gather table (q4r/q8r) and the LM head from the separate `lm_head`
        tensor, kept apart under `lm_head.weight` (they are two quantisations of the tied matrix).
        ffn="int4" takes the q4g FFN weights, ffn="int8" their `.i8` int8 twins (or the primary if it is already q8c
        or q8g).
        """
        if ffn not in ("int4", "int8"):
            raise ValueError(f"ffn must be 'int4' or 'int8', got {ffn!r}")
        out = {}
        for name in self.names:
            hf = hf_name(name, prefix)
            if hf is None or name.endswith(".i8"):
                continue
            suffix = name.rsplit(".", 1)[-1]
            source = self._ffn_source(name, ffn) if suffix in FFN_SUFFIXES else name
            out[hf] = self.weight(source)
        return {k: v.astype(np.float32) for k, v in out.items()}

    def _ffn_source(self, name: str, ffn: str) -> str:
        dtype = self.info(name)["dtype"]
        if ffn == "int4":
            if dtype != "q4g":
                raise ValueError(f"{name}: int4 FFN requested but the tensor is {dtype}")
            return name
        if name + ".i8" in self.file:
            twin = name + ".i8"
            if self.info(twin)["dtype"] != "q8c":
                raise ValueError(f"{twin}: an int8 twin must be q8c, found {self.info(twin)['dtype']}")
            return twin
        if dtype in ("q8c", "q8g", "q8ga"):
            return name
        raise ValueError(f"{name}: int8 FFN requested but the file has no .i8 twin (converted without dual weights?)")

    def tensor_sha256(self) -> str:
        """Fingerprint of everything that determines the decoded values: per tensor (sorted by name) its name,
        dtype, shape, hadamard, group and blob bytes. Offsets and the header `meta` (conversion time) are left out,
        so re-running the same converter gives the same digest and a converter change gives a different one."""
        h = hashlib.sha256()
        for name in sorted(self.names):
            info = self.info(name)
            desc = [name, info["dtype"], list(info["shape"]), info["hadamard"], info["group"]]
            h.update(json.dumps(desc).encode() + b"\n")
            h.update(self.file.raw(name).tobytes())
        return h.hexdigest()


def decode_hf_weights(path, ffn: str = "int4", prefix: str = HF_PREFIX) -> dict[str, np.ndarray]:
    """Shorthand for FgmReader(path).hf_weights(ffn, prefix)."""
    return FgmReader(path).hf_weights(ffn=ffn, prefix=prefix)
