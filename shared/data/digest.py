"""What data a run used, as one digest: the source and a hash of every file of the splits it read.

A number is only comparable with another when both came from the same data. The synthetic ward is
drawn with OpenCV, so a different OpenCV (or NumPy) can draw different images from the same seed;
real data can be edited in place. ``data_identity`` hashes the bytes of every file of the named
splits (annotations, sidecars, images), in a fixed order, and says where the data came from, so
metrics.json and every printed summary can name exactly what was trained and evaluated on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def split_digest(split_dir: str | Path) -> str:
    """sha256 over (relative path, sha256 of the bytes) of every file under ``split_dir``, sorted by path."""
    root = Path(split_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"no such split directory: {root}")
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(root).as_posix()}\0{_file_hash(path)}\n".encode())
    return digest.hexdigest()


def split_records(split_dir: Path) -> int | None:
    """How many records a split's annotations.json lists (None for a layout without one, e.g. COCO's)."""
    try:
        annotations = json.loads((split_dir / "annotations.json").read_text())
    except (OSError, ValueError):
        return None
    return len(annotations) if isinstance(annotations, list) else None


def data_identity(root: str | Path, splits: Sequence[str]) -> dict[str, Any]:
    """{source, root, digest, splits: {name: digest}, records: {name: count}} of the splits a run read under
    ``root`` (a count is None where the split has no MPII-layout annotations.json)."""
    root = Path(root)
    manifest = root / "manifest.json"
    source = "real"
    if manifest.is_file():
        try:
            if json.loads(manifest.read_text()).get("format") == "fedpose-synthetic-ward":
                source = "synthetic ward"
        except ValueError:
            pass
    per_split = {name: split_digest(root / name) for name in dict.fromkeys(splits)}
    overall = hashlib.sha256("\n".join(f"{k}:{v}" for k, v in sorted(per_split.items())).encode()).hexdigest()
    records = {name: split_records(root / name) for name in per_split}
    return {"source": source, "root": str(root.resolve()), "digest": overall, "splits": per_split,
            "records": records}
