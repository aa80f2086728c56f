"""splitgemma inspect: what a .fgm file holds (config, tensors, sizes), via the validated native reader."""
from __future__ import annotations

import argparse
import json

_QUANTISED_LINEAR = ("q4g", "q8c")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "inspect", help="show the config and tensor table of a .fgm file",
        description="Open a .fgm file with the native reader (which validates the container, every tensor "
                    "entry and the inventory against the config; a bad file is reported precisely) and "
                    "print its model config, conversion meta, one line per tensor (name, dtype, shape, "
                    "bytes, Hadamard block, int4 group) and the totals per dtype.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", metavar="FILE.fgm", help="the .fgm file")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.set_defaults(func=run)


def describe(path: str) -> dict:
    """Everything inspect shows, as plain data (also the --json output)."""
    from splitgemma._native import FgmFile

    f = FgmFile(path)
    header = json.loads(f.header_json)
    tensors = []
    totals: dict[str, dict] = {}
    for name in f.tensor_names:
        info = f.tensor_info(name)
        t = {"name": name, "dtype": info["dtype"], "shape": list(info["shape"]), "offset": info["offset"],
             "nbytes": info["nbytes"]}
        if info["dtype"] in _QUANTISED_LINEAR:
            t["hadamard"] = info["hadamard"]
            t["group"] = info["group"]
        elif info["dtype"] in ("q4r", "q8r"):
            t["group"] = 64 if info["dtype"] == "q4r" else 0
        tensors.append(t)
        tot = totals.setdefault(info["dtype"], {"tensors": 0, "bytes": 0})
        tot["tensors"] += 1
        tot["bytes"] += info["nbytes"]
    payload = sum(t["nbytes"] for t in tensors)
    return {
        "path": path,
        "file_size": f.file_size,
        "layout_signature": f"{f.layout_signature:016x}",
        "arch": header.get("arch"),
        "config": header.get("config", {}),
        "meta": header.get("meta", {}),
        "tensors": tensors,
        "totals": dict(sorted(totals.items(), key=lambda kv: -kv[1]["bytes"])),
        "tensor_bytes": payload,
    }


def _layer_types(types: list) -> str:
    letters = "".join("F" if t == "full_attention" else "s" for t in types)
    return f"{letters} ({letters.count('s')} sliding, {letters.count('F')} full)"


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def render(d: dict) -> str:
    out = [f"{d['path']}: {d['file_size']:,} bytes, {len(d['tensors'])} tensors, "
           f"layout signature {d['layout_signature']}", "", "config"]
    cfg = dict(d["config"])
    rows = []
    for k, v in cfg.items():
        text = _layer_types(v) if k == "layer_types" else json.dumps(v) if isinstance(v, (dict, list, bool)) or v is None \
            else str(v)
        rows.append([k, text])
    out += _table(rows, set()) if rows else ["  (empty)"]
    meta = d["meta"]
    if meta:
        out += ["", "meta"]
        out += _table([[k, json.dumps(v) if isinstance(v, (dict, list)) else str(v)] for k, v in meta.items()], set())
    out += ["", "tensors"]
    rows = [["name", "dtype", "shape", "bytes", "hadamard", "group"]]
    for t in d["tensors"]:
        rows.append([t["name"], t["dtype"], "[" + ", ".join(map(str, t["shape"])) + "]", f"{t['nbytes']:,}",
                     str(t["hadamard"]) if "hadamard" in t else "-", str(t["group"]) if t.get("group") else "-"])
    out += _table(rows, {3})
    out += ["", "totals"]
    total = d["tensor_bytes"] or 1
    rows = [["dtype", "tensors", "bytes", "share"]]
    for dt, tot in d["totals"].items():
        rows.append([dt, str(tot["tensors"]), f"{tot['bytes']:,}", f"{100 * tot['bytes'] / total:.1f}%"])
    rows.append(["all", str(len(d["tensors"])), f"{d['tensor_bytes']:,}", "100.0%"])
    out += _table(rows, {1, 2, 3})
    out.append(f"  header and alignment padding: {d['file_size'] - d['tensor_bytes']:,} bytes")
    return "\n".join(out)


def run(args) -> int:
    d = describe(args.file)
    print(json.dumps(d, indent=1) if args.json else render(d))
    return 0
