"""``fedpose data synth | convert | split``: the synthetic ward, real datasets to fedpose's layout, and splits.

Registered by ``fedpose.cli.main``; handlers import what they need inside.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fedpose.cli.common import add_common


def cmd_data_synth(args: argparse.Namespace) -> int:
    from fedpose.shared.data.synth.ward import WardSpec, generate_ward

    spec = WardSpec(
        sites=args.sites, per_site=args.per_site, public=args.public, val=args.val, seed=args.seed,
        image_size=args.image_size,
    )
    root = generate_ward(Path(args.out), spec, progress=not args.quiet)
    print(f"synthetic ward written to {root}: public={args.public}, val={args.val}, "
          f"{args.sites} sites x {args.per_site} (MPII json layout)")
    return 0


def cmd_data_convert(args: argparse.Namespace) -> int:
    from fedpose.shared.data.convert import convert

    out = convert(args.format, args.annotations, args.images, args.out, headboxes=args.headboxes, copy=args.copy)
    if (out / "headboxes.json").is_file():
        print(f"wrote {out} (MPII json layout): point data.root at its parent folder and name it in "
              "data.train_splits, data.public_split or data.val_split")
        return 0
    print(f"wrote {out} (MPII json layout): point data.root at its parent folder and name it in data.train_splits "
          "or data.public_split")
    fix = ("convert it again with --headboxes (MPII's valid.json: the official mpii_gt_val.mat)"
           if args.format == "mpii-json" else "take the validation split from MPII-layout data with head boxes")
    print(f"warning: {out} has no head boxes, so PCKh cannot score it and it cannot be a data.val_split: {fix}",
          file=sys.stderr)
    return 0


def cmd_data_split(args: argparse.Namespace) -> int:
    from fedpose.shared.data.convert import split_dataset

    counts = split_dataset(args.input, args.out, sites=args.sites, public=args.public, val=args.val, seed=args.seed,
                           copy=args.copy)
    if args.json:
        print(json.dumps(counts))
    else:
        print(f"wrote {', '.join(f'{k} ({v} records)' for k, v in counts.items())} under {args.out}")
    return 0


def register(sub: Any) -> None:
    from fedpose.shared.data.convert import FORMATS

    data = sub.add_parser("data", help="datasets: the synthetic ward, real datasets to the layout, splits"
                          ).add_subparsers(dest="data_command", required=True)
    synth = data.add_parser("synth", help="generate the synthetic ward (MPII json layout)")
    synth.add_argument("--out", required=True, help="a new folder for the ward")
    synth.add_argument("--sites", type=int, default=3,
                       help="hospital sites, each with its own camera style (default 3)")
    synth.add_argument("--per-site", type=int, default=400, help="images per site (default 400)")
    synth.add_argument("--public", type=int, default=600, help="images of the public split (default 600)")
    synth.add_argument("--val", type=int, default=240, help="images of the validation split (default 240)")
    synth.add_argument("--seed", type=int, default=0, help="the ward is a function of this seed (default 0)")
    synth.add_argument("--image-size", type=int, default=128, help="image side in px (default 128)")
    add_common(synth, config=False)
    synth.set_defaults(func=cmd_data_synth)

    conv = data.add_parser("convert", help="a real dataset (MPII as mmpose's json, COCO keypoints, AFLW's face "
                                           "database) to one split folder in the MPII json layout")
    conv.add_argument("--format", required=True, choices=FORMATS, help="the input's format")
    conv.add_argument("--annotations", required=True, help="mmpose's train.json / valid.json, COCO's "
                                                          "person_keypoints_*.json, or AFLW's aflw.sqlite")
    conv.add_argument("--images", required=True, help="the folder the annotations' image names are relative to")
    conv.add_argument("--out", required=True, help="the split folder to write (e.g. data/mpii/val)")
    conv.add_argument("--headboxes", default=None, help="MPII: head boxes for PCKh (the official mpii_gt_val.mat, "
                                                        "aligned with valid.json, or a headboxes.json)")
    conv.add_argument("--copy", action="store_true",
                      help="copy the images (default: hard links, copies across file systems)")
    add_common(conv, config=False)
    conv.set_defaults(func=cmd_data_convert)

    spl = data.add_parser("split", help="cut one split folder into sites, public and val (by patient when the data "
                                        "has patient ids, else by image)")
    spl.add_argument("--in", dest="input", required=True, help="the split folder to cut")
    spl.add_argument("--out", required=True, help="the data root to write site-0.., public and val under")
    spl.add_argument("--sites", type=int, required=True, help="number of sites")
    spl.add_argument("--public", type=float, default=0.2, help="share of patients (or images) for public (default 0.2)")
    spl.add_argument("--val", type=float, default=0.1, help="share for the validation split (default 0.1)")
    spl.add_argument("--seed", type=int, default=0, help="the cut is a function of this seed (default 0)")
    spl.add_argument("--copy", action="store_true",
                     help="copy the images (default: hard links, copies across file systems)")
    spl.add_argument("--json", action="store_true", help="print the records per split as JSON")
    add_common(spl, config=False)
    spl.set_defaults(func=cmd_data_split)
