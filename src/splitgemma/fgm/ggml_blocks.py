"""GGML's quantised blocks read as q8g / q8ga groups, value for value (docs/fgm-extensions.md).

Every value the ``gguf`` package dequantises from the block types below is an int code times an f32 group scale plus
an f32 group offset, computed in float32 numpy as ``fl(fl(code · scale) + offset)`` (no fused multiply-add), and the
product ``code · scale`` is exact in float32 (an f16 times a small integer, times another small integer: at most 23
significant bits). So a q8g group (no offset) or a q8ga group (with one) holding those codes, scales and offsets
gives back the package's float32 numbers bit for bit:

======  =====  ===============  ===================  ======================  ===================================
type    group  code             scale                offset                  gguf's float32 arithmetic
======  =====  ===============  ===================  ======================  ===================================
Q8_0    32     q (int8)         f32(d)               —                       x · d
Q5_0    32     q − 16           f32(d)               —                       d · (q − 16)
Q4_0    32     q − 8            f32(d)               —                       d · (q − 8)
Q4_1    32     q (0…15)         f32(d)               f32(m)                  d · q + m
Q5_1    32     q (0…31)         f32(d)               f32(m)                  d · q + m
Q6_K    16     q − 32           fl(d · sc) (exact)   —                       fl(d · sc) · (q − 32)
Q4_K    32     q (0…15)         fl(d · sc) (exact)   −fl(dmin · m) (exact)   fl(d · sc) · q − fl(dmin · m)
Q5_K    32     q (0…31)         fl(d · sc) (exact)   −fl(dmin · m) (exact)   fl(d · sc) · q − fl(dmin · m)
======  =====  ===============  ===================  ======================  ===================================

(d, dmin, m of Q4_1/Q5_1: f16 fields; sc, m of the K types: 6-bit sub-block fields, Q6_K's sc: int8.) x − y is
x + (−y) in IEEE arithmetic, signed zeros included, so storing the negated minimum changes no bit. The unpacking here
follows the GGML block layouts; the converter checks every tensor it writes this way against the package's own
``dequantize`` (GgufCheckpoint.q8g_rows), so a layout misread here cannot reach a file.
"""
from __future__ import annotations

import numpy as np

QK_K = 256


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    """The f16 field at byte `at` of each block, as float32 ([blocks])."""
    return np.ascontiguousarray(raw[:, at:at + 2]).view(np.float16).reshape(-1).astype(np.float32)


def _nibbles16(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes → [blocks, 32] values: element j is byte j's low nibble, j + 16 its high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """[blocks, 4] bytes (a little-endian u32) → [blocks, 32]: bit i of the u32 for element i."""
    return np.unpackbits(qh, axis=1, bitorder="little")


def _k_scales(sc12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of a Q4_K/Q5_K block → its 8 six-bit scales and 8 six-bit minimums ([blocks, 8] each).
    Sub-blocks 0–3: the low 6 bits of bytes 0–3 (scales) and 4–7 (mins); 4–7: a low nibble of bytes 8–11 (scale) or
    their high nibble (min), with bits 4–5 from the top two bits of bytes 0–3 (scale) or 4–7 (min)."""
    a, b, c = sc12[:, 0:4], sc12[:, 4:8], sc12[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, mn


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 128] bytes of a Q4_K/Q5_K block → [blocks, 8, 32]: sub-block 2c is the low nibbles of bytes
    32c…32c+31, sub-block 2c+1 their high nibbles."""
    q = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([q & 0x0F, q >> 4], axis=2).reshape(-1, 8, 32)


def _split(type_name: str, raw: np.ndarray):
    """One block per row of raw ([blocks, type_size] uint8) → (codes int8 [blocks, B], scale f32 [blocks, B/G],
    offset f32 [blocks, B/G] or None)."""
    if type_name == "Q8_0":
        return raw[:, 2:34].view(np.int8), _f16(raw, 0)[:, None], None
    if type_name == "Q4_0":
        return (_nibbles16(raw[:, 2:18]).astype(np.int8) - 8), _f16(raw, 0)[:, None], None
    if type_name == "Q5_0":
        q = _nibbles16(raw[:, 6:22]) | (_bits32(raw[:, 2:6]) << 4)
        return q.astype(np.int8) - 16, _f16(raw, 0)[:, None], None
    if type_name == "Q4_1":
        return _nibbles16(raw[:, 4:20]).astype(np.int8), _f16(raw, 0)[:, None], _f16(raw, 2)[:, None]
    if type_name == "Q5_1":
        q = _nibbles16(raw[:, 8:24]) | (_bits32(raw[:, 4:8]) << 4)
        return q.astype(np.int8), _f16(raw, 0)[:, None], _f16(raw, 2)[:, None]
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(raw, 0)[:, None], _f16(raw, 2)[:, None]
        sc, mn = _k_scales(raw[:, 4:16])
        if type_name == "Q4_K":
            q = _k_low_nibbles(raw[:, 16:144])
        else:  # bit 4 of element l of sub-block j: bit j of qh[l]
            qh = raw[:, 16:48]
            high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
            q = _k_low_nibbles(raw[:, 48:176]) | (high << 4)
        scale = d * sc.astype(np.float32)
        offset = np.negative(dmin * mn.astype(np.float32))
        return q.reshape(-1, QK_K).astype(np.int8), scale, offset
    if type_name == "Q6_K":
        # ql[128], qh[64], sc[16] (int8), d. Element 128h + r: its low 4 bits are nibble r // 64 of ql[64h + r % 64],
        # its top 2 bits are bits 2(r // 32)… of qh[32h + r % 32].
        ql = raw[:, 0:128].reshape(-1, 2, 1, 64)
        lo = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 2, 128)
        qh = raw[:, 128:192].reshape(-1, 2, 1, 32)
        hi = ((qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3).reshape(-1, 2, 128)
        q = (lo | (hi << 4)).reshape(-1, QK_K).astype(np.int8) - 32
        scale = _f16(raw, 208)[:, None] * raw[:, 192:208].view(np.int8).astype(np.float32)
        return q, scale, None
    raise KeyError(type_name)


# type → (values per block, values per scale)
EXACT_TYPES = {"Q8_0": (32, 32), "Q4_0": (32, 32), "Q5_0": (32, 32), "Q4_1": (32, 32), "Q5_1": (32, 32),
               "Q4_K": (QK_K, 32), "Q5_K": (QK_K, 32), "Q6_K": (QK_K, 16)}
WITH_OFFSETS = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")
# The types whose group scale is the block's own f16 d: a q8g tensor made of them stores its scales as f16, half the
# bytes of f32 and the same values (the K types' d · sc needs more bits than f16's 11).
F16_SCALES = ("Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1")


def q8g_groups(type_name: str, raw: np.ndarray, k: int, group: int):
    """Rows of a GGML tensor (raw: [rows, bytes per row] uint8, K values a row) → (codes int8 [rows, K],
    scale f32 [rows, K/group], offset f32 [rows, K/group] or None). ``group`` divides the type's sub-block (the
    sub-block's scale and offset are repeated over its groups)."""
    block, sub = EXACT_TYPES[type_name]
    if sub % group or k % block:
        raise ValueError(f"{type_name}: group {group} must divide its {sub}-value sub-block, K = {k} its block")
    rows = raw.shape[0]
    codes, scale, offset = _split(type_name, np.ascontiguousarray(raw).reshape(rows * (k // block), -1))
    rep = sub // group
    scale = np.repeat(scale.reshape(rows, -1), rep, axis=1)
    if offset is not None:
        offset = np.repeat(offset.reshape(rows, -1), rep, axis=1)
    return codes.reshape(rows, k), scale, offset


def values(codes: np.ndarray, scale: np.ndarray, offset: np.ndarray | None) -> np.ndarray:
    """The float32 values of q8g/q8ga groups ([rows, K]): fl(code · s), plus o in a second float32 step."""
    r, k = codes.shape
    s = scale.astype(np.float32).reshape(r, -1, 1)
    v = codes.reshape(r, s.shape[1], -1).astype(np.float32) * s
    if offset is not None:
        v = v + offset.astype(np.float32).reshape(r, -1, 1)
    return v.reshape(r, k)
