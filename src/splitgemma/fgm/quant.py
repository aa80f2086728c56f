"""Quantisers and byte layouts of the .fgm weight types (fgm-format §3).

* q8c: int8 per output row, f32 scale, AMX tile order (§3.2). Used for linears.
* q4g: int4 with one f16 scale per (row, group of G along K), AMX tile order, 64-block half-split
  nibbles (§3.3). Scales are stored transposed, [K/G, N].
* q8r / q4r: row-major gather tables (§3.4, §3.5); q4r always uses group 64 and stores [R, K/64].
* q8g (docs/fgm-extensions.md): int8 with one f32 (or f16) scale per (row, group of G along K), 16-column panels,
  never rotated; scales stored transposed, [K/G, N]. Grid-aligned input (a GGUF's blocks) is kept exactly.

The arithmetic follows fastgemma's converter closely enough to reproduce its files byte for byte:
everything is computed in the dtype of the input (float32 for unrotated tables, float64 for
Hadamard-rotated linears), scales are rounded to float32 before the codes are computed with them, and
the int4 search multiplies the base scale by Python floats so that float32 inputs stay float32.
"""
from __future__ import annotations

import numpy as np

Q4_TABLE_GROUP = 64   # q4r tables: one scale per 64 columns, whatever --group says
TILE_N = 16           # rows of one AMX B tile (output features)
TILE_K = 64           # int8 columns of one AMX B tile (input features)

# §3.6: candidate shrink factors of the base scale; the extreme element maps to code -8 at 1.0.
_Q4_MULTIPLIERS = tuple(float(m) for m in np.linspace(0.82, 1.0, 10))

# The int4 search makes ~60 passes over its input: keep each working block near the L2 size.
_Q4_BLOCK_BYTES = 512 * 1024


# ----------------------------------------------------------------------------------------------
# int8, one scale per row (q8c linears, q8r tables)

def quantize_q8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per row: s = max|row|/127 (1/127 for an all-zero row), q = rint(w/s) in ±127.

    The scale is computed in the input dtype and rounded to float32; the codes are computed with
    that float32 scale (in the input dtype). Returns (codes int8 [R, K], scale float32 [R]).
    """
    amax = np.abs(w).max(axis=1)
    scale = (amax / 127).astype(np.float32)
    scale[amax == 0] = np.float32(1 / 127)
    q = np.divide(w, scale[:, None])
    np.rint(q, out=q)
    np.clip(q, -127, 127, out=q)
    return q.astype(np.int8), scale


# ----------------------------------------------------------------------------------------------
# int8 with one scale per (row, group of G along K) (q8g linears)

# A candidate grid step is accepted when every value of the group lies within this many code units of a code.
_GRID_TOLERANCE = 1e-3
# Steps tried: the smallest nonzero |w| of the group divided by j = 1…32. A GGUF block's smallest magnitude is
# some code m ≤ 32 times its step (Q6_K codes reach -32), so j = m / gcd(codes) finds it.
_GRID_DIVISORS = range(1, 33)
# Groups per working block of quantize_q8_groups (a few MB of float64, so the passes stay in cache).
_Q8G_BLOCK_ELEMS = 1 << 18


def _q8g_block(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """quantize_q8_groups on x ([groups, G], float64) → (codes int8 [groups, G], scale float32 [groups])."""
    mag = np.abs(x)
    amax = mag.max(axis=1)
    scale = amax / 127
    smallest = np.where(mag > 0, mag, np.inf).min(axis=1)
    # Only groups that are still unresolved are examined at each j; a group leaves for good once amax/step
    # exceeds 127 (it only grows with j) or once its grid is found (the smallest j: the coarsest step).
    todo = np.flatnonzero(amax > 0)
    for j in _GRID_DIVISORS:
        if not todo.size:
            break
        step = smallest[todo] / j
        todo = todo[amax[todo] <= (127 + _GRID_TOLERANCE) * step]
        step = smallest[todo] / j
        q = x[todo] / step[:, None]
        on_grid = (np.abs(q - np.rint(q)) <= _GRID_TOLERANCE).all(axis=1)
        scale[todo[on_grid]] = step[on_grid]
        todo = todo[~on_grid]
    scale = scale.astype(np.float32)
    scale[amax == 0] = np.float32(1 / 127)
    q = x / scale[:, None].astype(np.float64)
    np.rint(q, out=q)
    np.clip(q, -127, 127, out=q)
    return q.astype(np.int8), scale


def quantize_q8_groups(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per (row, group of ``group`` columns) → (codes int8 [R, K], scale float32 [R, K/group]).

    Weights that already lie on a symmetric grid of at most 255 levels per group (a GGUF's Q8_0, Q5_0, Q4_0
    blocks, Q6_K sub-blocks at group 16, an int8 checkpoint) are kept EXACTLY: the group's step is the coarsest
    among (smallest nonzero |w|)/j, j = 1…32, of which every value is an integer multiple (within 10⁻³ of a
    code) of magnitude ≤ 127. Any other group gets s = max|w|/127 (1/127 when all zero) and round-half-even
    codes. Steps are found in float64 and stored as float32; the codes are computed with the float32 scale.
    """
    r, k = w.shape
    if isinstance(group, bool) or not isinstance(group, int) or group <= 0 or k % group:
        raise ValueError(f"group {group!r} does not divide K = {k}")
    g = np.ascontiguousarray(w).reshape(-1, group)
    codes = np.empty(g.shape, dtype=np.int8)
    scale = np.empty(g.shape[0], dtype=np.float32)
    step = max(1, _Q8G_BLOCK_ELEMS // group)
    for a in range(0, g.shape[0], step):
        codes[a:a + step], scale[a:a + step] = _q8g_block(g[a:a + step].astype(np.float64))
    return codes.reshape(r, k), scale.reshape(r, k // group)


# ----------------------------------------------------------------------------------------------
# int4 with the scale search of fgm-format §3.6 (q4g linears, q4r tables)

def _q4_search(g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantise each row of g ([groups, G]) to int4; returns (codes int8, scale float32 [groups])."""
    n = g.shape[0]
    e = g[np.arange(n), np.abs(g).argmax(axis=1)]      # signed extreme of each group
    base = e / -8                                       # maps the extreme to code -8 exactly
    base[base == 0] = 1.0                               # all-zero group: codes 0, scale = first multiplier
    best_err = np.full(n, np.inf, dtype=g.dtype)
    best_s = np.empty_like(base)
    t = np.empty_like(g)
    for m in _Q4_MULTIPLIERS:
        s = base * m
        np.divide(g, s.astype(np.float32)[:, None], out=t)
        np.rint(t, out=t)
        np.clip(t, -8, 7, out=t)
        t *= s[:, None]
        t -= g
        err = np.einsum("ij,ij->i", t, t)
        better = err < best_err                         # strict: the first minimum wins
        best_err[better] = err[better]
        best_s[better] = s[better]
    s32 = best_s.astype(np.float32)
    np.divide(g, s32[:, None], out=t)
    np.rint(t, out=t)
    np.clip(t, -8, 7, out=t)
    return t.astype(np.int8), s32


def quantize_q4(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """int4 per (row, group of `group` columns). Returns (codes int8 [R, K], scale float32 [R, K/group]).

    w is float32 or float64 and its dtype is kept for the arithmetic (see the module docstring).
    """
    rows, k = w.shape
    if k % group:
        raise ValueError(f"int4 group {group} does not divide K = {k}")
    g = np.ascontiguousarray(w).reshape(-1, group)
    step = max(1, _Q4_BLOCK_BYTES // (group * g.itemsize))
    codes = np.empty(g.shape, dtype=np.int8)
    scale = np.empty(g.shape[0], dtype=np.float32)
    for a in range(0, g.shape[0], step):
        codes[a:a + step], scale[a:a + step] = _q4_search(g[a:a + step])
    return codes.reshape(rows, k), scale.reshape(rows, k // group)


# ----------------------------------------------------------------------------------------------
# Byte layouts

def tile_order(codes: np.ndarray) -> np.ndarray:
    """[N, K] int8 codes → the 1-D AMX B-tile stream of §3.2 (n-block major, then k-block, then
    16 tile rows of 16 n × 4 consecutive k)."""
    n, k = codes.shape
    if n % TILE_N or k % TILE_K:
        raise ValueError(f"tile order needs N % {TILE_N} == 0 and K % {TILE_K} == 0, got [{n}, {k}]")
    t = codes.reshape(n // TILE_N, TILE_N, k // TILE_K, TILE_K // 4, 4)
    return np.ascontiguousarray(t.transpose(0, 2, 3, 1, 4)).reshape(-1)


def untile(stream: np.ndarray, n: int, k: int) -> np.ndarray:
    """Inverse of tile_order: the 1-D tile stream → [N, K]."""
    t = stream.reshape(n // TILE_N, k // TILE_K, TILE_K // 4, TILE_N, 4)
    return np.ascontiguousarray(t.transpose(0, 3, 1, 2, 4)).reshape(n, k)


def panel_order(codes: np.ndarray) -> np.ndarray:
    """[N, K] int8 codes → the 1-D q8g panel stream: code (n, k) at (n / 16)·K·16 + k·16 + n % 16 (the 16
    outputs of one panel at one input are 16 consecutive bytes)."""
    n, k = codes.shape
    if n % TILE_N:
        raise ValueError(f"panel order needs N % {TILE_N} == 0, got [{n}, {k}]")
    return np.ascontiguousarray(codes.reshape(n // TILE_N, TILE_N, k).transpose(0, 2, 1)).reshape(-1)


def unpanel(stream: np.ndarray, n: int, k: int) -> np.ndarray:
    """Inverse of panel_order: the 1-D panel stream → [N, K]."""
    return np.ascontiguousarray(stream.reshape(n // TILE_N, k, TILE_N).transpose(0, 2, 1)).reshape(n, k)


def pack_nibbles(stream: np.ndarray) -> np.ndarray:
    """int4 codes (int8 in [-8, 7], length % 64 == 0) → bytes: in each 64-code block, byte j holds
    code j in its low nibble and code j + 32 in its high nibble, two's complement (§3.3)."""
    b = stream.view(np.uint8).reshape(-1, 64)
    return ((b[:, :32] & 0x0F) | (b[:, 32:] << 4)).reshape(-1)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """Inverse of pack_nibbles: bytes → int8 codes in [-8, 7]."""
    b = np.asarray(packed, dtype=np.uint8).reshape(-1, 32)
    lo = (b & 0x0F).astype(np.int8)
    hi = (b >> 4).astype(np.int8)
    return ((np.concatenate([lo, hi], axis=1) ^ 8) - 8).reshape(-1)


# ----------------------------------------------------------------------------------------------
# Gather tables, dequantisation, decoding of stored blobs

def encode_q4r(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[R, K] table rows → (row-major packed int4 bytes, f16 scale [R, K/64])."""
    q, s = quantize_q4(w, Q4_TABLE_GROUP)
    return pack_nibbles(q.reshape(-1)), s.astype(np.float16)


def dequantize(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """codes [R, K] × per-(row, group) scales [R, K/G] (or per-row [R]) → float64 [R, K]."""
    r, k = codes.shape
    s = np.asarray(scale, dtype=np.float64).reshape(r, -1)
    return (codes.reshape(r, s.shape[1], -1) * s[:, :, None]).reshape(r, k)


def decode(dtype: str, blob: np.ndarray, scale: np.ndarray, rows: int, k: int) -> np.ndarray:
    """A stored q8c/q4g/q8g/q8r/q4r blob and its stored ``.scale`` → float64 [rows, K] (still rotated
    if the tensor's meta.hadamard says so)."""
    blob = np.asarray(blob)
    scale = np.asarray(scale)
    if dtype == "q8c":
        return dequantize(untile(blob.view(np.int8), rows, k), scale)
    if dtype == "q4g":
        return dequantize(untile(unpack_nibbles(blob), rows, k), scale.reshape(-1, rows).T)
    if dtype == "q8g":
        return dequantize(unpanel(blob.view(np.int8), rows, k), scale.reshape(-1, rows).T)
    if dtype == "q8r":
        return dequantize(blob.view(np.int8).reshape(rows, k), scale)
    if dtype == "q4r":
        return dequantize(unpack_nibbles(blob).reshape(rows, k), scale.reshape(rows, -1))
    raise ValueError(f"not a quantised dtype: {dtype}")
