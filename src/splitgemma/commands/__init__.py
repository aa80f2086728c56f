"""The subcommands of the ``splitgemma`` CLI, one module each.

A command module defines ``register(subparsers)``, which adds its parser and sets ``func`` (called
with the parsed arguments; returns the exit status or None). Expected failures raise
:class:`CommandError` (or another error listed in ``splitgemma.cli``) and are printed as
``splitgemma: error: …`` without a traceback. Slow imports (the native core, services)
belong inside ``func`` so that ``splitgemma --help`` stays quick.
"""


class CommandError(Exception):
    """An expected failure of a command (bad input, missing file, …): message only, exit status 1."""
