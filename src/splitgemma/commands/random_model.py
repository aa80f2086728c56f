"""splitgemma random-model: a full-size .fgm with random weights, for benchmarks."""
from __future__ import annotations

import argparse

from splitgemma.commands.convert import add_weight_options


def register(subparsers) -> None:
    from splitgemma.fgm.random_model import PRESETS
    p = subparsers.add_parser(
        "random-model", help="write a full-size .fgm with random weights (benchmarks)",
        description="Write a .fgm with random weights in exactly the layout the converter produces for "
                    "the chosen model (same tensors, shapes, offsets and header config), without any "
                    "checkpoint. Dequantised weights have std ~0.03, norms and layer scalars ~1, RoPE "
                    "tables are the real ones; int8 twins hold the same weights as their int4 originals. "
                    "The e2b preset with --weights dual --group 256 is 4,340,785,920 bytes, like the "
                    "published g4e2b-dual.fgm.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), required=True,
                   help="model shape: e2b = Gemma 4 E2B, e4b = Gemma 4 E4B")
    p.add_argument("out", metavar="OUT.fgm", help="output file (replaced if it exists)")
    p.add_argument("--seed", type=int, default=0, help="random seed; the same seed gives the same file "
                                                       "(default: 0)")
    add_weight_options(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from splitgemma.commands import CommandError
    from splitgemma.fgm.random_model import preset_config, write_random_model

    if args.seed < 0:
        raise CommandError(f"--seed must be non-negative, got {args.seed}")
    r = write_random_model(preset_config(args.preset), args.out, seed=args.seed, weights=args.weights,
                           group=args.group, progress=not args.no_progress, label=args.preset)
    print(f"wrote {r['path']}: {r['bytes']:,} bytes, {r['tensors']} tensors, {r['seconds']:.1f} s")
    return 0
