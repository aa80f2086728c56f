"""Block-128 Sylvester Hadamard rotation of linear weights along K (fgm-format §4).

The stored weight is W' = W·Hb, where Hb is block-diagonal with K/128 copies of the normalised
Sylvester matrix H (symmetric, orthogonal, its own inverse). The engine applies the same H to each
128-block of the GEMM input, so x'·W'ᵀ = x·Wᵀ.

The product is computed in float64: fastgemma's converter does so, and its scale and code choices
depend on the float64 rotated values (float32 rounding first would flip a few near-ties).
"""
from __future__ import annotations

import functools

import numpy as np

BLOCK = 128


@functools.lru_cache(maxsize=None)
def hadamard_matrix(n: int = BLOCK) -> np.ndarray:
    """The n×n Sylvester Hadamard matrix in natural order, divided by √n (float64, read-only)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    h = h / np.sqrt(n)
    h.setflags(write=False)
    return h


def rotatable(k: int) -> bool:
    """Whether a linear with K input features gets the rotation (K a multiple of 128)."""
    return k % BLOCK == 0


def rotate_k(w: np.ndarray) -> np.ndarray:
    """W·Hb for a [rows, K] weight block (K % 128 == 0); returns a new float64 array."""
    rows, k = w.shape
    if not rotatable(k):
        raise ValueError(f"cannot Hadamard-rotate K = {k}: not a multiple of {BLOCK}")
    blocks = np.asarray(w, dtype=np.float64).reshape(-1, BLOCK)
    return (blocks @ hadamard_matrix(BLOCK)).reshape(rows, k)
