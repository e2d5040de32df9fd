"""From a real dataset to fedpose's layout: ``fedpose data convert`` and ``fedpose data split``.

``convert`` reads MPII as mmpose / HRNet distribute it (``train.json`` / ``valid.json``, with the official
``mpii_gt_val.mat`` for the validation head boxes), COCO keypoints (mapped to the 16 MPII joints, see
``fedpose.shared.data.coco``) or AFLW's face database (face labels, ``fedpose.shared.data.aflw``) and writes one split
folder in the MPII json layout every fedpose command reads.
``split`` cuts one such folder into sites, a public split and a validation split: by patient when the
data carries patient ids (``patients.json``), else by image, so that a person or an image is never on two
sides (every record of one image goes to the same split).

Images are hard-linked by default (copied when the output is on another file system), ``copy=True``
copies them; either way the annotations name them relative to the split's ``images/`` folder.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedpose.shared.data.face import FACES_FILE, read_faces, write_faces
from fedpose.shared.data.mpii import box_to_json, load_mpii, load_split

log = logging.getLogger(__name__)

FORMATS = ("mpii-json", "coco", "aflw")


def _place_image(src: Path, dst: Path, *, copy: bool) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists() or dst.is_symlink():
        return
    if not copy:
        try:
            os.link(src.resolve(), dst)  # a hard link: no copy, and the file lies inside images/ (the reader
            return                       # refuses symbolic links that lead out of a split's images folder)
        except OSError:
            pass  # another file system: copy
    shutil.copy2(src, dst)


def write_split(records: Sequence, out: str | Path, *, copy: bool = False, attributes: Sequence[str] = ()) -> Path:
    """Write ``records`` as a split folder (annotations.json, images/, headboxes.json and patients.json when
    every record has one, faces.json when any has face labels, with the attribute names ``attributes``);
    refuses a folder that already holds annotations."""
    out = Path(out)
    if (out / "annotations.json").exists():
        raise FileExistsError(f"{out} already holds a split (annotations.json): choose a new folder")
    if not records:
        raise ValueError(f"nothing to write to {out}: no records")
    images = out / "images"
    names: dict[Path, str] = {}
    used: set[str] = set()
    annotations, headboxes, patients = [], [], []
    for record in records:
        if record.image not in names:
            stem = record.image.name
            name = stem if stem not in used else f"{len(names):06d}_{stem}"
            names[record.image] = name
            used.add(name)
            _place_image(record.image, images / name, copy=copy)
        center, scale = box_to_json(record.center, record.scale)
        joints = np.where(record.visible[:, None], record.joints + 1.0, -1.0)  # 1-based, as MPII
        annotations.append({"image": names[record.image], "center": [round(c, 4) for c in center],
                            "scale": round(scale, 6),
                            "joints": [[round(float(x), 4), round(float(y), 4)] for x, y in joints],
                            "joints_vis": [int(v) for v in record.visible]})
        headboxes.append(None if record.headbox is None else
                         [[round(float(v) + 1.0, 4) for v in corner] for corner in record.headbox])
        patients.append(record.patient)
    out.mkdir(parents=True, exist_ok=True)
    (out / "annotations.json").write_text(json.dumps(annotations))
    if all(h is not None for h in headboxes):
        (out / "headboxes.json").write_text(json.dumps(headboxes))
    if all(p is not None for p in patients):
        (out / "patients.json").write_text(json.dumps(patients))
    if any(r.face is not None for r in records):
        write_faces(out / FACES_FILE, [r.face for r in records], attributes)
    log.info("wrote %d records of %d images to %s", len(annotations), len(names), out)
    return out


def convert(fmt: str, annotations: str | Path, images: str | Path, out: str | Path, *,
            headboxes: str | Path | None = None, copy: bool = False) -> Path:
    """Read a dataset in ``fmt`` and write it as one split folder at ``out``."""
    if fmt == "mpii-json":
        records = load_mpii(annotations, images, headboxes=headboxes)
    elif fmt == "aflw":
        if headboxes is not None:
            raise ValueError("--headboxes is for MPII: AFLW's face boxes are its records' head boxes")
        from fedpose.shared.data.aflw import ATTRIBUTES, load_aflw

        records, _ = load_aflw(annotations, images)
        return write_split(records, out, copy=copy, attributes=ATTRIBUTES)
    elif fmt == "coco":
        if headboxes is not None:
            raise ValueError("--headboxes is for MPII: COCO has no head boxes (do not evaluate PCKh on COCO)")
        from fedpose.shared.data.coco import load_coco

        records = load_coco(annotations, images)
    else:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)} (the official MPII .mat annotations: "
                         "use mmpose's converted train.json / valid.json, with mpii_gt_val.mat for head boxes)")
    return write_split(records, out, copy=copy)


def split_dataset(source: str | Path, out: str | Path, *, sites: int, public: float, val: float, seed: int = 0,
                  copy: bool = False) -> dict[str, int]:
    """Cut the split folder ``source`` into site-0..site-{sites-1}, public and val under ``out``.

    ``public`` and ``val`` are fractions of the groups (patients when the data has patient ids, else
    images); the rest is dealt to the sites in equal shares. Returns records per split.
    """
    if isinstance(sites, bool) or not isinstance(sites, int) or sites < 1:
        raise ValueError(f"--sites must be an int >= 1, got {sites!r}")
    if not (0 <= public < 1 and 0 <= val < 1 and public + val < 1):
        raise ValueError(f"--public {public} and --val {val} must be fractions with public + val < 1")
    source = Path(source)
    records = load_split(source.parent, source.name)
    attributes = read_faces(source / FACES_FILE, len(records))[1] if (source / FACES_FILE).is_file() else ()
    by_patient = all(r.patient is not None for r in records)
    key = (lambda r: r.patient) if by_patient else (lambda r: str(r.image))
    groups: dict[str, list] = {}
    for record in records:
        groups.setdefault(key(record), []).append(record)
    order = list(groups)
    np.random.default_rng(seed).shuffle(order)
    n_public, n_val = round(public * len(order)), round(val * len(order))
    if len(order) - n_public - n_val < sites:
        raise ValueError(f"{len(order)} {'patients' if by_patient else 'images'} are too few for {sites} sites after "
                         f"the public ({n_public}) and validation ({n_val}) shares")
    parts = {"public": order[:n_public], "val": order[n_public:n_public + n_val]}
    rest = order[n_public + n_val:]
    for i in range(sites):
        parts[f"site-{i}"] = rest[i::sites]
    counts = {}
    for name, keys in parts.items():
        if not keys:
            continue
        chosen = [r for k in keys for r in groups[k]]
        write_split(chosen, Path(out) / name, copy=copy, attributes=attributes)
        counts[name] = len(chosen)
    log.info("split %s by %s into %s", source, "patient" if by_patient else "image", counts)
    return counts
