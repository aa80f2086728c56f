"""``splitgemma``: the command line. Each subcommand lives in its own module under
splitgemma/commands/ and is plugged in by one line in COMMANDS."""
from __future__ import annotations

import argparse
import os
import sys

from splitgemma import __version__
from splitgemma.commands import CommandError
from splitgemma.commands import convert, inspect, random_model
from splitgemma.commands import generate, score, bench
from splitgemma.commands import decode
from splitgemma.commands import prefill
from splitgemma.commands import gateway
from splitgemma.commands import up

COMMANDS = (
    convert,
    inspect,
    random_model,
    generate, score, bench,
    prefill,
    decode,
    gateway,
    up,
)

DESCRIPTION = """\
splitgemma serves Gemma 3 and Gemma 4 text models on CPUs from FASTGEM1 (.fgm) weight files:
int8/int4 weights, Hadamard-rotated, in the tile order of the AMX/VNNI/AVX2 kernels.

Typical start:
  splitgemma up                                      # serve Gemma 3 270M (fetched and converted on first use)
                                                     # at http://127.0.0.1:8000/v1, OpenAI's API
  splitgemma up --model model.fgm                    # serve your own .fgm
  splitgemma convert ./gemma-4-E2B-it model.fgm      # Hugging Face checkpoint -> .fgm
  splitgemma inspect model.fgm                       # what is in the file
  splitgemma random-model --preset e2b bench.fgm     # full-size random weights, for benchmarks
"""


class _Parser(argparse.ArgumentParser):
    """argparse with the house error format: usage, then 'splitgemma: error: …', exit status 2."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, f"splitgemma: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="splitgemma", description=DESCRIPTION,
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     epilog="Run 'splitgemma COMMAND --help' for the options of one command.")
    parser.add_argument("--version", action="version", version=f"splitgemma {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands", parser_class=_Parser)
    sub.required = True
    for module in COMMANDS:
        module.register(sub)
    return parser


def _expected_errors() -> tuple[type[BaseException], ...]:
    from splitgemma.fgm.errors import ConversionError
    from splitgemma.serving.credentials import CredentialError
    errors: list[type[BaseException]] = [CommandError, ConversionError, CredentialError, OSError]
    try:
        from splitgemma._native import FgmError
        errors.append(FgmError)
    except ImportError:  # the native core is not built: commands that need it say so themselves
        pass
    return tuple(errors)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = args.func(args)
    except BrokenPipeError:
        # The reader went away (e.g. `splitgemma inspect f.fgm | head`): not an error worth a message.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print("splitgemma: interrupted", file=sys.stderr)
        return 130
    except _expected_errors() as e:
        print(f"splitgemma: error: {e}", file=sys.stderr)
        return 1
    return 0 if status is None else int(status)


if __name__ == "__main__":
    sys.exit(main())
