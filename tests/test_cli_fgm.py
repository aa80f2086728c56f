"""The `splitgemma` CLI frame and its .fgm commands: convert, inspect, random-model."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from splitgemma import cli
from splitgemma.fgm import quant
from splitgemma.fgm import random_model as rm
from splitgemma.fgm.hf_config import load_text_config
from splitgemma.fgm.inventory import build_inventory, entries_of
from splitgemma.fgm.writer import BODY_START, plan_offsets

FIXTURES = Path(__file__).parent / "fixtures" / "fastgemma"
MINI = FIXTURES / "mini-e2b"
MINI_FGM = MINI / "mini-e2b.fgm"


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        status = cli.main(list(argv))
    except SystemExit as e:  # argparse: --help, usage errors
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


def test_python_dash_m_help():
    r = subprocess.run([sys.executable, "-m", "splitgemma", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for cmd in ("convert", "inspect", "random-model"):
        assert cmd in r.stdout


@pytest.mark.parametrize("cmd", ["convert", "inspect", "random-model"])
def test_command_help(capsys, cmd):
    status, out, _ = run_cli(capsys, cmd, "--help")
    assert status == 0 and out.startswith("usage: splitgemma " + cmd)


def test_usage_errors_exit_2(capsys):
    status, _, err = run_cli(capsys, "convert", str(MINI), "x.fgm", "--group", "0")
    assert status == 2
    assert "splitgemma: error: argument --group: invalid group 0: must be a positive integer" in err
    # Which positive groups fit depends on --weights (int8g takes any divisor of K): the converter says why.
    status, _, err = run_cli(capsys, "convert", str(MINI), "x.fgm", "--group", "100")
    assert status == 1
    assert err == ("splitgemma: error: group must be a positive multiple of 64 with --weights dual (any divisor "
                   "of every K only with int8g), got 100\n")
    status, _, err = run_cli(capsys, "convert", str(MINI), "x.fgm", "--threads", "0")
    assert status == 2 and "splitgemma: error: argument --threads: invalid value 0: must be at least 1" in err
    status, _, err = run_cli(capsys, "random-model", "--preset", "e3b", "x.fgm")
    assert status == 2 and "argument --preset: invalid choice: 'e3b'" in err
    status, _, err = run_cli(capsys, "frobnicate")
    assert status == 2 and "splitgemma: error: argument COMMAND: invalid choice: 'frobnicate'" in err
    status, _, err = run_cli(capsys)
    assert status == 2 and "splitgemma: error:" in err


def test_convert_and_inspect(capsys, tmp_path):
    out = tmp_path / "m.fgm"
    status, stdout, err = run_cli(capsys, "convert", str(MINI), str(out), "--no-progress", "--threads", "2")
    assert status == 0, err
    assert stdout.startswith(f"wrote {out}: 9,437,248 bytes, 194 tensors")
    assert err == ""
    assert out.read_bytes()[BODY_START:] == MINI_FGM.read_bytes()[BODY_START:]

    status, text, _ = run_cli(capsys, "inspect", str(out))
    assert status == 0
    assert "layer_types                  ssFssF (4 sliding, 2 full)" in text
    assert "  l0.gate_proj.i8                   q8c    [512, 256]   131,072  128       -" in text
    assert "  embed_tokens                      q4r    [1024, 256]  131,072  -         64" in text
    assert "  all        194  7,339,672  100.0%" in text

    status, text, _ = run_cli(capsys, "inspect", "--json", str(out))
    d = json.loads(text)
    from splitgemma._native import FgmFile
    f = FgmFile(str(out))
    assert d["file_size"] == out.stat().st_size and len(d["tensors"]) == len(f.tensor_names) == 194
    assert d["layout_signature"] == f"{f.layout_signature:016x}"
    assert sum(t["bytes"] for t in d["totals"].values()) == d["tensor_bytes"] == sum(t["nbytes"] for t in d["tensors"])
    assert d["totals"]["q4g"]["tensors"] == 19 and d["config"]["group"] == 256
    lm = next(t for t in d["tensors"] if t["name"] == "lm_head")
    assert lm == {"name": "lm_head", "dtype": "q4g", "shape": [1024, 256], "offset": 2236480, "nbytes": 131072,
                  "hadamard": 128, "group": 256}


def test_inspect_bad_files(capsys, tmp_path):
    data = MINI_FGM.read_bytes()
    trunc = tmp_path / "trunc.fgm"
    trunc.write_bytes(data[: len(data) - 1000])
    status, _, err = run_cli(capsys, "inspect", str(trunc))
    assert status == 1 and err.startswith(f"splitgemma: error: {trunc}: tensor '")
    assert "runs past the end of the file" in err and "Traceback" not in err

    zero = tmp_path / "zero.fgm"
    zero.write_bytes(b"\0" * 8 + data[8:])
    status, _, err = run_cli(capsys, "inspect", str(zero))
    assert status == 1 and "interrupted or failed conversion" in err

    status, _, err = run_cli(capsys, "inspect", str(tmp_path / "nope.fgm"))
    assert status == 1 and "splitgemma: error:" in err and "cannot open" in err


def test_convert_says_what_it_does_from_the_start(tmp_path):
    """Reading and checking a checkpoint comes before the first written byte: each stage is a line at once."""
    r = subprocess.run([sys.executable, "-m", "splitgemma", "convert", str(MINI), str(tmp_path / "m.fgm"),
                        "--threads", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0] == f"convert m.fgm: reading {MINI}", lines[:3]
    assert lines[1].startswith("convert m.fgm: checking ") and lines[2].startswith("convert m.fgm: writing ")
    assert lines[-1].startswith("convert m.fgm: 100%")


def test_convert_errors_without_traceback(tmp_path):
    """In a real process: a checkpoint with a missing tensor is reported (all problems), exit 1, no file."""
    from test_convert import make_checkpoint, oracle_config, oracle_tensors

    tensors = oracle_tensors()
    del tensors["model.language_model.layers.5.mlp.down_proj.weight"]
    del tensors["model.language_model.embed_tokens_per_layer.weight"]
    src = make_checkpoint(tmp_path / "ckpt", tensors, oracle_config())
    out = tmp_path / "o.fgm"
    r = subprocess.run([sys.executable, "-m", "splitgemma", "convert", str(src), str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    stages, _, error = r.stderr.partition("splitgemma: error: ")
    assert error and all(line.startswith("convert o.fgm: ") for line in stages.splitlines()), r.stderr
    assert "missing: model.language_model.layers.5.mlp.down_proj.weight" in r.stderr
    assert "missing: model.language_model.embed_tokens_per_layer.weight" in r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()

    r = subprocess.run([sys.executable, "-m", "splitgemma", "convert", str(tmp_path / "none"), str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "config.json: not found" in r.stderr and "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------------------
# random-model

@pytest.fixture
def tiny_preset(monkeypatch):
    """A test-only preset with mini-e2b's shapes (so the real presets' code path runs, but fast)."""
    raw = json.loads((MINI / "config.json").read_text())["text_config"]
    monkeypatch.setitem(rm.PRESETS, "tiny", raw)
    return "tiny"


def test_random_model_layout_equals_converter(capsys, tmp_path, tiny_preset):
    from splitgemma._native import FgmFile

    out = tmp_path / "r.fgm"
    status, stdout, err = run_cli(capsys, "random-model", "--preset", tiny_preset, str(out), "--seed", "7",
                                  "--no-progress")
    assert status == 0, err
    assert "9,437,248 bytes, 194 tensors" in stdout
    f, ref = FgmFile(str(out)), FgmFile(str(MINI_FGM))
    # Same tensors, shapes, dtypes, offsets and config as fastgemma's conversion of a real checkpoint.
    assert f.layout_signature == ref.layout_signature
    assert json.loads(f.header_json)["config"] == json.loads(ref.header_json)["config"]
    assert f.raw("rope.full_attention.inv_freq").tobytes() == ref.raw("rope.full_attention.inv_freq").tobytes()

    def dec(name):
        i = f.tensor_info(name)
        sdt = np.float16 if f.tensor_info(name + ".scale")["dtype"] == "f16" else np.float32
        return quant.decode(i["dtype"], f.raw(name), f.raw(name + ".scale").view(sdt), *i["shape"])

    for name in ("embed_tokens", "embed_tokens_per_layer", "lm_head", "l0.q_proj", "l4.gate_proj", "l5.down_proj"):
        assert 0.02 <= dec(name).std() <= 0.05, name
    # the int8 twin holds the same weights as its int4 original
    np.testing.assert_allclose(dec("l4.up_proj.i8"), dec("l4.up_proj"), rtol=1e-6, atol=0)
    assert np.frombuffer(f.raw("l1.q_proj"), np.int8).min() == -127
    norms = np.frombuffer(f.raw("l2.input_layernorm"), np.float32)
    assert abs(norms.mean() - 1) < 0.01 and 0 < norms.std() < 0.05


def test_random_model_seeds(tmp_path, tiny_preset):
    cfg = rm.preset_config(tiny_preset)
    a, b, c = (tmp_path / f"{x}.fgm" for x in "abc")
    rm.write_random_model(cfg, a, seed=1, progress=False)
    rm.write_random_model(cfg, b, seed=1, progress=False)
    rm.write_random_model(cfg, c, seed=2, progress=False)
    assert a.read_bytes()[BODY_START:] == b.read_bytes()[BODY_START:]
    assert a.read_bytes()[BODY_START:] != c.read_bytes()[BODY_START:]


@pytest.mark.parametrize("preset,weights,group,size,tensors", [
    # fgm-format §9.4: the published g4e2b-dual.fgm and fastgemma's published int4 sizes
    ("e2b", "dual", 256, 4_340_785_920, 1032),
    ("e2b", "int4", 256, 2_781_000_000, 822),
    ("e2b", "int4", 64, 2_827_000_000, 822),
    ("e2b", "int4", 512, 2_773_000_000, 822),
])
def test_preset_sizes_match_published(preset, weights, group, size, tensors):
    entries = entries_of(build_inventory(rm.preset_config(preset), weights, group))
    total = plan_offsets(entries)
    assert len(entries) == tensors
    if weights == "dual":
        assert total == size
    else:
        assert round(total / 1e9, 3) == size / 1e9


def test_e4b_preset_is_consistent():
    cfg = rm.preset_config("e4b")
    assert cfg.first_shared_layer == 24 and cfg.store_full_length_kv == [22, 23]
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == list(range(5, 42, 6))
    assert cfg.layer_intermediate(41) == 10240 and cfg.layer_head_dim(41) == 512


def test_mini_config_roundtrip_matches_fixture():
    # the presets go through the same parser as a checkpoint's config.json
    assert load_text_config(MINI) == rm.parse_text_config(json.loads((MINI / "config.json").read_text()))
