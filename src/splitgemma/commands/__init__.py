"""The subcommands of the ``splitgemma`` CLI, one module each.

A command module defines ``register(subparsers)``, which adds its parser and sets ``func`` (called
with the parsed arguments; returns the exit status or None). Expected failures raise
:class:`CommandError` (or another error listed in ``splitgemma.cli``) and are printed as
``splitgemma: error: …`` without a traceback. Slow imports (the native core, services)
belong inside ``func`` so that ``splitgemma --help`` stays quick.
"""

import argparse
import math
import re

# Integer options end up as C++ ints in the native core, int32/uint32 proto fields or buffer sizes: every one has
# an upper bound, so that a typo (--max-context 2147483648) is an argparse error rather than a traceback or an
# allocation of the machine's memory.
INT_MAX = (1 << 31) - 1
MAX_CONTEXT = 1 << 20    # positions per KV slot (Gemma 4 E2B was trained for 128 Ki)
MAX_THREADS = 4096


class CommandError(Exception):
    """An expected failure of a command (bad input, missing file, …): message only, exit status 1."""


def add_kv_dtype_option(p) -> None:
    """--kv-dtype, shared by every command that opens the engine (prefill and decode workers must agree)."""
    p.add_argument("--kv-dtype", choices=("int8", "f16", "f32"), default=None,
                   help="K/V cache element type: int8 (a scale per position, half the memory), f16 (no "
                        "quantisation error) or f32 (the forward pass's own values, twice f16's memory: for fidelity "
                        "checks) (default: what the model file asks for, else int8; q8g files ask for f16)")


def add_q8g_input_option(p) -> None:
    """--q8g-input, shared by every command that opens the engine (workers may differ: it changes no layout)."""
    p.add_argument("--q8g-input", choices=("int8", "f32"), default=None,
                   help="activations of the q8g GEMMs (GGUF models such as the default): int8, quantised per 32 "
                        "inputs (the int8 multiply rate; llama.cpp's fidelity), or f32 (weight-only: float32 "
                        "fidelity to the GGUF, at the f32 FMA rate) (default: FGM_Q8G_INPUT, else int8)")


def add_log_level_option(p) -> None:
    """--log-level, of every serving command (`up` passes it on to its three processes)."""
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="least severe log records written (JSON lines on stderr) (default: INFO)")


def add_drain_option(p, type_=None) -> None:
    """--drain-timeout (args.drain_timeout), one name for the gateway, the workers and `up`; --drain-seconds, the
    workers' old name, is still read (hidden, deprecated)."""
    type_ = type_ or non_negative_float
    p.add_argument("--drain-timeout", type=type_, default=30.0, metavar="S",
                   help="on SIGTERM, how long the work in flight may take to finish before it is cancelled "
                        "(default: 30)")
    p.add_argument("--drain-seconds", dest="drain_timeout", type=type_, help=argparse.SUPPRESS)


def _int_in(text: str, minimum: int, maximum: int) -> int:
    if len(text) > 40 and text.strip().lstrip("+-").isdigit():
        # int() of a few thousand digits raises its own ValueError (sys.int_info); no option takes one that long.
        raise argparse.ArgumentTypeError(f"invalid value {text[:20]}… ({len(text)} characters): must lie in "
                                         f"[{minimum}, {maximum}]")
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text[:40]!r}: not an integer") from None
    if v < minimum:
        raise argparse.ArgumentTypeError(f"invalid value {v}: must be at least {minimum}")
    if v > maximum:
        raise argparse.ArgumentTypeError(f"invalid value {v}: must be at most {maximum}")
    return v


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1 (counts, sizes), at most INT_MAX."""
    return _int_in(text, 1, INT_MAX)


def non_negative_int(text: str) -> int:
    """argparse type: an integer of at least 0 (limits where 0 switches something off), at most INT_MAX."""
    return _int_in(text, 0, INT_MAX)


def context_length(text: str) -> int:
    """argparse type: positions per KV slot (or a prefill chunk), 1..MAX_CONTEXT."""
    return _int_in(text, 1, MAX_CONTEXT)


def thread_count(text: str) -> int:
    """argparse type: compute threads, 1..MAX_THREADS."""
    return _int_in(text, 1, MAX_THREADS)


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0..65535 (0 = any free port)."""
    return _int_in(text, 0, 65535)


def positive_float(text: str) -> float:
    """argparse type: a finite number above 0 (durations)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text[:40]!r}: not a number") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"invalid value {text}: must be a positive (finite) number")
    return v


def non_negative_float(text: str) -> float:
    """argparse type: a finite number of at least 0 (durations where 0 means at once)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text[:40]!r}: not a number") from None
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"invalid value {text}: must be a finite number >= 0")
    return v


_SIZE = re.compile(r"(-?\d[\d_]*)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def _size(text: str, minimum: int) -> int:
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: an integer number of bytes, or a whole number with "
                                         "k, m, g or t (powers of 1024, as docker writes them: 512m, 8g, 8GiB)")
    v = int(m.group(1).replace("_", "")) * _SIZE_UNITS[m.group(2).lower()]
    if v < minimum:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: must be "
                                         + (">= 0" if minimum == 0 else f"at least {minimum} byte"))
    return v


def byte_count(text: str) -> int:
    """argparse type: a size in bytes, >= 0 (0 turns a cache off), with an optional binary unit: 512M, 1G."""
    return _size(text, 0)


def byte_size(text: str) -> int:
    """argparse type: a size of at least 1 byte, with an optional binary unit: 512m, 8g."""
    return _size(text, 1)
