"""The subcommands of the ``splitgemma`` CLI, one module each.

A command module defines ``register(subparsers)``, which adds its parser and sets ``func`` (called
with the parsed arguments; returns the exit status or None). Expected failures raise
:class:`CommandError` (or another error listed in ``splitgemma.cli``) and are printed as
``splitgemma: error: …`` without a traceback. Slow imports (the native core, services)
belong inside ``func`` so that ``splitgemma --help`` stays quick.
"""


class CommandError(Exception):
    """An expected failure of a command (bad input, missing file, …): message only, exit status 1."""


def add_kv_dtype_option(p) -> None:
    """--kv-dtype, shared by every command that opens the engine (prefill and decode workers must agree)."""
    p.add_argument("--kv-dtype", choices=("int8", "f16"), default=None,
                   help="K/V cache element type: int8 (a scale per position, half the memory) or f16 (no "
                        "quantisation error) (default: what the model file asks for, else int8; q8g files ask for "
                        "f16)")
