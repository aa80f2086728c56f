"""A small zero-copy safetensors reader (no torch, no safetensors package).

A safetensors file is an 8-byte little-endian header length, a JSON header mapping tensor names to
{dtype, shape, data_offsets} (offsets relative to the end of the header), then the raw data. Files
are memory-mapped and tensors read as numpy views of the mapping, widened to float32 on request.

A checkpoint is a directory holding either one ``model.safetensors``, a sharded set described by
``model.safetensors.index.json``, or any number of ``*.safetensors`` files; a single .safetensors
file path is accepted too.

Reading a 10 GB checkpoint through a mapping would leave every touched page resident (RSS); callers
that stream a large tensor call :meth:`Checkpoint.release` on what they have consumed, which drops
those pages from this process (the page cache keeps them for the OS to manage).
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ConversionError

# readable safetensors dtypes → bytes per element (all are widened to float32 on read)
READABLE_DTYPES = {
    "BF16": 2,
    "F16": 2,
    "F32": 4,
}
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors spec's own limit
_PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class TensorRef:
    name: str
    dtype: str            # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    file: Path
    start: int            # absolute byte offset of the data in the file
    nbytes: int


class _MappedFile:
    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "rb")
        size = os.fstat(self._f.fileno()).st_size
        self.mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def release(self, start: int, stop: int) -> None:
        if self.mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        a = start // _PAGE * _PAGE
        b = min(len(self.mm), -(-stop // _PAGE) * _PAGE)
        if b > a:
            self.mm.madvise(mmap.MADV_DONTNEED, a, b - a)

    def close(self) -> None:
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                # A caller still holds a view; the mapping goes away with it.
                pass
        self._f.close()


def _read_header(path: Path) -> tuple[dict, int]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConversionError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (hlen,) = struct.unpack("<Q", head)
            if hlen == 0 or hlen > _MAX_HEADER or 8 + hlen > size:
                raise ConversionError(f"{path}: not a safetensors file (header length {hlen} is impossible "
                                      f"for a {size}-byte file)")
            raw = f.read(hlen)
    except OSError as e:
        raise ConversionError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise ConversionError(f"{path}: safetensors header is not a JSON object")
    return header, 8 + hlen


def _checkpoint_files(src: Path) -> list[Path]:
    if src.is_file():
        return [src]
    if not src.is_dir():
        raise ConversionError(f"{src}: no such checkpoint directory or file")
    index = src / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConversionError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from None
        files = [src / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ConversionError(f"{index} lists shard files that do not exist", missing)
        return files
    single = src / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ConversionError(f"{src}: no model.safetensors, model.safetensors.index.json or *.safetensors files")
    return files


class Checkpoint:
    """All tensors of a (possibly sharded) safetensors checkpoint, by name."""

    def __init__(self, src: str | os.PathLike):
        self.src = Path(src)
        self.files = _checkpoint_files(self.src)
        self.tensors: dict[str, TensorRef] = {}
        self._maps: dict[Path, _MappedFile] = {}
        problems: list[str] = []
        for path in self.files:
            header, data_start = _read_header(path)
            size = path.stat().st_size
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                ref = self._parse_entry(path, name, entry, data_start, size, problems)
                if ref is None:
                    continue
                if name in self.tensors:
                    problems.append(f"{name}: present in both {self.tensors[name].file.name} and {path.name}")
                    continue
                self.tensors[name] = ref
        if problems:
            raise ConversionError(f"{self.src}: malformed safetensors checkpoint", problems)

    @staticmethod
    def _parse_entry(path, name, entry, data_start, size, problems) -> TensorRef | None:
        try:
            dtype = entry["dtype"]
            shape = tuple(int(d) for d in entry["shape"])
            a, b = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            problems.append(f"{path.name}: entry '{name}' lacks dtype/shape/data_offsets")
            return None
        if any(d < 0 for d in shape) or not 0 <= a <= b or data_start + b > size:
            problems.append(f"{path.name}: '{name}' has data_offsets [{a}, {b}) outside the file")
            return None
        itemsize = READABLE_DTYPES.get(dtype)
        if itemsize is not None and (b - a) != itemsize * int(np.prod(shape, dtype=np.int64)):
            problems.append(f"{path.name}: '{name}' is {b - a} bytes, but {dtype} {list(shape)} needs "
                            f"{itemsize * int(np.prod(shape, dtype=np.int64))}")
            return None
        return TensorRef(name, dtype, shape, path, data_start + a, b - a)

    # -- access ----------------------------------------------------------------------------------

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> TensorRef:
        return self.tensors[name]

    def _map(self, path: Path) -> _MappedFile:
        m = self._maps.get(path)
        if m is None:
            m = self._maps[path] = _MappedFile(path)
        return m

    def _check_readable(self, ref: TensorRef) -> int:
        itemsize = READABLE_DTYPES.get(ref.dtype)
        if itemsize is None:
            raise ConversionError(f"{ref.name}: unsupported safetensors dtype {ref.dtype} "
                                  f"(supported: {', '.join(READABLE_DTYPES)})")
        return itemsize

    def rows(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) of a tensor (along its first dimension) as a new float32 array."""
        ref = self.tensors[name]
        itemsize = self._check_readable(ref)
        shape = ref.shape if ref.shape else (1,)
        stop = shape[0] if stop is None else stop
        row_elems = int(np.prod(shape[1:], dtype=np.int64))
        count = (stop - start) * row_elems
        offset = ref.start + start * row_elems * itemsize
        mm = self._map(ref.file).mm
        out_shape = (stop - start,) + tuple(shape[1:])
        if count == 0:
            return np.zeros(out_shape, dtype=np.float32)
        if ref.dtype == "BF16":
            # bf16 is the top half of a float32: widening is exact.
            out = np.frombuffer(mm, dtype="<u2", count=count, offset=offset).astype(np.uint32)
            out <<= 16
            out = out.view(np.float32)
        elif ref.dtype == "F16":
            out = np.frombuffer(mm, dtype="<f2", count=count, offset=offset).astype(np.float32)
        else:
            out = np.frombuffer(mm, dtype="<f4", count=count, offset=offset).astype(np.float32)
        return out.reshape(out_shape)

    def release(self, name: str, start: int = 0, stop: int | None = None) -> None:
        """Drop this process's mapped pages of rows [start, stop) of a tensor (they were read)."""
        ref = self.tensors[name]
        itemsize = READABLE_DTYPES.get(ref.dtype, 1)
        shape = ref.shape if ref.shape else (1,)
        stop = shape[0] if stop is None else stop
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * itemsize
        self._map(ref.file).release(ref.start + start * row_bytes, ref.start + stop * row_bytes)

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
