"""splitgemma convert: Hugging Face Gemma 4 checkpoint → .fgm."""
from __future__ import annotations

import argparse

WEIGHT_HELP = """FFN weight format: 'dual' = int4 plus int8 twins (decode reads int4, prefill int8;
fastgemma's --weights both), 'int4' = int4 only (smallest file), 'int8' = int8 only"""


def group_size(text: str) -> int:
    """argparse type: the int4 scale group, a positive multiple of 64."""
    try:
        g = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid group {text!r}: not an integer") from None
    if g <= 0 or g % 64:
        raise argparse.ArgumentTypeError(f"invalid group {g}: must be a positive multiple of 64")
    return g


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"invalid value {v}: must be at least 1")
    return v


def add_weight_options(p: argparse.ArgumentParser) -> None:
    """--weights / --group, shared by the commands that write .fgm files."""
    from splitgemma.fgm.inventory import DEFAULT_GROUP, WEIGHT_MODES
    p.add_argument("--weights", choices=WEIGHT_MODES, default="dual", help=WEIGHT_HELP + " (default: dual)")
    p.add_argument("--group", type=group_size, default=DEFAULT_GROUP, metavar="N",
                   help=f"int4 scale group along K for the FFN and LM head: a multiple of 64 dividing every "
                        f"K (default: {DEFAULT_GROUP}; embedding tables always use 64)")
    p.add_argument("--no-progress", action="store_true", help="no progress output on stderr")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", help="convert a Hugging Face Gemma 4 checkpoint to a .fgm file",
        description="Convert a Hugging Face Gemma 4 checkpoint (config.json + safetensors, bf16/f16/f32; "
                    "single file, sharded with model.safetensors.index.json, or several *.safetensors) "
                    "into a .fgm weight file: attention and per-layer-embedding projections int8, FFN and "
                    "LM head int4 (plus int8 twins with --weights dual), embedding tables int4, all linears "
                    "Hadamard-rotated. The output is byte-compatible with fastgemma's converter. Vision and "
                    "audio towers are skipped. Nothing is written at OUT unless the conversion succeeds.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="checkpoint directory (with config.json)")
    p.add_argument("out", metavar="OUT.fgm", help="output file (replaced if it exists)")
    add_weight_options(p)
    p.add_argument("--threads", type=positive_int, metavar="N",
                   help="worker threads (default: the usable CPUs, at most 8); the output is the same")
    p.set_defaults(func=run)


def run(args) -> int:
    from splitgemma.fgm.convert import convert_checkpoint

    r = convert_checkpoint(args.src, args.out, weights=args.weights, group=args.group,
                           progress=not args.no_progress, threads=args.threads)
    print(f"wrote {r['path']}: {r['bytes']:,} bytes, {r['tensors']} tensors, {r['seconds']:.1f} s")
    return 0
