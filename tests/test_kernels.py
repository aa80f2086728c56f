"""The quantised GEMM kernels against a numpy reference built from the .fgm format spec.

The reference decodes the weight bytes itself (fgm-format.md §3.2 tile address, §3.3 nibble
halves, two's-complement int4, f16 scales [K/G, N]) -- never with the kernel's or the converter's
packing code -- and does the integer part of the GEMM exactly, then the float epilogue that
gemm.h specifies. So every backend must match it bit for bit, which also makes the backends
bit-identical to one another. The decoder itself is checked against an oracle we did not write:
the float weights of the HF checkpoint that fastgemma's converter turned into mini-e2b.fgm.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from splitgemma import _native
from tools.fgm_decode import HF_PREFIX, LM_HEAD, hf_name, rotate_k
from tools.reference_forward import read_safetensors

K = _native.kernels
FIXTURE = Path(__file__).parent / "fixtures" / "fastgemma" / "mini-e2b"
FGM_PATH = FIXTURE / "mini-e2b.fgm"
BACKENDS = ["avx2", "vnni", "amx"]
# Tests that take `backend` run once per backend this CPU can run (tests/conftest.py skips the
# others with the reason).


# ---------------------------------------------------------------- the format, from the spec


def tile_addr(n: int, k: int) -> np.ndarray:
    """§3.2: byte address of q[n, k] in the int8 tile stream, as an [n, k] array."""
    nn, kk = np.meshgrid(np.arange(n), np.arange(k), indexing="ij")
    tile = (nn // 16) * (k // 64) + kk // 64
    return tile * 1024 + ((kk % 64) // 4) * 64 + (nn % 16) * 4 + kk % 4


def decode_codes(raw: np.ndarray, dtype: str, n: int, k: int) -> np.ndarray:
    """Integer codes q[n, k] of a q8c or q4g blob."""
    a = tile_addr(n, k)
    if dtype == "q8c":
        return raw.view(np.int8)[a].astype(np.int64)
    byte = raw[(a // 64) * 32 + a % 32]
    nib = np.where(a % 64 < 32, byte & 0x0F, byte >> 4).astype(np.int64)
    return (nib ^ 8) - 8  # 4-bit two's complement


def encode_codes(q: np.ndarray, dtype: str) -> np.ndarray:
    """The inverse, for synthetic weights: codes [n, k] → blob bytes in tile order."""
    n, k = q.shape
    a = tile_addr(n, k).ravel()
    stream = np.zeros(n * k, np.uint8)
    stream[a] = (q.ravel() & 0xFF).astype(np.uint8)
    if dtype == "q8c":
        return stream
    blocks = stream.reshape(-1, 64) & 0x0F
    return (blocks[:, :32] | (blocks[:, 32:] << 4)).astype(np.uint8).ravel()


def rotate(x: np.ndarray) -> np.ndarray:
    """x · Hb (blockwise over the last axis), float64."""
    return rotate_k(x.astype(np.float64), 128)


# ---------------------------------------------------------------- the arithmetic contract


def quantize_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row symmetric int8 (gemm.h): scale = amax/127 in f32 (1 if 0), codes = rint(x/scale)."""
    x = x.astype(np.float32)
    amax = np.abs(x).max(axis=1)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    codes = np.clip(np.rint(x / scale[:, None]), -127, 127).astype(np.int8)
    return codes, scale


def fmaf(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Correctly rounded f32 fused multiply-add, elementwise (a·b is exact in f64)."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = p + c64
    bv = s - p
    err = (p - (s - bv)) + (c64 - bv)  # s + err == p + c exactly
    r = s.astype(np.float32)
    diff = s - r.astype(np.float64)
    toward = np.where(diff > 0, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32)
    nxt = np.nextafter(r, toward)
    mid = (r.astype(np.float64) + nxt.astype(np.float64)) / 2
    # Only an exact f32 midpoint in f64 can round the wrong way; the error term breaks the tie.
    fix = (diff != 0) & (s == mid) & (err != 0) & (np.sign(err) == np.sign(diff))
    return np.where(fix, nxt, r).astype(np.float32)


def int_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact a · bᵀ of small integers (float64 BLAS is exact below 2^53)."""
    return np.rint(a.astype(np.float64) @ b.astype(np.float64).T).astype(np.int64)


def gemm_ref(codes, a_scale, q, dtype, w_scale, group):
    if dtype == "q8c":
        acc = int_matmul(codes, q).astype(np.float32)
        return (acc * a_scale[:, None]) * w_scale[None, :]
    n, k = q.shape
    s = np.zeros((codes.shape[0], n), np.float32)
    for g in range(k // group):
        sl = slice(g * group, (g + 1) * group)
        acc = int_matmul(codes[:, sl], q[:, sl]).astype(np.float32)
        s = fmaf(acc, np.broadcast_to(w_scale[g].astype(np.float32), acc.shape), s)
    return s * a_scale[:, None]


def check_exact(y, ref):
    assert y.dtype == np.float32 and y.shape == ref.shape
    rel = np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert rel <= 1e-6, f"relative error {rel}"
    mism = np.argwhere(y != ref)
    assert mism.size == 0, f"{len(mism)} outputs differ bitwise, first at {mism[0]}: {y[tuple(mism[0])]} vs {ref[tuple(mism[0])]}"


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def fgm():
    assert FGM_PATH.exists(), f"missing fixture {FGM_PATH}"
    return _native.FgmFile(str(FGM_PATH))


@pytest.fixture(scope="module")
def checkpoint():
    """The bf16 HF weights the .fgm was converted from."""
    return read_safetensors(FIXTURE / "model.safetensors")


def hf_weight(checkpoint, tensor: str) -> np.ndarray:
    name = hf_name(tensor)
    if name == LM_HEAD:  # tied: the converter derived lm_head from the embedding
        name = HF_PREFIX + "embed_tokens.weight"
    return checkpoint[name].astype(np.float64)


def file_weight(fgm, tensor):
    info = fgm.tensor_info(tensor)
    n, k = info["shape"]
    q = decode_codes(np.asarray(fgm.raw(tensor)), info["dtype"], n, k)
    raw_scale = np.asarray(fgm.raw(tensor + ".scale"))
    if info["dtype"] == "q8c":
        scale = raw_scale.view(np.float32).copy()
    else:
        scale = raw_scale.view(np.float16).reshape(k // info["group"], n).copy()
    return info, q, scale


# Real linears of mini-e2b: q8c and q4g, several shapes (N 64..1024, K 128..1024).
REAL_TENSORS = [
    "l0.q_proj",  # q8c [256, 256]
    "l0.k_proj",  # q8c [64, 256]
    "l2.o_proj",  # q8c [256, 512] (full-attention layer)
    "l0.per_layer_projection",  # q8c [256, 128]
    "per_layer_model_projection",  # q8c [768, 256]
    "l0.gate_proj",  # q4g [512, 256] g256
    "l0.gate_proj.i8",  # its int8 twin
    "l5.down_proj",  # q4g [256, 1024] (double-wide layer)
    "lm_head",  # q4g [1024, 256]
]


# ---------------------------------------------------------------- the spec decoder vs the checkpoint


@pytest.mark.parametrize("tensor", REAL_TENSORS)
def test_spec_decoder_matches_checkpoint(fgm, checkpoint, tensor):
    """Our own decode of the file's bytes reproduces the original float weight (so the
    reference below is right about the layout, independently of the kernels)."""
    info, q, scale = file_weight(fgm, tensor)
    n, k = info["shape"]
    if info["dtype"] == "q8c":
        deq = q * scale.astype(np.float64)[:, None]
        bound = 0.012
    else:
        deq = q * np.repeat(scale.astype(np.float64).T, info["group"], axis=1)
        bound = 0.12
    if info["hadamard"]:
        deq = rotate(deq)  # H is an involution: W ≈ deq(W')·Hb
    w = hf_weight(checkpoint, tensor)
    assert w.shape == (n, k)
    rel = np.linalg.norm(deq - w) / np.linalg.norm(w)
    assert rel < bound, f"{tensor}: decoded weight is off the checkpoint by {rel:.4f}"
    assert rel > 1e-4  # it is a quantisation, not a copy


# ---------------------------------------------------------------- Hadamard and activation quantisation


def test_fwht128_is_x_times_h():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((5, 384)) * rng.uniform(0.01, 100, (5, 1))).astype(np.float32)
    y = K.fwht128(x)
    ref = rotate(x)
    assert np.abs(y - ref).max() <= 2e-6 * np.abs(ref).max()
    # an involution: applying it twice gives the input back
    assert np.abs(K.fwht128(y) - x).max() <= 4e-6 * np.abs(x).max()


def test_fwht128_rejects_partial_block():
    with pytest.raises(ValueError, match="multiple of 128"):
        K.fwht128(np.zeros(200, np.float32))


@pytest.mark.parametrize("hadamard", [0, 128])
@pytest.mark.parametrize("k", [512, 16512])  # rows longer than 16384 take the re-rotating path
def test_quantize_rows(hadamard, k):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((19, k)).astype(np.float32) * rng.uniform(1e-3, 1e3, (19, 1)).astype(np.float32)
    x[3] = 0.0  # all-zero row: scale 1, codes 0
    x[5, 7] = 1e4  # one outlier dominates its row
    codes, scale = K.quantize_rows(x, hadamard)
    assert codes.dtype == np.int8 and codes.shape == x.shape and scale.dtype == np.float32
    xr = K.fwht128(x) if hadamard else x
    ref_codes, ref_scale = quantize_ref(xr)
    np.testing.assert_array_equal(scale, ref_scale)
    np.testing.assert_array_equal(codes, ref_codes)
    assert scale[3] == 1.0 and not codes[3].any()
    assert np.abs(codes.astype(int)).max() == 127 and codes.min() >= -127
    if hadamard:
        # Against the float64 rotation x·H: at most a rounding tie away.
        c64, _ = quantize_ref(rotate(x.astype(np.float64)).astype(np.float32))
        d = np.abs(codes.astype(int) - c64.astype(int))
        assert d.max() <= 1 and (d > 0).mean() < 1e-3


@pytest.mark.parametrize("hadamard", [0, 128])
@pytest.mark.parametrize("k", [128, 1536, 16512])
def test_zmm_quantiser_and_row_sources_are_bit_identical(hadamard, k):
    """The VNNI/AMX engine quantises activations with the zmm twin of the quantiser (activations_avx512.cpp) and
    hands norm/GELU rows to it one at a time (quantize_activations_from): both must give the ymm quantiser's codes and
    scales bit for bit (test_linear_synthetic_bit_exact covers the zmm row sums through the GEMMs' bias terms). 37
    rows: two padded 16-row panels, a ragged last task."""
    rng = np.random.default_rng(k + hadamard)
    x = rng.standard_normal((37, k)).astype(np.float32) * rng.uniform(1e-3, 1e3, (37, 1)).astype(np.float32)
    x[4] = 0.0
    x[9, 5] = -3e4
    ref = K.quantize_rows(x, hadamard)
    variants = [dict(via_source=True)]
    if K.cpu_supports("vnni"):
        variants += [dict(backend="vnni"), dict(backend="vnni", via_source=True)]
    if k > 16384:  # a made row must fit the task's buffer (gemm.h kRowSourceMaxK); the engine writes x instead
        with pytest.raises(ValueError, match="above 16384"):
            K.quantize_rows(x, hadamard, via_source=True)
        variants = [v for v in variants if not v.get("via_source")]
    for v in variants:
        codes, scale = K.quantize_rows(x, hadamard, **v)
        np.testing.assert_array_equal(codes, ref[0], err_msg=str(v))
        np.testing.assert_array_equal(scale, ref[1], err_msg=str(v))


def near_half_integers(rng, shape, segment: int) -> np.ndarray:
    """Values whose quotients x / scale lie a few ulps either side of half-integers, the codes' rounding boundaries,
    per segment of `segment` values sharing one scale (a row: quantize_activations; 32 values: the q8g int8 input):
    there the quantisers' x · fl(1/scale) can round the other way from the division gemm.h defines
    (quotient_codes.h), so only its correction keeps the codes. A third of the values ordinary, so that boundary
    lanes share registers with others; one segment's amax is subnormal, where fl(1/scale) overflows."""
    seg = np.asarray(rng.uniform(1e-3, 1e3, shape[:-1] + (shape[-1] // segment, 1)), np.float32)
    seg.flat[0] = np.float32(3e-41)
    scale = seg / np.float32(127)
    halves = rng.integers(-127, 127, shape[:-1] + (shape[-1] // segment, segment)) + 0.5
    v = (halves * scale.astype(np.float64)).astype(np.float32)
    v = (v.view(np.int32) + rng.integers(-3, 4, v.shape).astype(np.int32)).view(np.float32)  # ulps apart
    ordinary = rng.random(v.shape) < 0.3
    v[ordinary] = (rng.uniform(-1, 1, v.shape) * seg)[ordinary]
    v[..., 0] = seg[..., 0]  # the segment's amax, so its scale is seg / 127
    return v.reshape(shape)


def test_near_half_integer_quotients_round_as_the_division():
    """The oracle: numpy's correctly rounded f32 division and round-half-even (quantize_ref), on values built to sit
    at the codes' rounding boundaries; the data must hold values where the product alone rounds differently, or the
    test could not fail."""
    rng = np.random.default_rng(20)
    x = near_half_integers(rng, (9, 1536), 1536)
    scale = quantize_ref(x)[1]
    with np.errstate(over="ignore"):  # the subnormal row's 1/scale
        product = np.rint(x * (np.float32(1) / scale)[:, None])
    assert (product != np.rint(x / scale[:, None])).sum() > 20
    for b in ["avx2"] + (["vnni"] if K.cpu_supports("vnni") else []):
        codes, got_scale = K.quantize_rows(x, 0, backend=b)
        np.testing.assert_array_equal(got_scale, scale, err_msg=b)
        np.testing.assert_array_equal(codes, quantize_ref(x)[0], err_msg=b)


def test_quantize_rows_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 64"):
        K.quantize_rows(np.zeros((2, 100), np.float32), 0)
    with pytest.raises(ValueError, match="hadamard"):
        K.quantize_rows(np.zeros((2, 192), np.float32), 128)


# ---------------------------------------------------------------- GEMM on the real file


@pytest.mark.parametrize("tensor", REAL_TENSORS)
def test_linear_real_file_bit_exact(fgm, backend, tensor):
    info, q, scale = file_weight(fgm, tensor)
    n, k = info["shape"]
    rng = np.random.default_rng(abs(hash(tensor)) % 2**32)
    for m in (1, 7, 33):
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = K.linear(x, fgm, tensor, backend=backend, threads=2)
        codes, a_scale = K.quantize_rows(x, info["hadamard"])
        check_exact(y, gemm_ref(codes, a_scale, q, info["dtype"], scale, info["group"]))


@pytest.mark.parametrize("tensor", ["l0.gate_proj", "l0.gate_proj.i8", "l2.o_proj", "lm_head"])
def test_linear_quantisation_error_as_expected(fgm, checkpoint, tensor):
    """Against float x·Wᵀ with the original weights: the error is what the weight and
    activation quantisation predict (int8 ~1%, int4 ~10%), not more."""
    info, q, scale = file_weight(fgm, tensor)
    n, k = info["shape"]
    w = hf_weight(checkpoint, tensor)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, k)).astype(np.float32)
    y = K.linear(x, fgm, tensor, threads=2).astype(np.float64)
    exact = x.astype(np.float64) @ w.T
    err = np.linalg.norm(y - exact) / np.linalg.norm(exact)
    # Prediction: relative weight error (rotated domain) and activation quantisation error.
    if info["dtype"] == "q8c":
        deq = q * scale.astype(np.float64)[:, None]
    else:
        deq = q * np.repeat(scale.astype(np.float64).T, info["group"], axis=1)
    w_err = np.linalg.norm(rotate(deq) - w) / np.linalg.norm(w)
    xr = rotate(x.astype(np.float64))
    codes, a_scale = K.quantize_rows(x, info["hadamard"])
    a_err = np.linalg.norm(codes * a_scale[:, None].astype(np.float64) - xr) / np.linalg.norm(xr)
    pred = np.hypot(w_err, a_err)
    assert 0.6 * pred < err < 1.4 * pred, f"{tensor}: error {err:.4f}, predicted {pred:.4f}"
    assert err < (0.02 if info["dtype"] == "q8c" else 0.13)


# ---------------------------------------------------------------- synthetic weights, odd shapes


def synthetic(rng, dtype, n, k, group):
    if dtype == "q8c":
        q = rng.integers(-127, 128, (n, k))
        q[1] = 0  # an all-zero weight row
        q[2] = 127
        q[3] = -127  # the extremes, where a saturating kernel would break
        scale = (rng.uniform(1e-3, 1e-1, n) * rng.choice([-1, 1], n)).astype(np.float32)
        return q, scale
    q = rng.integers(-8, 8, (n, k))
    q[1] = 0
    q[2] = -8
    q[3] = 7
    scale = (rng.uniform(1e-3, 1e-1, (k // group, n)) * rng.choice([-1, 1], (k // group, n))).astype(np.float16)
    return q, scale


SYNTH_SHAPES = [
    # (dtype, N, K, group, hadamard)
    ("q8c", 16, 64, 0, 0),
    ("q8c", 48, 192, 0, 0),  # K not a multiple of 128, N not a multiple of 64
    ("q8c", 80, 384, 0, 128),
    ("q8c", 272, 320, 0, 0),
    ("q4g", 16, 64, 64, 0),
    ("q4g", 48, 192, 64, 0),
    ("q4g", 80, 384, 128, 128),
    ("q4g", 144, 768, 256, 128),
    ("q4g", 32, 768, 64, 128),
]
SYNTH_M = [1, 2, 7, 15, 16, 17, 33, 64, 100]


@pytest.mark.parametrize("dtype,n,k,group,hadamard", SYNTH_SHAPES)
def test_linear_synthetic_bit_exact(backend, dtype, n, k, group, hadamard):
    rng = np.random.default_rng(n * 7919 + k * 31 + group)
    q, scale = synthetic(rng, dtype, n, k, group)
    blob = encode_codes(q, dtype)
    np.testing.assert_array_equal(decode_codes(blob, dtype, n, k), q)  # the test's own writer round-trips
    for m in SYNTH_M:
        x = rng.standard_normal((m, k)).astype(np.float32) * np.float32(rng.uniform(0.01, 50))
        x[m // 2] = 0.0  # an all-zero activation row
        y = K.linear_packed(x, blob, scale, dtype, n, k, group=group, hadamard=hadamard, backend=backend, threads=2)
        codes, a_scale = K.quantize_rows(x, hadamard)
        check_exact(y, gemm_ref(codes, a_scale, q, dtype, scale, group))
        assert not y[m // 2].any()


@pytest.mark.parametrize("dtype,group", [("q8c", 0), ("q4g", 64)])
def test_outputs_past_the_streaming_threshold_are_exact(backend, dtype, group):
    """An output of ≥ 4 MB is written with streaming stores (gemm_amx.cpp: kStreamOutputBytes): the same bits, the
    odd last row block and the column tail included."""
    rng = np.random.default_rng(4112)
    m, n, k = 257, 4112, 128  # 257 × 4112 × 4 bytes = 4.2 MB
    q, scale = synthetic(rng, dtype, n, k, group)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = K.linear_packed(x, encode_codes(q, dtype), scale, dtype, n, k, group=group, backend=backend, threads=2)
    codes, a_scale = K.quantize_rows(x, 0)
    check_exact(y, gemm_ref(codes, a_scale, q, dtype, scale, group))


def test_worst_case_accumulation(backend):
    """All codes at ±127 (int8) / −8 (int4) with a long K: the largest sums the kernels can meet."""
    k, n, m = 4096, 32, 3
    x = np.full((m, k), -1.0, np.float32)
    x[1] = 1.0
    x[2, ::2] = 1.0
    for dtype, qv, group in (("q8c", -127, 0), ("q8c", 127, 0), ("q4g", -8, 4096), ("q4g", 7, 64)):
        q = np.full((n, k), qv)
        scale = np.full(n, 0.5, np.float32) if dtype == "q8c" else np.full((k // group, n), -0.25, np.float16)
        y = K.linear_packed(x, encode_codes(q, dtype), scale, dtype, n, k, group=group, backend=backend)
        codes, a_scale = K.quantize_rows(x, 0)
        check_exact(y, gemm_ref(codes, a_scale, q, dtype, scale, group))


@pytest.mark.parametrize("dtype,n,k,group,hadamard", [SYNTH_SHAPES[3], SYNTH_SHAPES[7]])
def test_threads_do_not_change_results(dtype, n, k, group, hadamard):
    rng = np.random.default_rng(5)
    q, scale = synthetic(rng, dtype, n, k, group)
    blob = encode_codes(q, dtype)
    x = rng.standard_normal((37, k)).astype(np.float32)
    ys = [K.linear_packed(x, blob, scale, dtype, n, k, group=group, hadamard=hadamard, threads=t) for t in (1, 2, 3)]
    for y in ys[1:]:
        np.testing.assert_array_equal(y, ys[0])


# ---------------------------------------------------------------- q8g: weight-only int8, f32 activations


def q8g_panels(q):
    """[N, K] codes → the 16-column panel bytes of docs/fgm-extensions.md (byte (n/16)·K·16 + k·16 + n%16)."""
    n, k = q.shape
    return np.ascontiguousarray(q.astype(np.int8).reshape(n // 16, 16, k).transpose(0, 2, 1)).view(np.uint8).ravel()


def q8g_contract(x, q, scale, group):
    """The arithmetic the format prescribes, step by step: per group, p = fma(x, code, p) for k ascending, then
    acc = fma(p, s, acc). Each fused multiply-add is one rounding of the exact a·b + c: the product (48 bits) and the
    sum are exact in long double's 64-bit mantissa except for a tie-breaking case too rare to meet (< 2^-40 a step)."""
    def fma(a, b, c):
        return (a.astype(np.longdouble) * b.astype(np.longdouble) + c.astype(np.longdouble)).astype(np.float32)

    m, k = x.shape
    acc = np.zeros((m, q.shape[0]), np.float32)
    for g in range(k // group):
        p = np.zeros_like(acc)
        for j in range(g * group, (g + 1) * group):
            p = fma(x[:, j:j + 1], q[:, j].astype(np.float32)[None, :], p)
        acc = fma(p, scale[g][None, :], acc)
    return acc


# (208, 64, 32): 13 panels, tasks of 12 + 1 (decode) and of 4 + 4 + 4 + 1 (prefill, more than 32 rows)
Q8G_SHAPES = [(16, 64, 64), (48, 640, 32), (32, 48, 16), (64, 1024, 128), (16, 40, 8), (32, 96, 1), (208, 64, 32)]


def q8g_scales(rng, n, k, group, stored):
    """Random signed q8g scales [K/G, N] as stored (float32, or float16: the f16 block scales of a GGUF's Q8_0 or
    Q5_0, which the kernels widen exactly), and their float32 values for the contracts."""
    s = (rng.uniform(1e-3, 1e-1, (k // group, n)) * rng.choice([-1, 1], (k // group, n))).astype(stored)
    return s, s.astype(np.float32)


@pytest.mark.parametrize("n,k,group", Q8G_SHAPES)
@pytest.mark.parametrize("stored", [np.float32, np.float16], ids=["f32-scales", "f16-scales"])
def test_q8g_follows_the_contract_bit_for_bit(backend, n, k, group, stored):
    """Every row count (register blocks of 1-12 rows and their remainders; more than 32 rows: the prefill blocks)
    and every backend gives exactly the prescribed sequence of roundings, so a row's result does not depend on what
    it was batched with; with f16 scales, those of their float32 values."""
    rng = np.random.default_rng(n * 131 + k * 7 + group)
    q = rng.integers(-127, 128, (n, k))
    q[1], q[2], q[3] = 0, 127, -127
    stored_scale, scale = q8g_scales(rng, n, k, group, stored)
    blob = q8g_panels(q)
    for m in (1, 2, 5, 6, 7, 8, 12, 13, 25, 32, 40, 70):
        x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 50)).astype(np.float32)
        y = K.linear_packed(x, blob, stored_scale, "q8g", n, k, group=group, backend=backend, threads=2)
        np.testing.assert_array_equal(y, q8g_contract(x, q, scale, group))
        full = (x.astype(np.float64) @ (q * np.repeat(scale.astype(np.float64), group, axis=0).T).T)
        assert np.abs(y - full).max() <= 1e-5 * np.abs(x).max() * np.abs(scale).max() * 127 * k


def q8g_int8_contract(x, q, scale, group, offsets=None):
    """gemm.h's int8-activation contract, from its text: x quantised per row in blocks of 32 (a = amax / 127 in f32,
    code = round-half-even(x / a) clamped to ±127), the exact integer sum per unit of U inputs (16 when G = 16, else
    32), then y = fma(acc, fl(a · s), y) unit by unit; a q8ga weight adds its offsets' chain on the f32 x."""
    def fma(a, b, c):
        return (a.astype(np.longdouble) * b.astype(np.longdouble) + c.astype(np.longdouble)).astype(np.float32)

    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    amax = np.abs(blocks).max(-1)
    a = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    codes = np.clip(np.rint(blocks / a[..., None]), -127, 127).astype(np.int64).reshape(m, k)
    unit = 16 if group == 16 else 32
    y = np.zeros((m, q.shape[0]), np.float32)
    for u in range(k // unit):
        cols = slice(u * unit, (u + 1) * unit)
        acc = (codes[:, cols] @ q[:, cols].T).astype(np.float32)  # exact: |acc| < 2^24
        y = fma(acc, (a[:, u * unit // 32][:, None] * scale[u * unit // group][None, :]).astype(np.float32), y)
    if offsets is not None:
        off = np.zeros_like(y)
        for g in range(k // group):
            xs = np.array([group_sum(r[g * group:(g + 1) * group]) for r in x], np.float32)
            off = fma(xs[:, None], offsets[g][None, :], off)
        y = (y + off).astype(np.float32)
    return y


def group_sum(v):
    """gemm.h's order for a group's sum of x: eight lanes over the first 8·(G // 8) values, a fixed tree, the rest."""
    full = len(v) // 8 * 8
    t = [np.float32(0)] * 8
    for i in range(0, full, 8):
        t = [np.float32(t[j] + v[i + j]) for j in range(8)]
    s = np.float32(np.float32(np.float32(t[0] + t[1]) + np.float32(t[2] + t[3]))
                   + np.float32(np.float32(t[4] + t[5]) + np.float32(t[6] + t[7])))
    for e in v[full:]:
        s = np.float32(s + e)
    return s


# G = 16 (units of 16), 32, 64 and 128 (units of 32); 208 columns: tasks of 12 panels + 1
Q8G_INT8_SHAPES = [(16, 64, 32), (48, 640, 32), (32, 64, 16), (272, 640, 16), (64, 1024, 128), (32, 128, 64),
                   (208, 64, 32)]


@pytest.mark.parametrize("n,k,group", Q8G_INT8_SHAPES)
@pytest.mark.parametrize("with_offsets", [False, True], ids=["q8g", "q8ga"])
@pytest.mark.parametrize("stored", [np.float32, np.float16], ids=["f32-scales", "f16-scales"])
def test_q8g_int8_input_follows_the_contract_bit_for_bit(backend, n, k, group, with_offsets, stored):
    """With int8 activations every row count (the register blocks of 1-12 rows, the 6-row prefill blocks past 32
    rows, and the activations laid out in those blocks) and every backend gives exactly gemm.h's integers and
    roundings: the rows' results do not depend on what they were batched with, and AVX2 (vpmaddubsw on the sign
    trick; past 4 rows on panels the driver transposed once into its scratch) equals VNNI (vpdpbusd on flipped
    weight codes with a bias) and AMX (9-16 rows: one stream over the panels; more: a walk per panel and row block).
    Extreme codes (±127, -128 from Q8_0 blocks) and an all-zero input block (scale 1) included; f16 scales give
    the results of their float32 values."""
    rng = np.random.default_rng(n * 131 + k * 7 + group + with_offsets)
    q = rng.integers(-128, 128, (n, k))
    q[1], q[2], q[3] = 0, 127, -128
    stored_scale, scale = q8g_scales(rng, n, k, group, stored)
    offsets = rng.standard_normal((k // group, n)).astype(np.float32) if with_offsets else None
    blob = q8g_panels(q)
    for m in (1, 2, 5, 7, 8, 9, 12, 13, 16, 25, 32, 33, 40, 70):
        x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 50)).astype(np.float32)
        x[0, :32] = 0
        y = K.linear_packed(x, blob, stored_scale, "q8g", n, k, group=group, backend=backend, threads=2,
                            offsets=offsets, q8g_input="int8")
        np.testing.assert_array_equal(y, q8g_int8_contract(x, q, scale, group, offsets), err_msg=f"m={m}")


# (lo, hi, group, q8g_code_bound): narrow codes as the GGUF block formats hold them (Q5_0 -16..15, Q4_K 0..15 with
# offsets, Q6_K -32..31 in groups of 16), at the bounds and just past them (16 or -1: the ±16 kernel; 17: the ±32
# kernel; 33: full width).
Q8G_NARROW = [(-16, 16, 32, 16), (0, 15, 32, 15), (0, 15, 16, 15), (0, 16, 32, 16), (-1, 15, 32, 16),
              (-32, 32, 16, 32), (-16, 16, 64, 16), (-17, 17, 32, 32), (-33, 33, 16, 127), (-32, 32, 32, 32)]


@pytest.mark.parametrize("lo,hi,group,bound", Q8G_NARROW)
def test_q8g_int8_input_narrow_codes_are_exact_at_their_largest_sums(backend, lo, hi, group, bound):
    """A weight whose codes all lie within ±16 or ±32 runs the AVX2 int8 kernel without the sign trick (gemm_q8g.cpp,
    NARROW: code + 16 or + 32 against the activation code, 4 or 2 steps' pairs summed in int16, the bias dropped
    per unit; codes in 0..15 as they are, a unit's 8 steps summed in int16): exact up to the largest sums such codes
    allow (every code at the bound and every activation code ±127: 4 × 2 × 32 × 127 = 32512, 8 × 2 × 15 × 127 =
    30480, within int16), on random codes, and on every row count; codes past 32 keep the sign trick's int32 sums,
    as exactly."""
    rng = np.random.default_rng(hi * 37 + group - lo)
    n, k = 48, 256
    assert K.q8g_code_bound(np.arange(lo, hi + 1, dtype=np.int8)) == bound
    scale = (rng.uniform(1e-3, 1e-1, (k // group, n)) * rng.choice([-1, 1], (k // group, n))).astype(np.float32)
    worst = np.ones((2, k), np.float32)
    worst[1, 1::2] = -1.0  # activation codes all +127, or alternating: sums of either sign at full size
    for q, at_extremes in ((np.full((n, k), hi), True), (np.full((n, k), lo), True),
                           (rng.integers(lo, hi + 1, (n, k)), False)):
        q[0], q[1] = lo, hi  # both ends in every weight
        assert K.q8g_code_bound(q.astype(np.int8)) == bound
        for m in (1, 2, 4, 5, 8, 13, 32, 40):
            if at_extremes:
                x = np.tile(worst, ((m + 1) // 2, 1))[:m]
            else:
                x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 50)).astype(np.float32)
            y = K.linear_packed(x, q8g_panels(q), scale, "q8g", n, k, group=group, backend=backend, threads=2,
                                q8g_input="int8")
            np.testing.assert_array_equal(y, q8g_int8_contract(x, q, scale, group), err_msg=f"m={m}")


def test_q8g_code_bound_reads_past_its_chunks():
    """The scan stops early only on a code past 32: one wide code at the very end of a long weight is found."""
    q = np.zeros(3 * 4096 + 5, np.int8)
    assert K.q8g_code_bound(q) == 15
    q[-1] = -1
    assert K.q8g_code_bound(q) == 16
    q[-1] = -20
    assert K.q8g_code_bound(q) == 32
    q[-1] = -128
    assert K.q8g_code_bound(q) == 127
    q[-1], q[5000] = 0, 33
    assert K.q8g_code_bound(q) == 127


def test_q8g_int8_input_rounds_near_half_integer_quotients_as_the_division(backend):
    """The q8g activation codes at their rounding boundaries (near_half_integers, per 32 inputs) against the
    contract's numpy division: one-row decode (the VNNI kernel) and 32 rows (the AMX tiles on an AMX host)."""
    rng = np.random.default_rng(21)
    n, k, group = 64, 640, 32
    q = rng.integers(-128, 128, (n, k))
    scale = rng.uniform(1e-3, 1e-1, (k // group, n)).astype(np.float32)
    for m in (1, 32):
        x = near_half_integers(rng, (m, k), 32)
        blocks = x.reshape(m, k // 32, 32)
        a = np.abs(blocks).max(-1).astype(np.float32) / np.float32(127)
        with np.errstate(over="ignore"):
            assert (np.rint(blocks * (np.float32(1) / a)[..., None]) != np.rint(blocks / a[..., None])).sum() > 5
        y = K.linear_packed(x, q8g_panels(q), scale, "q8g", n, k, group=group, backend=backend, threads=2,
                            q8g_input="int8")
        np.testing.assert_array_equal(y, q8g_int8_contract(x, q, scale, group), err_msg=f"m={m}")


def test_q8g_int8_input_keeps_the_f32_contract_where_its_units_do_not_fit():
    """A group that is neither 16 nor a multiple of 32 (8, 48), or K % 32 != 0, runs the weight-only contract."""
    rng = np.random.default_rng(5)
    for n, k, group in ((32, 64, 8), (16, 96, 48), (16, 48, 16)):
        q = rng.integers(-127, 128, (n, k))
        scale = rng.uniform(-0.1, 0.1, (k // group, n)).astype(np.float32)
        x = rng.standard_normal((3, k)).astype(np.float32)
        y = K.linear_packed(x, q8g_panels(q), scale, "q8g", n, k, group=group, threads=2, q8g_input="int8")
        np.testing.assert_array_equal(y, q8g_contract(x, q, scale, group))


def test_q8g_threads_do_not_change_results():
    rng = np.random.default_rng(11)
    n, k, group = 272, 640, 32
    q = rng.integers(-127, 128, (n, k))
    scale = rng.uniform(-0.1, 0.1, (k // group, n)).astype(np.float32)
    x = rng.standard_normal((37, k)).astype(np.float32)
    for q8g_input in ("f32", "int8"):
        ys = [K.linear_packed(x, q8g_panels(q), scale, "q8g", n, k, group=group, threads=t, q8g_input=q8g_input)
              for t in (1, 2, 3)]
        for y in ys[1:]:
            np.testing.assert_array_equal(y, ys[0])


def test_q8g_bad_arguments():
    x = np.zeros((1, 64), np.float32)
    with pytest.raises(ValueError, match="q8g group must be a positive divisor of K"):
        K.linear_packed(x, np.zeros(1024, np.uint8), np.zeros((2, 16), np.float32), "q8g", 16, 64, group=48)
    with pytest.raises(ValueError, match="q8g: always 0"):
        K.linear_packed(x, np.zeros(1024, np.uint8), np.zeros((2, 16), np.float32), "q8g", 16, 64, group=32,
                        hadamard=128)
    with pytest.raises(ValueError, match=r"float32 or float16 \[K/group, N\]"):
        K.linear_packed(x, np.zeros(1024, np.uint8), np.zeros((2, 16), np.float64), "q8g", 16, 64, group=32)
    with pytest.raises(ValueError, match="q8g activations must be 'int8' or 'f32', got 'int4'"):
        K.linear_packed(x, np.zeros(1024, np.uint8), np.zeros((2, 16), np.float32), "q8g", 16, 64, group=32,
                        q8g_input="int4")


# ---------------------------------------------------------------- errors


def test_bad_arguments_raise_precise_errors(fgm):
    with pytest.raises(ValueError, match="columns, the weight K is 256"):
        K.linear(np.zeros((2, 128), np.float32), fgm, "l0.q_proj")
    with pytest.raises(ValueError, match="not a linear weight"):
        K.linear(np.zeros((2, 256), np.float32), fgm, "norm")
    with pytest.raises(_native.FgmError, match="no_such"):
        K.linear(np.zeros((2, 256), np.float32), fgm, "no_such")
    with pytest.raises(ValueError, match="unknown backend 'sse'"):
        K.linear(np.zeros((2, 256), np.float32), fgm, "l0.q_proj", backend="sse")
    with pytest.raises(ValueError, match="unknown backend"):
        K.cpu_supports("neon")
    with pytest.raises(ValueError, match="codes must be"):
        K.linear_packed(np.zeros((1, 64), np.float32), np.zeros(100, np.uint8), np.zeros(16, np.float32), "q8c", 16, 64)
    with pytest.raises(ValueError, match="group"):
        K.linear_packed(np.zeros((1, 192), np.float32), np.zeros(1536, np.uint8), np.zeros((1, 16), np.float16), "q4g", 16, 192, group=128)
    with pytest.raises(ValueError, match="scales must be"):
        K.linear_packed(np.zeros((1, 64), np.float32), np.zeros(512, np.uint8), np.zeros((1, 16), np.float32), "q4g", 16, 64, group=64)
    for b in BACKENDS:
        if not K.cpu_supports(b):
            with pytest.raises(RuntimeError, match=f"cannot run the {b} backend"):
                K.linear(np.zeros((1, 256), np.float32), fgm, "l0.q_proj", backend=b)


def _active_backend_with_env(value: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, FGM_BACKEND=value)
    code = "from splitgemma._native import kernels; print(kernels.active_backend())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_fgm_backend_env():
    r = _active_backend_with_env("avx2")
    assert r.returncode == 0 and r.stdout.strip() == "avx2"
    assert "GEMM backend avx2" in r.stderr  # announced once on stderr
    r = _active_backend_with_env("bogus")
    assert r.returncode != 0 and "FGM_BACKEND: unknown backend 'bogus'" in r.stderr
    for b in ("vnni", "amx"):
        r = _active_backend_with_env(b)
        if K.cpu_supports(b):
            assert r.stdout.strip() == b
        else:
            assert r.returncode != 0 and f"cannot run the {b} backend" in r.stderr


# ---------------------------------------------------------------- VNNI and AMX, emulated


def test_emulated_vnni_and_amx_match_avx2(tmp_path):
    """The VNNI and AMX backends' own code (blocking, biases and corrections, int4 unpacking,
    tile blocking, float epilogues, the tile-state guard with recompute and scalar fallback),
    with their AVX-512/AMX instructions replaced by scalar stand-ins, against the real AVX2
    backend: bit-identical on every shape. This runs where the real backends cannot (the tests
    above cover the real instructions on a CPU that has them). Built from the source tree."""
    gxx = shutil.which("g++")
    src = Path(__file__).resolve().parents[1] / "native" / "src"
    if gxx is None or not (src / "kernels" / "emulation" / "harness.cpp").exists():
        pytest.skip("needs g++ and the source tree")
    if not K.cpu_supports("avx2"):
        pytest.skip("the reference backend (AVX2) cannot run here")
    kern = src / "kernels"
    sources = [kern / "emulation" / "harness.cpp", kern / "gemm_vnni.cpp", kern / "gemm_amx.cpp",
               kern / "gemm_avx2.cpp", kern / "gemm_q8g.cpp", kern / "gemm_q8g_avx512.cpp", kern / "gemm_q8g_amx.cpp", kern / "activations.cpp", kern / "backend.cpp",
               src / "fgm_file.cpp", src / "json.cpp", src / "threadpool.cpp"]
    flags = ["-std=c++17", "-O1", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-Wno-psabi",
             "-DSG_KERNEL_EMULATION", f"-I{kern / 'emulation'}", f"-I{kern}", f"-I{src}"]
    procs = [subprocess.Popen([gxx, *flags, "-c", str(s), "-o", str(tmp_path / f"{s.stem}.o")],
                              stderr=subprocess.PIPE, text=True) for s in sources]
    for p, s in zip(procs, sources):
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"compiling {s.name}:\n{err}"
    exe = tmp_path / "harness"
    subprocess.run([gxx, *[str(tmp_path / f"{s.stem}.o") for s in sources], "-o", str(exe), "-lpthread"],
                   check=True, timeout=120)
    for guard, loss_every in ((0, None), (1, None), (1, 37), (1, 3)):
        env = dict(os.environ)
        if loss_every:
            env["SG_EMULATED_TILE_LOSS_EVERY"] = str(loss_every)
        r = subprocess.run([str(exe), str(guard)], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "failures 0" in r.stdout, r.stdout + r.stderr
        recoveries = int(r.stdout.split("recoveries")[1])
        # Simulated tile-state loss must be detected and repaired (3: always, so the scalar
        # fallback runs); without loss nothing is recomputed.
        assert (recoveries > 0) == bool(loss_every), r.stdout


def test_read_bandwidth_gives_one_reading_per_pass():
    """The bandwidth probe (splitgemma bench's DRAM limit): one positive GB/s reading per pass over the buffer, on
    every thread count; a pass count below 1, a buffer below a page per thread, more bytes than a caller's buffer
    holds or a strided one is refused by name."""
    for threads in (1, 2):
        readings = K.read_bandwidth(8 << 20, threads, 3)
        assert len(readings) == 3 and all(r > 0 for r in readings)
    with pytest.raises(ValueError, match="passes"):
        K.read_bandwidth(8 << 20, 1, 0)
    with pytest.raises(ValueError, match="too small"):
        K.read_bandwidth(4096, 2, 1)
    # a caller's buffer read as it is (bench: the mapped model file), never past its end, only whole
    buf = np.zeros(3 << 20, np.uint8)
    assert len(K.read_bandwidth(buf.size, 2, 2, of=buf)) == 2
    with pytest.raises(ValueError, match="asked of a buffer"):
        K.read_bandwidth(buf.size + 1, 1, 1, of=buf)
    with pytest.raises(ValueError, match="contiguous"):
        K.read_bandwidth(4096, 1, 1, of=buf.reshape(3, -1)[:, ::2])


def test_amx_tile_loop_probe_runs_where_amx_is_and_refuses_elsewhere():
    """bench/bench_amx_tiles.py's probe of the AMX kernel's tile loop: one positive TOPS reading for each placement of
    its operands on an AMX host, a RuntimeError naming AMX on any other; an unknown placement is refused by name."""
    with pytest.raises(ValueError, match="in_l1"):
        K.amx_tile_loop_tops("l3")
    if not K.cpu_supports("amx"):
        with pytest.raises(RuntimeError, match="amx"):
            K.amx_tile_loop_tops("both")
        return
    for in_l1 in ("none", "activations", "weights", "both"):
        assert K.amx_tile_loop_tops(in_l1, 2, 0.02) > 0
