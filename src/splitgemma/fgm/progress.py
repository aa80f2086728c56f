"""Byte progress for long writes: a tqdm bar on a terminal, a few terse lines otherwise."""
from __future__ import annotations

import sys
import time


class _Off:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


class _Terse:
    """When stderr is not a terminal (logs, CI): one line per 10% instead of a redrawn bar."""

    def __init__(self, total: int, desc: str, stream):
        self.total, self.desc, self.stream = max(1, total), desc, stream
        self.done = 0
        self.next_tenth = 1
        self.t0 = time.perf_counter()

    def update(self, n: int) -> None:
        self.done += n
        while self.next_tenth <= 10 and self.done * 10 >= self.next_tenth * self.total:
            print(f"{self.desc}: {self.next_tenth * 10}% ({self.done / 1e9:.2f} of {self.total / 1e9:.2f} GB, "
                  f"{time.perf_counter() - self.t0:.0f} s)", file=self.stream, flush=True)
            self.next_tenth += 1

    def close(self) -> None:
        pass


def stage(desc: str, text: str, enabled: bool = True, stream=None) -> None:
    """One line naming what a long job does before its byte bar starts (reading and checking a checkpoint, building
    a tokenizer can take tens of seconds): progress from the first second."""
    if enabled:
        print(f"{desc}: {text}", file=stream if stream is not None else sys.stderr, flush=True)


def byte_progress(total: int, desc: str, enabled: bool = True, stream=None):
    """An object with update(nbytes) and close()."""
    stream = stream if stream is not None else sys.stderr
    if not enabled:
        return _Off()
    if hasattr(stream, "isatty") and stream.isatty():
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000,
                    file=stream, dynamic_ncols=True, smoothing=0.1)
    return _Terse(total, desc, stream)
