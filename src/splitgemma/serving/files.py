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


def read_regular(path: str | Path) -> bytes:
    """The bytes of the regular file at `path` (symlinks followed); NotRegularFile or another OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(f"{path} is not a regular file ({_kind(mode)})")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
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
