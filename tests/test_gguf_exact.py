"""Exact GGUF weights (issue 14 part 6): every tensor a GGUF conversion writes decodes to the gguf package's own
float32 dequantisation, bit for bit, through the reader, the GEMM kernels of every backend and the embedding gather.

The oracle is the gguf package (llama.cpp's reader, `gguf.quants.dequantize`), never our own block reader
(splitgemma.fgm.ggml_blocks). Two sources:
* a tiny Gemma 3 GGUF written here with the gguf package, one tensor of each block type that q8g/q8ga hold exactly
  (Q8_0, Q5_0, Q4_0, Q4_1, Q5_1, Q6_K, Q4_K, Q5_K; random blocks with every code pattern) — what CI runs;
* the default model (Gemma 3 270M Q4_K_M: Q8_0, Q5_0, Q6_K, Q4_K), every tensor; skipped when it is not cached.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from splitgemma import _native as N
from splitgemma.fgm import convert_checkpoint
from test_kernels import group_sum
from test_q8g_convert import GGUF_NAMES, write_tiny_gguf
from tools.fgm_decode import FgmReader

gguf = pytest.importorskip("gguf")
K = N.kernels
BACKENDS = [b for b in ("avx2", "vnni", "amx") if K.cpu_supports(b)]

# The tiny model's tensors: layers 0-2 and 3-5 take different types, so that each exactly-held block type appears
# (the K-quants only where K = 256: o_proj and down_proj); the embedding is Q4_1, so the gather meets an offset.
_TYPES = [{"attn_q": "Q5_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q6_K", "ffn_gate": "Q4_1",
           "ffn_up": "Q5_1", "ffn_down": "Q4_K"},
          {"attn_q": "Q8_0", "attn_k": "Q5_1", "attn_v": "Q4_0", "attn_output": "Q4_K", "ffn_gate": "Q5_0",
           "ffn_up": "Q4_1", "ffn_down": "Q5_K"}]
_WITH_MINIMUM = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")


def tiny_type(layer, name):
    return "Q4_1" if layer is None else _TYPES[layer // 3][name]


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("exact")
    values = write_tiny_gguf(d / "t.gguf", tiny_type)
    out = d / "t.fgm"
    convert_checkpoint(d / "t.gguf", out, progress=False)
    return out, values


def _tiny_pairs():
    yield "embed_tokens", "token_embd.weight", tiny_type(None, "token_embd")
    for i in range(6):
        for p, g in GGUF_NAMES.items():
            yield f"l{i}.{p}", f"blk.{i}.{g}.weight", tiny_type(i, g)


def test_every_block_type_is_held_bit_for_bit(tiny):
    out, values = tiny
    rd = FgmReader(out)
    seen = set()
    for name, gname, qtype in _tiny_pairs():
        info = rd.info(name)
        assert info["dtype"] == ("q8ga" if qtype in _WITH_MINIMUM else "q8g"), (name, qtype)
        assert info["group"] == (16 if qtype == "Q6_K" else 32), (name, qtype)
        want = values[gname]
        got = rd.panel_rows(name, 0, want.shape[0])
        np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"{name} ({qtype})")
        # the test decoder's float64 view of the same values
        np.testing.assert_array_equal(rd.dequantize(name).astype(np.float32), want, err_msg=name)
        seen.add(qtype)
    assert seen == {"Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q5_1", "Q6_K", "Q4_K", "Q5_K"}
    # the random K-quant blocks reach the codes' extremes (Q6_K -32 and 31, Q5_K 0 and 31)
    assert {int(v) for v in (rd.codes_and_scales("l0.o_proj")[0].min(), rd.codes_and_scales("l0.o_proj")[0].max(),
                             rd.codes_and_scales("l5.down_proj")[0].min(), rd.codes_and_scales("l5.down_proj")[0].max())} \
        == {-32, 31, 0}
    assert rd.info("embed_tokens")["dtype"] == "q8ga" and "lm_head" not in rd.names


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_gemm_multiplies_by_the_gguf_values(tiny, backend):
    """x = the identity: each output row k of x · Wᵀ is column k of W as the kernel uses it, fl(fl(code·s) + o)
    (gemm.h): the gguf package's values (±0 compare equal: the kernel's sums start at +0)."""
    out, values = tiny
    f = N.FgmFile(str(out))
    for name, gname, qtype in _tiny_pairs():
        if name == "embed_tokens":
            continue
        want = values[gname]
        eye = np.eye(want.shape[1], dtype=np.float32)
        got = K.linear(eye, f, name, backend=backend, threads=2)
        np.testing.assert_array_equal(got, want.T, err_msg=f"{name} ({qtype}) on {backend}")


def test_backends_give_the_same_bits_with_offsets(tiny):
    out, _ = tiny
    f = N.FgmFile(str(out))
    # 45 rows: the prefill kernels (more than 32 rows), against each other and against one row (decode's kernels)
    x = np.random.default_rng(5).standard_normal((45, 256)).astype(np.float32)
    for name in ("l3.o_proj", "l5.down_proj", "l0.down_proj", "l1.up_proj"):
        k = f.tensor_info(name)["shape"][1]
        ys = [K.linear(x[:, :k], f, name, backend=b, threads=t) for b in BACKENDS for t in (1, 2)]
        for y in ys[1:]:
            np.testing.assert_array_equal(y, ys[0], err_msg=name)
        # a row alone gives the bits it gives in a batch (decode vs prefill)
        np.testing.assert_array_equal(K.linear(x[4:5, :k], f, name, threads=1), ys[0][4:5], err_msg=name)


def test_the_embedding_gather_gives_the_gguf_values(tiny):
    out, values = tiny
    m = N.Model(str(out), max_context=64, threads=1)
    want = values["token_embd.weight"]
    got = m.embedding_rows(list(range(want.shape[0])))
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("group", [32, 12])  # 12: the group sum's tail after its eight lanes
def test_q8ga_kernel_follows_its_contract(group):
    """linear_packed with offsets against the contract of gemm.h, step by step in float32 numpy."""
    rng = np.random.default_rng(9)
    n, k = 48, 96
    codes = rng.integers(-128, 128, (n, k)).astype(np.int8)
    scale = rng.uniform(0.5, 2, (k // group, n)).astype(np.float32)
    offset = rng.standard_normal((k // group, n)).astype(np.float32)
    x = rng.standard_normal((5, k)).astype(np.float32)
    blob = np.ascontiguousarray(codes.reshape(n // 16, 16, k).transpose(0, 2, 1)).reshape(-1).view(np.uint8)
    want = np.empty((5, n), np.float32)
    for mm in range(5):
        for j in range(n):
            acc = off = np.float32(0)
            for g in range(k // group):
                p = np.float32(0)
                for kk in range(g * group, (g + 1) * group):
                    p = _fma(x[mm, kk], codes[j, kk], p)
                xs = group_sum(x[mm, g * group:(g + 1) * group])
                acc = _fma(p, scale[g, j], acc)
                off = _fma(xs, offset[g, j], off)
            want[mm, j] = np.float32(acc + off)
    for b in BACKENDS:
        y = K.linear_packed(x, blob, scale, "q8g", n, k, group=group, backend=b, threads=2, offsets=offset)
        np.testing.assert_array_equal(y, want, err_msg=b)


def _fma(a, b, c) -> np.float32:
    """fmaf(a, b, c) for float32 operands: the float64 product of two float32 is exact, and the sum is rounded once
    to float32 through an exact rational (float64 addition could round twice)."""
    from fractions import Fraction

    return np.float32(float(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))))


# ------------------------------------------------------------------------------------------------------------------
# the default model, every tensor

@pytest.fixture(scope="module")
def default_model():
    from splitgemma import default_model as dm

    hit = dm._cached(dm.model_dir())
    if hit is None:
        pytest.skip("the default model is not converted in the cache (splitgemma up, or tests/test_gemma3.py, makes it)")
    return hit[0], dm.model_dir() / dm.GGUF_NAME


def test_default_model_every_tensor_equals_the_gguf_dequantisation(default_model):
    fgm, gguf_path = default_model
    rd = FgmReader(fgm)
    f = N.FgmFile(str(fgm))
    g = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    by_gguf = {"embed_tokens": "token_embd.weight"}
    for i in range(18):
        for p, gn in GGUF_NAMES.items():
            by_gguf[f"l{i}.{p}"] = f"blk.{i}.{gn}.weight"
    quantised = [n for n in rd.names if rd.info(n)["dtype"] in ("q8g", "q8ga")]
    assert sorted(quantised) == sorted(by_gguf) and "lm_head" not in rd.names
    types = {}
    rng = np.random.default_rng(0)
    for name in quantised:
        t = g[by_gguf[name]]
        types[name] = t.tensor_type.name
        n, k = rd.info(name)["shape"]
        assert rd.info(name)["dtype"] == ("q8ga" if t.tensor_type.name == "Q4_K" else "q8g"), name
        # converter revision 6: the blocks' own f16 scales stay f16 (the GEMMs and the gather below read them so)
        assert rd.info(name + ".scale")["dtype"] == ("f16" if t.tensor_type.name in ("Q8_0", "Q5_0") else "f32"), name
        step = 16384  # rows at a time: the 262,144 × 640 table in 16 slices
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            want = np.asarray(gguf.quants.dequantize(t.data[r0:r1], t.tensor_type), np.float32).reshape(r1 - r0, k)
            np.testing.assert_array_equal(bits(rd.panel_rows(name, r0, r1)), bits(want), err_msg=f"{name} [{r0}:{r1})")
        # through the GEMM of every backend: 8 unit rows (columns of W) spread over the groups
        cols = np.sort(rng.choice(k, 8, replace=False))
        want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(n, k)[:, cols].T
        eye = np.zeros((8, k), np.float32)
        eye[np.arange(8), cols] = 1
        for b in BACKENDS:
            np.testing.assert_array_equal(K.linear(eye, f, name, backend=b, threads=2), want, err_msg=f"{name} {b}")
    assert set(types.values()) == {"Q8_0", "Q5_0", "Q6_K", "Q4_K"}
    assert sum(v == "Q4_K" for v in types.values()) == 27
    # the gather the forward pass embeds tokens with
    m = N.Model(str(fgm), max_context=64, threads=2)
    tokens = sorted({0, 1, 2, 106, 262143, *rng.integers(0, 262144, 500).tolist()})
    t = g["token_embd.weight"]
    want = np.asarray(gguf.quants.dequantize(t.data[tokens], t.tensor_type), np.float32).reshape(len(tokens), 640)
    np.testing.assert_array_equal(bits(m.embedding_rows(tokens)), bits(want))
