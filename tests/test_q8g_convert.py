"""The q8g weight type (docs/fgm-extensions.md) and `--weights int8g`, converter side.

* quantize_q8_groups against the `gguf` package (llama.cpp's own Python quantisers and dequantisers, an oracle we
  did not write): every symmetric block type it can quantise (Q8_0, Q5_0, Q4_0, TQ1_0, TQ2_0, MXFP4) and, from random
  blocks it dequantises, Q6_K, Q3_K and NVFP4 are reproduced EXACTLY (codes × float32 scale == value, in float32);
  asymmetric types and plain floats fall back to amax/127 with error <= amax/254;
* the panel layout against the spec's address formula and tests/tools/fgm_decode.py (written from the spec);
* conversions of the tiny fixtures and of a small mixed-type GGUF made here (per-tensor groups gcd(--group,
  sub-block)); options that do not fit give one precise ConversionError and no file;
* random-model --weights int8g, and the default model's cache being made again after a converter change.
"""
from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import numpy as np
import pytest

from splitgemma import _native as N
from splitgemma.fgm import ConversionError, convert_checkpoint, quant
from splitgemma.fgm import random_model as rm
from splitgemma.fgm.writer import BODY_START
from test_convert import fgm_blob, fgm_header
from tools.fgm_decode import FgmReader
from tools.reference_forward import load_hf_checkpoint

gguf = pytest.importorskip("gguf")  # a runtime dependency of splitgemma; the oracle here
QT = gguf.GGMLQuantizationType

FIX = Path(__file__).parent / "fixtures"
TINY = FIX / "gemma3-tiny"
MINI = FIX / "fastgemma" / "mini-e2b"
LM = "model.language_model."
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def sample(rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Gaussian rows over five decades of magnitude, one all-zero row and one row with an outlier."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, k)) * 10.0 ** rng.uniform(-4, 1, (rows, 1))
    w[1] = 0
    w[2, 7] *= 40
    return w.astype(np.float32)


def gguf_roundtrip(w: np.ndarray, qtype) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype), np.float32).reshape(w.shape)


def assert_exact(values: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    q, s = quant.quantize_q8_groups(values, group)
    assert q.dtype == np.int8 and s.dtype == np.float32 and s.shape == (values.shape[0], values.shape[1] // group)
    assert q.min() >= -127
    recon = q.reshape(-1, group).astype(np.float32) * s.reshape(-1, 1)   # the product in float32
    bad = np.flatnonzero((recon != values.reshape(-1, group)).any(axis=1))
    assert bad.size == 0, f"{bad.size} groups not reproduced exactly, first {bad[:5]}"
    return q, s


def random_blocks(qtype, rows: int, k: int, seed: int, scale_at) -> np.ndarray:
    """Random raw GGML blocks ([rows, bytes]) with a finite f16 scale at byte `scale_at` (an int, or a tuple of
    them: d and dmin) of each block (None: every byte pattern is valid)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * k // block, nbytes), dtype=np.uint8)
    for at in () if scale_at is None else (scale_at,) if isinstance(scale_at, int) else scale_at:
        d = (rng.uniform(1e-4, 1e-1, raw.shape[0]) * rng.choice([-1, 1], raw.shape[0])).astype(np.float16)
        raw[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def gguf_dequantize(raw: np.ndarray, qtype) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(raw, qtype), np.float32)


# ------------------------------------------------------------------------------------------------------------------
# the quantiser against the gguf package

@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q4_0", "TQ1_0", "TQ2_0", "MXFP4"])
def test_symmetric_block_types_are_kept_exactly(qtype):
    values = gguf_roundtrip(sample(48, 512), QT[qtype])
    assert_exact(values, 32)
    if qtype != "Q8_0":
        # Codes of magnitude <= 16: any smaller group still has its smallest magnitude within 32 steps. (A few
        # Q8_0 values can all be beyond 32 steps, out of the search's reach, which is why 32 is the group.)
        assert_exact(values, 16)
        assert_exact(values, 8)


def block_scales_and_codes(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(d float32 [blocks], codes int64 [blocks, 32]) read from raw Q8_0 / Q4_0 blocks (f16 d first; Q8_0: 32 int8
    codes; Q4_0: 16 bytes, value j in the low nibble of byte j, value j + 16 in the high one, code = nibble - 8)."""
    blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[QT[qtype]][1])
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(-1)
    if qtype == "Q8_0":
        return d, blocks[:, 2:].copy().view(np.int8).astype(np.int64)
    nib = blocks[:, 2:].astype(np.int64)
    return d, np.concatenate([nib & 15, nib >> 4], axis=1) - 8


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_step_is_the_block_scale_times_the_codes_gcd(qtype):
    """The coarsest grid: the block's f16 `d` times the gcd of its codes, read from the raw block bytes."""
    w = sample(32, 256, seed=3)
    w[5, :32] = np.tile([-8.0, 4.0, 2.0, -6.0], 8)     # Q4_0 codes -8, 4, 2, -6: step 2d
    w[6, :32] = np.tile([-8.0, 4.0, 0.0, 0.0], 8)      # step 4d
    raw = gguf.quants.quantize(w, QT[qtype])
    d, codes = block_scales_and_codes(raw, qtype)
    g = np.gcd.reduce(np.abs(codes), axis=1)
    values = gguf_dequantize(raw, QT[qtype])
    q, s = assert_exact(values, 32)
    nonzero = g > 0
    np.testing.assert_array_equal(s.reshape(-1)[nonzero], (np.abs(d) * g)[nonzero])
    np.testing.assert_array_equal(np.abs(q.reshape(-1, 32)[nonzero]), np.abs(codes[nonzero]) // g[nonzero, None])
    assert np.all(s.reshape(-1)[~nonzero] == np.float32(1 / 127))
    if qtype == "Q4_0":
        assert set(g[[5 * 8, 6 * 8]]) == {2, 4}


@pytest.mark.parametrize("qtype,scale_at", [("Q6_K", 208), ("Q3_K", 108), ("NVFP4", None)])
def test_sixteen_wide_block_types_are_exact_at_group_16(qtype, scale_at):
    """Types the gguf package only dequantises, from random blocks: one scale per 16 values, so group 16 (the gcd
    the converter takes for them) is exact. At group 32 two Q6_K scales rarely share a grid within ±127."""
    values = gguf_dequantize(random_blocks(QT[qtype], 32, 512, seed=4, scale_at=scale_at), QT[qtype])
    assert_exact(values, 16)
    assert_exact(values, 8)
    if qtype == "Q6_K":
        q, s = quant.quantize_q8_groups(values, 32)
        exact = (q.reshape(-1, 32).astype(np.float32) * s.reshape(-1, 1) == values.reshape(-1, 32)).all(axis=1)
        assert exact.mean() < 0.5, f"{qtype} at group 32: {exact.mean():.2f} of the groups exact"


def fallback_check(values: np.ndarray, group: int) -> float:
    """Groups off any grid: s = float32(amax/127), codes rint(w/s) in ±127, error <= amax/254 (returns the share of
    groups that were on a grid after all)."""
    q, s = quant.quantize_q8_groups(values, group)
    x = values.reshape(-1, group).astype(np.float64)
    amax = np.abs(x).max(axis=1)
    err = np.abs(q.reshape(-1, group) * s.reshape(-1, 1).astype(np.float64) - x).max(axis=1)
    assert np.all(err <= amax / 254 * (1 + 1e-6)), (err / amax).max() * 254
    assert q.min() >= -127 and q.max() <= 127
    rounded = s.reshape(-1) == (amax / 127).astype(np.float32)
    sr = s.reshape(-1)[rounded].astype(np.float64)
    np.testing.assert_array_equal(q.reshape(-1, group)[rounded],
                                  np.clip(np.rint(x[rounded] / sr[:, None]), -127, 127))
    return 1 - rounded[amax > 0].mean()


def test_off_grid_values_fall_back_within_half_a_step():
    assert fallback_check(sample(64, 256, seed=5), 32) == 0           # plain floats
    assert fallback_check(sample(64, 224, seed=5), 28) == 0           # any group size
    for qtype in ("Q4_1", "Q5_1"):                                    # asymmetric blocks (a min per block)
        assert fallback_check(gguf_roundtrip(sample(64, 256, seed=6), QT[qtype]), 32) < 0.05
    # Q4_K (asymmetric sub-blocks of 32; d, dmin are the first two f16 of the block)
    raw = random_blocks(QT.Q4_K, 16, 512, seed=7, scale_at=0)
    raw.reshape(-1, 144)[:, 2:4] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)   # dmin
    assert fallback_check(gguf_dequantize(raw, QT.Q4_K), 32) < 0.05


def test_grid_search_rules():
    d = np.float32(0.0123)

    def one(vals) -> tuple[list[int], np.float32]:
        q, s = quant.quantize_q8_groups(np.asarray([vals], np.float32), len(vals))
        return q[0].tolist(), s[0, 0]

    def fallback(amax) -> np.float32:   # amax/127 in float64, rounded once to float32
        return np.float32(np.float64(np.float32(amax)) / 127)

    # the coarsest step of the candidates: codes 2, 3, -1, 4 at 3d (not 6, 9, -3, 12 at d)
    assert one([6 * d, 9 * d, -3 * d, 12 * d]) == ([2, 3, -1, 4], np.float32(3 * d))
    # smallest magnitude 32 steps: j = 32 finds d; at 33 steps no j <= 32 does (fallback amax/127)
    assert one([32 * d, 33 * d, -127 * d, 0]) == ([32, 33, -127, 0], d)
    q, s = one([33 * d, 34 * d, 100 * d, 0])
    assert s == fallback(100 * d) and q[2] == 127
    # |code| <= 127: 127 steps fit, 128 do not
    assert one([d, -127 * d]) == ([1, -127], d)
    q, s = one([d, -128 * d])
    assert s == fallback(128 * d) and q == [1, -127]
    # within 1e-3 of a code is on the grid; 2e-3 off is not
    assert one([d, 2 * d, (3 + 5e-4) * d, 5 * d])[1] == d
    assert one([d, 2 * d, (3 + 2e-3) * d, 5 * d])[1] == fallback(5 * d)
    # all zero: codes 0, scale 1/127
    assert one([0.0] * 4) == ([0, 0, 0, 0], np.float32(1 / 127))
    for bad in (0, -8, 3, 2.0, True):
        with pytest.raises(ValueError, match="does not divide K = 8"):
            quant.quantize_q8_groups(np.ones((2, 8), np.float32), bad)


def test_q8_0_embedding_sized_input_takes_seconds(report):
    """A Gemma 3 270M-sized share of Q8_0 rows (the whole 262144 x 640 table took ~4 s on this 2-core machine):
    the search only revisits the groups still unresolved."""
    values = gguf_roundtrip((0.03 * np.random.default_rng(8).standard_normal((32768, 640))).astype(np.float32),
                            QT.Q8_0)
    t0 = time.perf_counter()
    assert_exact(values, 32)
    dt = time.perf_counter() - t0
    report(f"q8g: quantize_q8_groups on 32768x640 Q8_0 values: {dt:.2f} s (x8 for the 262144x640 embedding)")
    assert dt < 30, dt


# ------------------------------------------------------------------------------------------------------------------
# the panel layout

def test_panel_order_addresses_and_decode():
    rng = np.random.default_rng(9)
    n, k, group = 48, 40, 8
    q = rng.integers(-127, 128, (n, k)).astype(np.int8)
    stream = quant.panel_order(q)
    nn, kk = np.meshgrid(np.arange(n), np.arange(k), indexing="ij")
    addr = (nn // 16) * k * 16 + kk * 16 + nn % 16        # docs/fgm-extensions.md
    np.testing.assert_array_equal(stream[addr], q)
    np.testing.assert_array_equal(quant.unpanel(stream, n, k), q)
    s = rng.uniform(0.5, 2, (n, k // group)).astype(np.float32)
    want = (q.reshape(n, -1, group) * s[:, :, None].astype(np.float64)).reshape(n, k)
    np.testing.assert_array_equal(quant.decode("q8g", stream.view(np.uint8), s.T.copy(), n, k), want)
    with pytest.raises(ValueError, match="N % 16"):
        quant.panel_order(q[:40])


# ------------------------------------------------------------------------------------------------------------------
# conversion of a Hugging Face checkpoint

@pytest.fixture(scope="module")
def tiny_int8g(tmp_path_factory):
    out = tmp_path_factory.mktemp("q8g") / "tiny.fgm"
    convert_checkpoint(TINY, out, weights="int8g", progress=False)
    return out


def test_int8g_header(tiny_int8g):
    h = fgm_header(tiny_int8g)
    c, t = h["config"], h["tensors"]
    assert c["hadamard"] == 0 and c["group"] == 32 and c["quant"] == {"ffn": 8, "attn": 8, "ple": 4, "emb": 8}
    # int8g asks for an f16 K/V cache; the engine follows the file unless told otherwise
    assert c["kv_cache_dtype"] == "f16"
    assert N.Model(str(tiny_int8g), max_context=64, threads=1).kv_layout["kv_dtype"] == "f16"
    assert N.Model(str(tiny_int8g), max_context=64, threads=1, kv_dtype="int8").kv_layout["kv_dtype"] == "int8"
    assert not any(".i8" in n for n in t)
    assert "lm_head" not in t  # the q8g embedding table is the tied head
    quantised = ["embed_tokens"] + [f"l{i}.{p}" for i in range(6) for p in LINEARS]
    assert sorted(n for n, e in t.items() if e["dtype"] not in ("f32", "f16")) == sorted(quantised)
    for n in quantised:
        e, sc = t[n], t[n + ".scale"]
        rows, k = e["shape"]
        assert e["dtype"] == "q8g" and e["meta"] == {"hadamard": 0, "group": 32} and e["nbytes"] == rows * k, n
        assert sc["dtype"] == "f32" and sc["shape"] == [k // 32, rows] and sc["meta"] == {}, n
    assert t["l0.o_proj"]["shape"] == [128, 256] and t["l0.k_proj"]["shape"] == [128, 128]


def test_int8g_values_are_the_quantisers(tiny_int8g):
    """fgm_decode (written from the spec) reads back exactly quantize_q8_groups of the checkpoint weights; the native
    reader reports the groups."""
    from splitgemma._native import FgmFile

    _, weights = load_hf_checkpoint(TINY)
    rd = FgmReader(tiny_int8g)
    for name, hf in [("embed_tokens", "embed_tokens.weight")] + \
                    [(f"l{i}.{p}", f"layers.{i}.{'mlp' if p in LINEARS[4:] else 'self_attn'}.{p}.weight")
                     for i in (0, 2, 5) for p in LINEARS]:
        q, s = quant.quantize_q8_groups(weights[LM + hf], 32)
        codes, scales = rd.codes_and_scales(name)
        np.testing.assert_array_equal(codes, q, err_msg=name)
        np.testing.assert_array_equal(scales, s.T, err_msg=name)
        w = weights[LM + hf].astype(np.float64)
        assert np.linalg.norm(rd.weight(name) - w) / np.linalg.norm(w) < 0.01, name
    h = fgm_header(tiny_int8g)["tensors"]
    f = FgmFile(str(tiny_int8g))
    assert f.tensor_info("l3.down_proj") == {"dtype": "q8g", "shape": (128, 256), "offset": h["l3.down_proj"]["offset"],
                                             "nbytes": 128 * 256, "hadamard": 0, "group": 32}


@pytest.mark.parametrize("threads", [1, 3])
def test_int8g_output_does_not_depend_on_chunks_or_threads(tiny_int8g, tmp_path, monkeypatch, threads):
    from splitgemma.fgm import convert as convert_module

    monkeypatch.setattr(convert_module, "_CHUNK_ELEMS", 2048)   # 16-row chunks: many per tensor
    out = tmp_path / "t.fgm"
    convert_checkpoint(TINY, out, weights="int8g", progress=False, threads=threads)
    assert out.read_bytes()[BODY_START:] == tiny_int8g.read_bytes()[BODY_START:]
    assert fgm_header(out)["meta"]["quant_rel_err"] == fgm_header(tiny_int8g)["meta"]["quant_rel_err"]


def test_int8g_other_groups_and_bad_options(tmp_path):
    out = tmp_path / "g.fgm"
    convert_checkpoint(TINY, out, weights="int8g", group=8, progress=False)
    t = fgm_header(out)["tensors"]
    assert t["l0.q_proj"]["meta"]["group"] == 8 and t["l0.q_proj.scale"]["shape"] == [16, 256]
    assert FgmReader(out).codes_and_scales("l1.up_proj")[1].shape == (16, 256)
    out.unlink()
    # 48 divides neither K = 128 nor K = 256: every tensor is named, nothing is written
    with pytest.raises(ConversionError) as err:
        convert_checkpoint(TINY, out, weights="int8g", group=48, progress=False)
    msg = str(err.value)
    assert msg.startswith("this model cannot be stored with --weights int8g --group 48")
    assert "embed_tokens [512, 128]: int8 group 48 does not divide K = 128" in msg
    assert "l5.down_proj [128, 256]: int8 group 48 does not divide K = 256" in msg
    assert len(err.value.problems) == 1 + 6 * 7  # the embedding (also the head) and 7 linears a layer
    # 256 divides the down projections' K only
    with pytest.raises(ConversionError) as err:
        convert_checkpoint(TINY, out, weights="int8g", group=256, progress=False)
    assert "l0.o_proj" not in str(err.value) and "l0.down_proj" not in str(err.value)
    assert "l0.q_proj [256, 128]: int8 group 256 does not divide K = 128" in str(err.value)
    for kwargs, message in (({"group": 0}, "group must be a positive integer, got 0"),
                            ({"emb_bits": 4}, "emb_bits 4 does not go with --weights int8g"),
                            ({"group": True}, "group must be a positive integer, got True")):
        with pytest.raises(ConversionError, match=re.escape(message)):
            convert_checkpoint(TINY, out, weights="int8g", progress=False, **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_int8g_cli(tmp_path, capsys):
    from splitgemma import cli

    out = tmp_path / "c.fgm"
    assert cli.main(["convert", str(TINY), str(out), "--weights", "int8g", "--no-progress"]) == 0
    assert fgm_header(out)["tensors"]["embed_tokens"]["dtype"] == "q8g"
    assert cli.main(["convert", str(TINY), str(tmp_path / "x.fgm"), "--weights", "int8g", "--group", "96"]) == 1
    err = capsys.readouterr().err
    stages, _, error = err.partition("splitgemma: error: ")  # the stage lines of convert come first
    assert all(line.startswith("convert ") for line in stages.splitlines()), err
    assert error.startswith("this model cannot be stored with --weights int8g --group 96")
    assert "l0.gate_proj [256, 128]: int8 group 96 does not divide K = 128" in err
    with pytest.raises(SystemExit):
        cli.main(["convert", "--help"])
    helptext = " ".join(capsys.readouterr().out.split())
    assert "'int8g' = every" in helptext and "default: dual for a checkpoint, int8g for a GGUF" in helptext


# ------------------------------------------------------------------------------------------------------------------
# a small GGUF of mixed block types, made here from the tiny Gemma 3 checkpoint

# GGUF tensor -> its type in the file ("Q6_K"/"Q3_K" are random blocks; K = 256 fits their 256-value super-block)
GGUF_TYPES = {"token_embd": "Q8_0", "attn_q": "Q5_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q6_K",
              "ffn_gate": "F16", "ffn_up": "Q4_1", "ffn_down": "Q3_K"}
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
# where each random-block type keeps its f16 fields (d, and dmin / m)
_SCALE_AT = {"Q6_K": 208, "Q3_K": 108, "Q4_K": (0, 2), "Q5_K": (0, 2), "Q5_1": (0, 2)}


def write_tiny_gguf(path: Path, types=None) -> dict[str, np.ndarray]:
    """The tiny Gemma 3 as a GGUF (gemma3 keys, a SentencePiece-style vocabulary); returns each weight's values as
    the gguf package dequantises them, by GGUF name. types(layer, name) gives each tensor's GGML type (layer None
    for token_embd; default GGUF_TYPES[name])."""
    types = types or (lambda layer, name: GGUF_TYPES[name])
    cfg, weights = load_hf_checkpoint(TINY)
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(6)
    w.add_embedding_length(128)
    w.add_feed_forward_length(256)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(64)
    w.add_value_length(64)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(16)
    w.add_rope_freq_base(1e6)
    w.add_array("gemma3.attention.sliding_window_pattern", [True, True, False, True, True, False])
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"\u2581w{i}" for i in range(512 - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([3, 3, 3, 2] + [6] * 256 + [1] * (len(tokens) - 260))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    values = {}
    rng_seed = iter(range(100, 1000))

    def add(name: str, a: np.ndarray, qtype: str):
        if qtype in _SCALE_AT:
            raw = random_blocks(QT[qtype], a.shape[0], a.shape[1], next(rng_seed), _SCALE_AT[qtype])
        elif qtype == "F16":
            raw = a.astype(np.float16)
        else:
            raw = gguf.quants.quantize(a, QT[qtype])
        w.add_tensor(name, raw, raw_dtype=QT[qtype])
        values[name] = gguf_dequantize(raw, QT[qtype]).reshape(a.shape)

    add("token_embd.weight", weights[LM + "embed_tokens.weight"], types(None, "token_embd"))
    w.add_tensor("output_norm.weight", 1 + weights[LM + "norm.weight"])
    for i in range(6):
        pre = f"{LM}layers.{i}."
        for hf, g in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "post_attention_norm"),
                      ("pre_feedforward_layernorm", "ffn_norm"), ("post_feedforward_layernorm", "post_ffw_norm"),
                      ("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm")):
            w.add_tensor(f"blk.{i}.{g}.weight", 1 + weights[pre + hf + ".weight"])
        for p, g in GGUF_NAMES.items():
            hf = f"{pre}{'mlp' if p in LINEARS[4:] else 'self_attn'}.{p}.weight"
            add(f"blk.{i}.{g}.weight", weights[hf], types(i, g))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    values = write_tiny_gguf(d / "tiny.gguf")
    out = d / "tiny.fgm"
    convert_checkpoint(d / "tiny.gguf", out, progress=False)   # the GGUF default: int8g, group 32
    return d / "tiny.gguf", out, values


def test_gguf_default_is_int8g_with_the_block_types_groups(tiny_gguf):
    src, out, values = tiny_gguf
    t = fgm_header(out)["tensors"]
    assert t["embed_tokens"]["dtype"] == "q8g" and "lm_head" not in t
    rd = FgmReader(out)
    exact_types = {"Q8_0", "Q5_0", "Q4_0", "Q6_K", "Q3_K", "Q4_1"}
    for i in range(6):
        for p, g in GGUF_NAMES.items():
            name, qtype = f"l{i}.{p}", GGUF_TYPES[g]
            group = 16 if qtype in ("Q6_K", "Q3_K") else 32
            dtype = "q8ga" if qtype == "Q4_1" else "q8g"   # Q4_1 has a minimum per block: an offset
            assert t[name]["dtype"] == dtype and t[name]["meta"] == {"hadamard": 0, "group": group}, name
            # the blocks' own f16 scale d stays f16; d · sc (the K types) and the grid search's scales need f32
            scale_dtype = "f16" if qtype in ("Q8_0", "Q5_0", "Q4_0", "Q4_1") else "f32"
            assert t[name + ".scale"]["dtype"] == scale_dtype, name
            want = values[f"blk.{i}.{g}.weight"]
            codes, scales = rd.codes_and_scales(name)
            if qtype in ("Q3_K", "F16"):   # no block reader (tests/test_gguf_exact.py has those): the grid search
                q, s = quant.quantize_q8_groups(want, group)
                np.testing.assert_array_equal(codes, q, err_msg=name)
                np.testing.assert_array_equal(scales, s.T, err_msg=name)
            got = rd.dequantize(name)
            if qtype in exact_types:   # the GGUF's own values, bit for bit
                np.testing.assert_array_equal(got.astype(np.float32), want, err_msg=name)
            else:
                assert np.abs(got - want).max() <= np.abs(want).max() / 254 * (1 + 1e-6), name
    np.testing.assert_array_equal(rd.dequantize("embed_tokens").astype(np.float32), values["token_embd.weight"])
    assert out.with_suffix(".tokenizer.json").is_file()
    assert t["embed_tokens.scale"]["dtype"] == "f16"  # Q8_0


def test_gguf_group_is_gcd_with_the_sub_block(tiny_gguf, tmp_path):
    src, _, values = tiny_gguf
    out = tmp_path / "g8.fgm"
    convert_checkpoint(src, out, group=8, progress=False)
    t = fgm_header(out)["tensors"]
    assert {t[f"l0.{p}"]["meta"]["group"] for p in LINEARS} == {8}
    np.testing.assert_array_equal(FgmReader(out).dequantize("l4.o_proj").astype(np.float32),
                                  values["blk.4.attn_output.weight"])
    # 64: the 32-value block types (Q8_0, Q5_0, Q4_0, Q4_1) take 32, Q6_K/Q3_K 16, the F16 gate projections 64
    convert_checkpoint(src, out, group=64, progress=False)
    t = fgm_header(out)["tensors"]
    assert [t[f"l1.{p}"]["meta"]["group"] for p in LINEARS] == [32, 32, 32, 16, 64, 32, 16]
    assert t["embed_tokens"]["meta"]["group"] == 32
    # 48: gcd 16 for every block type; the F16 gate projections (K = 128) cannot take 48
    with pytest.raises(ConversionError) as err:
        convert_checkpoint(src, tmp_path / "bad.fgm", group=48, progress=False)
    assert [p.split(":")[0] for p in err.value.problems] == [f"l{i}.gate_proj [256, 128]" for i in range(6)]
    assert not (tmp_path / "bad.fgm").exists()


def test_gguf_weights_int8_keeps_its_layout(tiny_gguf, tmp_path):
    """Asked for explicitly, the former GGUF default is unchanged: q8c linears (rotated), q8r table, q8c head."""
    src, _, _ = tiny_gguf
    out = tmp_path / "i8.fgm"
    convert_checkpoint(src, out, weights="int8", progress=False)
    t = fgm_header(out)["tensors"]
    assert (t["embed_tokens"]["dtype"], t["lm_head"]["dtype"]) == ("q8r", "q8c")
    assert {t[f"l2.{p}"]["dtype"] for p in LINEARS} == {"q8c"}
    assert t["l2.q_proj"]["meta"] == {"hadamard": 128, "group": 0}


def test_gguf_sub_blocks():
    from splitgemma.fgm.gguf_source import ggml_sub_block

    sizes = gguf.GGML_QUANT_SIZES
    assert {t.name: ggml_sub_block(t.name, sizes[t][0]) for t in (QT.F32, QT.F16, QT.BF16)} == \
        {"F32": None, "F16": None, "BF16": None}
    assert [ggml_sub_block(n, sizes[QT[n]][0]) for n in ("Q6_K", "Q3_K", "Q2_K", "NVFP4")] == [16] * 4
    assert [ggml_sub_block(n, sizes[QT[n]][0]) for n in ("Q8_0", "Q5_0", "Q4_0", "Q4_K", "MXFP4", "TQ2_0")] == [32] * 6


# ------------------------------------------------------------------------------------------------------------------
# random-model, the engine, the default model's cache

def test_random_model_int8g_layout_equals_converter(tmp_path, monkeypatch):
    from splitgemma._native import FgmFile

    monkeypatch.setitem(rm.PRESETS, "tiny", json.loads((MINI / "config.json").read_text())["text_config"])
    a, b = tmp_path / "r.fgm", tmp_path / "c.fgm"
    rm.write_random_model(rm.preset_config("tiny"), a, weights="int8g", progress=False)
    convert_checkpoint(MINI, b, weights="int8g", progress=False)
    fa, fb = FgmFile(str(a)), FgmFile(str(b))
    assert fa.layout_signature == fb.layout_signature
    assert json.loads(fa.header_json)["config"] == json.loads(fb.header_json)["config"]
    assert fa.tensor_info("embed_tokens_per_layer")["dtype"] == "q4r"
    rd = FgmReader(a)
    for name in ("embed_tokens", "per_layer_model_projection", "l0.q_proj", "l5.down_proj"):
        assert rd.info(name)["dtype"] == "q8g" and 0.02 <= rd.dequantize(name).std() <= 0.05, name


def test_engine_runs_int8g(tiny_int8g, report):
    """The engine against the float64 reference on the file's own weights: with f32 activations on the q8g weights,
    with the f16 K/V the file asks for and with the f32 K/V option (fidelity checks: no rounding of the cached K/V at
    all); and with the default int8 activations (quantised per 32 inputs, gemm.h)."""
    from tools.reference_forward import forward

    cfg, _ = load_hf_checkpoint(TINY)
    decoded = FgmReader(tiny_int8g).hf_weights(ffn="int8")
    ids = np.load(TINY / "reference.npz")["prompt_ids_1"]
    want = forward(decoded, cfg, ids, norms_as_stored=True)
    err = {}
    for kv, q8g_input in ((None, "f32"), ("f32", "f32"), (None, "int8")):
        m = N.Model(str(tiny_int8g), max_context=128, threads=2, kv_dtype=kv, q8g_input=q8g_input)
        assert m.kv_layout["kv_dtype"] == (kv or "f16") and m.q8g_input == q8g_input
        got = m.prefill(N.KvArena(m, bytearray(m.kv_slot_bytes), 1), 0, ids.astype(np.int32), all_logits=True)
        cos = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
        err[(kv or "f16", q8g_input)] = (1 - float(cos.min()), float(np.abs(got - want).max()))
    report(f"tiny Gemma 3 int8g, engine vs float64 reference ((K/V, activations): 1 - cosine min, max |logit "
           f"difference|): {err}")
    # With f32 activations nothing is quantised at run time (the f16 K/V the file asks for): only float rounding is
    # left (measured: 1 - cosine 4e-7, max |logit difference| 0.0017; with an int8 K/V cache 3.5e-4 and 0.06). f32
    # K/V removes the f16 rounding of the cache as well. The int8 activations' own error (measured 8.8e-4 and 0.081)
    # is about an int8 K/V cache's.
    assert err[("f16", "f32")][0] <= 1e-5 and err[("f16", "f32")][1] <= 0.01, err
    assert err[("f32", "f32")][1] < err[("f16", "f32")][1] and err[("f32", "f32")][0] <= err[("f16", "f32")][0], err
    assert err[("f16", "int8")][0] <= 3e-3 and err[("f16", "int8")][1] <= 0.25, err


def test_q8g_input_defaults_to_int8(tiny_int8g, monkeypatch):
    """int8 activations by default on every backend (each has an int8 product faster than its f32 FMAs);
    FGM_Q8G_INPUT and the argument override it; a bad name is refused by name."""
    monkeypatch.delenv("FGM_Q8G_INPUT", raising=False)
    backends = [b for b in ("avx2", "vnni", "amx") if N.kernels.cpu_supports(b)]
    for b in backends:
        assert N.Model(str(tiny_int8g), max_context=32, threads=1, backend=b).q8g_input == "int8"
    monkeypatch.setenv("FGM_Q8G_INPUT", "f32")
    assert N.Model(str(tiny_int8g), max_context=32, threads=1, backend="avx2").q8g_input == "f32"
    monkeypatch.delenv("FGM_Q8G_INPUT")
    assert N.Model(str(tiny_int8g), max_context=32, threads=1, q8g_input="f32").q8g_input == "f32"
    with pytest.raises(ValueError, match="q8g activations must be 'int8' or 'f32', got 'bf16'"):
        N.Model(str(tiny_int8g), max_context=32, threads=1, q8g_input="bf16")


def test_default_model_cache_is_remade_after_a_converter_change(tmp_path, monkeypatch):
    from splitgemma import default_model as dm
    from splitgemma.fgm import convert as convert_module

    monkeypatch.setenv("SPLITGEMMA_CACHE", str(tmp_path))
    d = tmp_path / dm.MODEL_NAME
    d.mkdir()
    calls = []

    def fake_convert(src, out, **kwargs):
        calls.append(kwargs)
        Path(out).write_bytes(b"x" * 100)
        Path(out).with_suffix(".tokenizer.json").write_text("{}")
        return {"seconds": 0.0, "bytes": 100}

    monkeypatch.setattr(convert_module, "convert_checkpoint", fake_convert)
    monkeypatch.setattr(dm, "ensure_gguf", lambda progress: d / dm.GGUF_NAME)
    monkeypatch.setattr(dm, "_stop_tokens", lambda tok: [1, 106])
    fgm = d / f"{dm.MODEL_NAME}.fgm"
    fgm.write_bytes(b"o" * 50)
    fgm.with_suffix(".tokenizer.json").write_text("{}")
    # the cache an existing user has: revision 5, whose Q8_0 and Q5_0 scales were stored as f32
    (d / "converted.json").write_text(json.dumps({"gguf_sha256": dm.GGUF_SHA256, "conversion": "int8g-g32-r5",
                                                  "fgm_bytes": 50}))
    assert dm.resolve_default_model(progress=False)[0] == str(fgm)
    assert calls == [{"weights": "int8g", "group": 32, "progress": False}], "an old cache is converted again"
    stamp = json.loads((d / "converted.json").read_text())
    assert stamp["conversion"] == dm.CONVERSION == "int8g-g32-r6" and stamp["fgm_bytes"] == 100
    dm.resolve_default_model(progress=False)
    assert len(calls) == 1, "the new cache is reused"
