"""Reading the small files a service loads beside its model (tokenizer.json, chat templates, *config.json).

Only regular files are read. A path that names a FIFO would block open() until some writer appears (forever, at
start-up), and a device or a directory is no configuration file: both get an error naming the path. The file is
opened non-blocking and checked with fstat on the open descriptor, so there is no window between the check and the
read in which the path could be swapped. The .fgm model itself is opened the same way by the native reader
(native/src/fgm_file.cpp).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class NotRegularFile(OSError):
    """The path exists but is not a regular file (a FIFO, a device, a directory, a socket)."""


class FileTooLarge(OSError):
    """The file is larger than the caller's limit (its size in `size`)."""

    def __init__(self, message: str, size: int):
        super().__init__(message)
        self.size = size


def read_regular(path: str | Path, max_bytes: int | None = None) -> bytes:
    """The bytes of the regular file at `path` (symlinks followed), at most `max_bytes` when given; NotRegularFile,
    FileTooLarge or another OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(f"{path} is not a regular file ({_kind(st.st_mode)})")
        if max_bytes is not None and st.st_size > max_bytes:
            raise FileTooLarge(f"{path}: {st.st_size} bytes, more than {max_bytes}", st.st_size)
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read() if max_bytes is None else f.read(max_bytes + 1)
    finally:
        os.close(fd)


def read_regular_text(path: str | Path) -> str:
    """read_regular() decoded as UTF-8 (UnicodeDecodeError, a ValueError, when it is not)."""
    return read_regular(path).decode("utf-8")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"
