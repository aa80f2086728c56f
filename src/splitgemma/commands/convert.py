"""splitgemma convert: Hugging Face Gemma 4 / Gemma 3 checkpoint, or Gemma 3 GGUF → .fgm."""
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


def add_weight_options(p: argparse.ArgumentParser, per_source: bool = False) -> None:
    """--weights / --group, shared by the commands that write .fgm files. per_source: the defaults depend on
    the input (convert: a GGUF gets int8, and a group that fits its K)."""
    from splitgemma.fgm.inventory import DEFAULT_GROUP, WEIGHT_MODES
    if per_source:
        p.add_argument("--weights", choices=WEIGHT_MODES, default=None,
                       help=WEIGHT_HELP + " (default: dual for a checkpoint, int8 for a GGUF)")
        p.add_argument("--group", type=group_size, default=None, metavar="N",
                       help=f"int4 scale group along K for the FFN and LM head: a multiple of 64 dividing every "
                            f"K (default: {DEFAULT_GROUP}, or the largest multiple of 64 below it that divides "
                            f"every K, e.g. 128 for K = 640; embedding tables always use 64)")
        p.add_argument("--emb-bits", type=int, choices=(4, 8), default=None,
                       help="token embedding table and tied LM head: 4 = q4r table + q4g head, 8 = q8r table + "
                            "q8c head (default: 4 for a checkpoint, 8 for a GGUF)")
    else:
        p.add_argument("--weights", choices=WEIGHT_MODES, default="dual", help=WEIGHT_HELP + " (default: dual)")
        p.add_argument("--group", type=group_size, default=DEFAULT_GROUP, metavar="N",
                       help=f"int4 scale group along K for the FFN and LM head: a multiple of 64 dividing every "
                            f"K (default: {DEFAULT_GROUP}; embedding tables always use 64)")
    p.add_argument("--no-progress", action="store_true", help="no progress output on stderr")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", help="convert a Hugging Face Gemma 4 / Gemma 3 checkpoint or a Gemma 3 GGUF to a .fgm file",
        description="Convert a Hugging Face Gemma 4 or Gemma 3 checkpoint (config.json + safetensors, "
                    "bf16/f16/f32; single file, sharded with model.safetensors.index.json, or several "
                    "*.safetensors) into a .fgm weight file: attention and per-layer-embedding projections "
                    "int8, FFN and LM head int4 (plus int8 twins with --weights dual), embedding tables int4, "
                    "all linears Hadamard-rotated. For Gemma 4 the output is byte-compatible with fastgemma's "
                    "converter. Vision and audio towers are skipped.\n\n"
                    "A GGUF file (llama.cpp's format, architecture gemma3, any GGML quantisation) is dequantised "
                    "and stored int8 (FFN, attention, embedding and LM head); its vocabulary is written beside "
                    "OUT as OUT's name with .tokenizer.json (and its chat template, if it has one, as "
                    ".chat_template.jinja), where the services look for them.\n\n"
                    "Nothing is written at OUT unless the conversion succeeds.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="checkpoint directory (with config.json), or a .gguf file")
    p.add_argument("out", metavar="OUT.fgm", help="output file (replaced if it exists)")
    add_weight_options(p, per_source=True)
    p.add_argument("--threads", type=positive_int, metavar="N",
                   help="worker threads (default: the usable CPUs, at most 8); the output is the same")
    p.set_defaults(func=run)


def run(args) -> int:
    from splitgemma.fgm.convert import convert_checkpoint

    r = convert_checkpoint(args.src, args.out, weights=args.weights, group=args.group, emb_bits=args.emb_bits,
                           progress=not args.no_progress, threads=args.threads)
    print(f"wrote {r['path']}: {r['bytes']:,} bytes, {r['tensors']} tensors, {r['seconds']:.1f} s")
    for what in ("tokenizer", "chat_template"):
        if r.get(what):
            print(f"wrote {r[what]}")
    return 0
