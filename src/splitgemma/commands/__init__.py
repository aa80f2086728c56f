"""The subcommands of the ``splitgemma`` CLI, one module each.

A command module defines ``register(subparsers)``, which adds its parser and sets ``func`` (called
with the parsed arguments; returns the exit status or None). Expected failures raise
:class:`CommandError` (or another error listed in ``splitgemma.cli``) and are printed as
``splitgemma: error: …`` without a traceback. Slow imports (the native core, services)
belong inside ``func`` so that ``splitgemma --help`` stays quick.
"""

import argparse


class CommandError(Exception):
    """An expected failure of a command (bad input, missing file, …): message only, exit status 1."""


def add_kv_dtype_option(p) -> None:
    """--kv-dtype, shared by every command that opens the engine (prefill and decode workers must agree)."""
    p.add_argument("--kv-dtype", choices=("int8", "f16"), default=None,
                   help="K/V cache element type: int8 (a scale per position, half the memory) or f16 (no "
                        "quantisation error) (default: what the model file asks for, else int8; q8g files ask for "
                        "f16)")


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1 (counts, sizes, threads)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"invalid value {v}: must be at least 1")
    return v


def non_negative_int(text: str) -> int:
    """argparse type: an integer of at least 0 (limits where 0 switches something off)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"invalid value {v}: must be at least 0")
    return v


def positive_float(text: str) -> float:
    """argparse type: a number above 0 (durations)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: not a number") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"invalid value {text}: must be positive")
    return v


_BYTE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def byte_count(text: str) -> int:
    """argparse type: a size in bytes, >= 0, with an optional binary unit: 1073741824, 512M, 1G (K/M/G/T = 2**10…)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _BYTE_UNITS else ""
    try:
        v = int(t[: len(t) - len(unit)]) * _BYTE_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: an integer number of bytes, optionally with "
                                         "K, M, G or T") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: must be >= 0")
    return v
