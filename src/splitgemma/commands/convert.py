"""splitgemma convert: Hugging Face Gemma 4 / Gemma 3 checkpoint, or Gemma 3 GGUF → .fgm."""
from __future__ import annotations

import argparse

from splitgemma.commands import thread_count

WEIGHT_HELP = """weight format: 'dual' = FFN int4 plus int8 twins (decode reads int4, prefill int8;
fastgemma's --weights both), 'int4' = FFN int4 only (smallest file), 'int8' = FFN int8 only, 'int8g' = every
linear, the LM head and the embedding int8 with one scale per row and group of --group inputs, unrotated, run with
float activations (a GGUF's Q8_0/Q5_0/Q4_0/Q6_K values kept exactly)"""


def group_size(text: str) -> int:
    """argparse type: a scale group, a positive integer (which ones fit depends on --weights and the model; the
    converter names every K it does not divide)."""
    try:
        g = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid group {text!r}: not an integer") from None
    if g <= 0:
        raise argparse.ArgumentTypeError(f"invalid group {g}: must be a positive integer")
    return g



def add_weight_options(p: argparse.ArgumentParser, per_source: bool = False) -> None:
    """--weights / --group, shared by the commands that write .fgm files. per_source: the defaults depend on
    the input (convert: a GGUF gets int8g, and an int4 group that fits its K)."""
    from splitgemma.fgm.inventory import DEFAULT_GROUP, DEFAULT_Q8G_GROUP, WEIGHT_MODES
    group_help = (f"scale group along K. int4 (FFN and LM head of dual/int4, an int4 LM head of int8): a multiple "
                  f"of 64 dividing every K, default {DEFAULT_GROUP}{{fit}}; embedding tables always use 64. int8g: "
                  f"any positive divisor of every K, default {DEFAULT_Q8G_GROUP}{{gguf}}")
    if per_source:
        p.add_argument("--weights", choices=WEIGHT_MODES, default=None,
                       help=WEIGHT_HELP + " (default: dual for a checkpoint, int8g for a GGUF)")
        p.add_argument("--group", type=group_size, default=None, metavar="N",
                       help=group_help.format(fit=" or the largest multiple of 64 below it that divides every K "
                                                  "(128 for K = 640)",
                                              gguf="; a GGUF tensor takes gcd(N, its block type's sub-block: 16 "
                                                   "for Q6_K/Q3_K/Q2_K, else 32)"))
        p.add_argument("--emb-bits", type=int, choices=(4, 8), default=None,
                       help="token embedding table and tied LM head with --weights dual/int4/int8: 4 = q4r table + "
                            "q4g head, 8 = q8r table + q8c head (default: 4 for a checkpoint, 8 for a GGUF; int8g "
                            "stores both q8g)")
    else:
        p.add_argument("--weights", choices=WEIGHT_MODES, default="dual", help=WEIGHT_HELP + " (default: dual)")
        p.add_argument("--group", type=group_size, default=None, metavar="N",
                       help=group_help.format(fit="", gguf=""))
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
                    "and stored --weights int8g: int8 with one scale per row and group of 32 inputs (16 for "
                    "Q6_K/Q3_K/Q2_K), which holds Q8_0/Q5_0/Q4_0/Q6_K blocks exactly (an int8g file also asks the "
                    "engine for an f16 K/V cache); its vocabulary is written beside OUT as OUT's name with "
                    ".tokenizer.json (and its chat template, if it has one, as .chat_template.jinja), where the "
                    "services look for them.\n\n"
                    "Nothing is written at OUT unless the conversion succeeds.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="checkpoint directory (with config.json), or a .gguf file")
    p.add_argument("out", metavar="OUT.fgm", help="output file (replaced if it exists)")
    add_weight_options(p, per_source=True)
    p.add_argument("--threads", type=thread_count, metavar="N",
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
