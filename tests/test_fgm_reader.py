"""The native .fgm reader: fastgemma's own files load; every kind of bad file gives one precise FgmError."""

import json
import random
import struct
from pathlib import Path

import numpy as np
import pytest

from splitgemma._native import FgmError, FgmFile

FIXTURES = Path(__file__).parent / "fixtures" / "fastgemma"
MINI = FIXTURES / "mini-e2b" / "mini-e2b.fgm"
BODY = 2_097_216  # where fastgemma's converter starts the first blob


def split_file(path):
    data = path.read_bytes()
    (hlen,) = struct.unpack("<I", data[8:12])
    header = json.loads(data[12 : 12 + hlen])
    return data, header


def write_with_header(tmp_path, data, header, name="bad.fgm"):
    """The same body with a rewritten header (it must still fit before the first blob)."""
    text = json.dumps(header, separators=(",", ":")).encode()
    assert 12 + len(text) <= BODY
    out = bytearray(data)
    out[12:BODY] = b"\0" * (BODY - 12)
    out[8:12] = struct.pack("<I", len(text))
    out[12 : 12 + len(text)] = text
    p = tmp_path / name
    p.write_bytes(bytes(out))
    return p


def expect_error(path, *fragments):
    with pytest.raises(FgmError) as err:
        FgmFile(str(path))
    msg = str(err.value)
    for frag in fragments:
        assert frag in msg, msg
    return msg


def test_fastgemma_file_loads_and_matches_its_header():
    f = FgmFile(str(MINI))
    data, header = split_file(MINI)
    assert f.file_size == len(data)
    assert sorted(f.tensor_names) == sorted(header["tensors"])
    for name, entry in header["tensors"].items():
        info = f.tensor_info(name)
        assert info["dtype"] == entry["dtype"]
        assert list(info["shape"]) == entry["shape"]
        assert info["offset"] == entry["offset"] and info["nbytes"] == entry["nbytes"]
        raw = f.raw(name)
        assert raw.nbytes == entry["nbytes"]
        assert bytes(raw[:64]) == data[entry["offset"] : entry["offset"] + min(64, entry["nbytes"])]
    assert f.tensor_info("l0.gate_proj")["group"] == 256
    assert f.tensor_info("l0.gate_proj")["hadamard"] == 128
    assert json.loads(f.header_json)["config"]["first_shared_layer"] == 4


def test_raw_view_is_read_only_and_outlives_the_reader():
    f = FgmFile(str(MINI))
    norm = f.raw("norm")
    del f
    assert not norm.flags.writeable
    vals = norm.view(np.float32)
    assert vals.shape == (256,) and np.isfinite(vals).all()


def test_layout_signature_ignores_conversion_stats(tmp_path):
    data, header = split_file(MINI)
    header["meta"]["convert_s"] = 12345.6
    other = write_with_header(tmp_path, data, header)
    assert FgmFile(str(other)).layout_signature == FgmFile(str(MINI)).layout_signature
    header["config"]["sliding_window"] = 32
    changed = write_with_header(tmp_path, data, header, "changed.fgm")
    assert FgmFile(str(changed)).layout_signature != FgmFile(str(MINI)).layout_signature


@pytest.mark.parametrize("cut", [0, 5, 11, 12, 2000, BODY - 1, BODY + 100, -1])
def test_truncated_files(tmp_path, cut):
    data = MINI.read_bytes()
    p = tmp_path / "cut.fgm"
    p.write_bytes(data[:cut] if cut >= 0 else data[:-1])
    msg = expect_error(p)
    assert any(word in msg for word in ("truncated", "too short", "past the end", "magic")), msg


def test_wrong_magic(tmp_path):
    data = bytearray(MINI.read_bytes())
    data[:8] = b"GGUF\0\0\0\0"
    (tmp_path / "m.fgm").write_bytes(bytes(data))
    expect_error(tmp_path / "m.fgm", "bad magic")


def test_zeroed_magic_means_interrupted_conversion(tmp_path):
    data = bytearray(MINI.read_bytes())
    data[:8] = bytes(8)
    (tmp_path / "z.fgm").write_bytes(bytes(data))
    expect_error(tmp_path / "z.fgm", "interrupted")


@pytest.mark.parametrize("hlen", [0, 10_000_000, 0xFFFFFFFF])
def test_header_length_out_of_range(tmp_path, hlen):
    data = bytearray(MINI.read_bytes())
    data[8:12] = struct.pack("<I", hlen)
    (tmp_path / "h.fgm").write_bytes(bytes(data))
    expect_error(tmp_path / "h.fgm", "header length")


@pytest.mark.parametrize(
    "mangle, fragment",
    [
        (lambda t: t.replace(b'"config"', b'"config":', 1), "invalid header JSON"),
        (lambda t: t[:-1], "invalid header JSON"),
        (lambda t: b"[" * 100 + b"]" * 100, "nesting"),
        (lambda t: b'"just a string"', "not an object"),
        (lambda t: t.replace(b'"tensors"', b'"tensorz"', 1), "no 'tensors'"),
    ],
)
def test_bad_json(tmp_path, mangle, fragment):
    data, _ = split_file(MINI)
    (hlen,) = struct.unpack("<I", data[8:12])
    text = mangle(data[12 : 12 + hlen])
    out = bytearray(data)
    out[12:BODY] = bytes(BODY - 12)
    out[8:12] = struct.pack("<I", len(text))
    out[12 : 12 + len(text)] = text
    (tmp_path / "j.fgm").write_bytes(bytes(out))
    expect_error(tmp_path / "j.fgm", fragment)


def mutate(tmp_path, fn, *fragments):
    data, header = split_file(MINI)
    fn(header)
    expect_error(write_with_header(tmp_path, data, header), *fragments)


def test_offset_past_eof(tmp_path):
    size = MINI.stat().st_size
    mutate(tmp_path, lambda h: h["tensors"]["norm"].update(offset=size - 64 * 3), "'norm'", "past the end")


def test_huge_offset_does_not_overflow(tmp_path):
    mutate(tmp_path, lambda h: h["tensors"]["lm_head"].update(offset=2**63 - 64), "'lm_head'", "past the end")


def test_misaligned_offset(tmp_path):
    mutate(tmp_path, lambda h: h["tensors"]["norm"].update(offset=h["tensors"]["norm"]["offset"] + 4), "aligned")


def test_offset_inside_header(tmp_path):
    mutate(tmp_path, lambda h: h["tensors"]["norm"].update(offset=64), "inside the header")


def test_overlapping_blobs(tmp_path):
    def overlap(h):
        t = h["tensors"]
        t["l0.input_layernorm"]["offset"] = t["l0.post_attention_layernorm"]["offset"]

    mutate(tmp_path, overlap, "overlap")


def test_unknown_dtype(tmp_path):
    mutate(tmp_path, lambda h: h["tensors"]["norm"].update(dtype="bf16"), "'norm'", "unknown dtype")


def test_nbytes_mismatch(tmp_path):
    mutate(tmp_path, lambda h: h["tensors"]["norm"].update(nbytes=512), "'norm'", "nbytes")


def test_wrong_dtype_for_its_role(tmp_path):
    # Same byte size (256 f32 = 512 f16), so only the inventory check can catch it.
    mutate(tmp_path, lambda h: h["tensors"]["norm"].update(dtype="f16", shape=[512]), "'norm'", "expected f32 [256]")


def test_wrong_shape_for_the_config(tmp_path):
    def reshape(h):
        t = h["tensors"]["l0.q_proj"]
        t["shape"] = [128, 512]  # same numel, wrong orientation

    mutate(tmp_path, reshape, "'l0.q_proj'", "expected [256, 256]")


def test_tile_constraints(tmp_path):
    def bad(h):
        t = h["tensors"]["l0.q_proj"]
        t["shape"] = [8, 8192]

    mutate(tmp_path, bad, "N % 16")


def test_bad_group(tmp_path):
    mutate(tmp_path, lambda h: h["tensors"]["l0.gate_proj"]["meta"].update(group=96), "group 96")


def as_q8g(h, name="l0.q_proj", group=256):
    """Relabel a q8c [256, 256] linear as q8g with one group (its f32 [256] scale is then [1, 256]: same bytes)."""
    t = h["tensors"][name]
    t.update(dtype="q8g", meta={"group": group, "hadamard": 0})
    h["tensors"][name + ".scale"]["shape"] = [256 // group, 256] if 256 % group == 0 else [1, 256]


def test_q8g_linear_is_accepted(tmp_path):
    data, header = split_file(MINI)
    as_q8g(header)
    f = FgmFile(str(write_with_header(tmp_path, data, header, "ok.fgm")))
    info = f.tensor_info("l0.q_proj")
    assert (info["dtype"], info["group"], info["hadamard"]) == ("q8g", 256, 0)


def test_q8g_linear_with_f16_scales_is_accepted(tmp_path):
    """A q8g weight's scales may be f16 (the block scales of a GGUF's Q8_0 or Q5_0, docs/fgm-extensions.md): the
    q8c scale's 1024 bytes relabelled f16 [2, 256] for two groups of 128."""
    data, header = split_file(MINI)
    as_q8g(header, group=128)
    header["tensors"]["l0.q_proj.scale"].update(dtype="f16", shape=[2, 256])
    f = FgmFile(str(write_with_header(tmp_path, data, header, "ok.fgm")))
    assert f.tensor_info("l0.q_proj.scale")["dtype"] == "f16"
    assert (f.tensor_info("l0.q_proj")["dtype"], f.tensor_info("l0.q_proj")["group"]) == ("q8g", 128)


@pytest.mark.parametrize("change,fragment", [
    (lambda h: h["tensors"]["l0.q_proj"]["meta"].update(hadamard=128), "meta.hadamard must be 0 for q8g"),
    (lambda h: h["tensors"]["l0.q_proj"]["meta"].update(group=48), "q8g needs meta.group"),
    (lambda h: h["tensors"]["l0.q_proj"]["meta"].pop("group"), "q8g needs meta.group"),
    (lambda h: h["tensors"]["l0.q_proj.scale"].update(shape=[256]), "expected f32 or f16 [1, 256]"),
    (lambda h: h["tensors"]["l0.q_proj.scale"].update(dtype="f16", shape=[2, 256]),
     "is f16 [2, 256], expected f32 or f16 [1, 256]"),
    (lambda h: h["tensors"]["l0.q_proj"].update(shape=[8, 8192]), "N % 16 == 0 (16-column panels)"),
])
def test_q8g_constraints(tmp_path, change, fragment):
    def fn(h):
        as_q8g(h)
        change(h)

    mutate(tmp_path, fn, fragment)


def test_missing_tensor(tmp_path):
    mutate(tmp_path, lambda h: h["tensors"].pop("l1.k_norm"), "'l1.k_norm' is missing")


def test_lm_head_may_only_be_left_out_for_a_q8g_table(tmp_path):
    # fastgemma's q4r table is no linear: the head must be there (a q8g table may be the head: test_q8g_convert)
    mutate(tmp_path, lambda h: h["tensors"].pop("lm_head"), "'lm_head' is missing")


def test_missing_scale(tmp_path):
    mutate(tmp_path, lambda h: h["tensors"].pop("lm_head.scale"), "'lm_head.scale' is missing")


def test_config_without_producer_for_shared_layer(tmp_path):
    def cfg(h):
        h["config"]["layer_types"] = ["full_attention"] * 4 + ["sliding_attention", "full_attention"]

    mutate(tmp_path, cfg, "shares K/V")


def test_bad_config_values(tmp_path):
    mutate(tmp_path, lambda h: h["config"].update(hidden_size="256"), "config.hidden_size")
    mutate(tmp_path, lambda h: h["config"].update(layer_types=["sliding_attention"]), "layer_types")
    mutate(tmp_path, lambda h: h["config"].update(num_key_value_heads=3), "multiple of num_key_value_heads")
    mutate(tmp_path, lambda h: h["config"].update(kv_cache_dtype="bf16"), "config.kv_cache_dtype must be")


def test_not_a_file(tmp_path):
    expect_error(tmp_path, "not a regular file")
    expect_error(tmp_path / "absent.fgm", "cannot open")


def test_random_header_corruption_never_crashes(tmp_path):
    """Flip random bytes of the header: each file either loads (harmless flip) or raises FgmError."""
    data, _ = split_file(MINI)
    (hlen,) = struct.unpack("<I", data[8:12])
    rng = random.Random(1234)
    outcomes = {"loaded": 0, "rejected": 0}
    p = tmp_path / "fuzz.fgm"
    for _ in range(150):
        buf = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            buf[12 + rng.randrange(hlen)] = rng.randrange(256)
        p.write_bytes(bytes(buf))
        try:
            FgmFile(str(p))
            outcomes["loaded"] += 1
        except FgmError:
            outcomes["rejected"] += 1
    assert outcomes["rejected"] > 50, outcomes
