"""A ward on disk: the spec, rendering one sample and writing every split
in the MPII json layout (plus head boxes, identities and meta), with a manifest for reuse."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from fedpose.shared.configuration.flat import without_as_before
from fedpose.shared.data.face import FACES_FILE, FaceLabels, write_faces
from fedpose.shared.data.mpii import box_to_json
from fedpose.shared.data.records import PoseRecord, inside
from fedpose.shared.data.synth.face import FACE_ATTRIBUTES, face_labels
from fedpose.shared.data.synth.identity import Identity, make_identity
from fedpose.shared.data.synth.person import head_box
from fedpose.shared.data.synth.pose import place_pose, sample_pose_3d
from fedpose.shared.data.synth.render import person_box, render_frame
from fedpose.shared.data.synth.rng import _derive_rng
from fedpose.shared.data.synth.styles import PUBLIC_STYLES, SiteStyle, site_style

log = logging.getLogger(__name__)

FORMAT = "fedpose-synthetic-ward"
FORMAT_VERSION = 1  # on-disk layout
RENDER_VERSION = 1  # bump whenever the same spec would produce different pixels or labels


@dataclass(frozen=True)
class WardSpec:
    """What to generate (also the ``data.synth`` section of the config).

    sites: number of private sites (splits site-0 .. site-{sites-1});
    per_site / public / val: images per split (val is spread evenly over the
    site styles, with people that appear nowhere else); images_per_identity:
    consecutive images of a split showing the same person.
    """

    sites: int = 3
    per_site: int = 400
    public: int = 600
    val: int = 240
    seed: int = 0
    image_size: int = 128
    images_per_identity: int = 8
    # The public split's camera and room: "public" (the generic public style) or "shifted" (another domain:
    # the study's domain-shift ablation). The sites, val and every record's pose and person are unchanged.
    public_style: str = "public"
    # Images of a second public split, "basis", held out from pretraining (other people, the public split's
    # camera): what V and the public scales are computed from with data.basis_split: basis. 0: no such split.
    basis: int = 0

    def __post_init__(self) -> None:
        if self.public_style not in PUBLIC_STYLES:
            raise ValueError(f"WardSpec.public_style must be one of {sorted(PUBLIC_STYLES)}, got {self.public_style!r}")
        for name in ("sites", "per_site", "public", "val", "seed", "image_size", "images_per_identity", "basis"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"WardSpec.{name} must be an int, got {value!r}")
        for name in ("sites", "per_site", "public", "val", "images_per_identity"):
            if getattr(self, name) < 1:
                raise ValueError(f"WardSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.seed < 0 or self.basis < 0:
            raise ValueError(f"WardSpec.seed and WardSpec.basis must be >= 0, got {self.seed} and {self.basis}")
        if not 32 <= self.image_size <= 1024:
            raise ValueError(f"WardSpec.image_size must be in [32, 1024] px, got {self.image_size}")

    def splits(self) -> dict[str, int]:
        """Split name -> image count."""
        held_out = {"basis": self.basis} if self.basis > 0 else {}
        return {"public": self.public, "val": self.val, **{f"site-{i}": self.per_site for i in range(self.sites)},
                **held_out}



def _style_for(spec: WardSpec, split: str, index: int) -> tuple[SiteStyle, str]:
    """Style and identity key of image ``index`` of ``split``."""
    person = index // spec.images_per_identity
    if split == "public":
        return PUBLIC_STYLES[spec.public_style], f"public/{person:05d}"
    if split == "basis":  # the public camera, people of its own
        return PUBLIC_STYLES[spec.public_style], f"basis/{person:05d}"
    if split == "val":
        site = index % spec.sites
        return site_style(site), f"val/s{site}/{(index // spec.sites) // spec.images_per_identity:05d}"
    if split.startswith("site-"):
        return site_style(int(split[5:])), f"{split}/{person:05d}"
    raise ValueError(f"unknown split {split!r}; expected public, basis, val or site-<i>")


def identity_of(spec: WardSpec, identity_id: str) -> Identity:
    """Appearance of a person named in ``identities.json`` (for attribute-inference attacks)."""
    return make_identity(_derive_rng(spec.seed, "identity", identity_id))


def _posed(spec: WardSpec, split: str, index: int) -> tuple:
    """The person of image ``index`` before any pixel: (style, identity id, identity, the image's generator at
    the point where rendering starts, pose kind, 3-d pose (16, 3), pixel joints (16, 2))."""
    style, identity_id = _style_for(spec, split, index)
    identity = identity_of(spec, identity_id)
    rng = _derive_rng(spec.seed, split, index)
    kinds = [k for k, _ in style.pose_mix]
    weights = np.array([w for _, w in style.pose_mix])
    kind = str(kinds[int(rng.choice(len(kinds), p=weights / weights.sum()))])
    pose = sample_pose_3d(kind, rng)
    joints = place_pose(pose, kind=kind, style=style, size=spec.image_size, rng=rng)
    return style, identity_id, identity, rng, kind, pose, joints


def face_sample(spec: WardSpec, split: str, index: int) -> FaceLabels | None:
    """The face labels of image ``index`` of ``split`` (what ``render_sample`` draws), without rendering it."""
    _, _, identity, _, _, pose, joints = _posed(spec, split, index)
    return face_labels(joints, pose, identity, spec.image_size)


def ensure_faces(root: str | Path, spec: WardSpec, split: str) -> Path:
    """``<root>/<split>/faces.json`` of the ward, written on first use (from the spec, no image is rendered).

    Face labels are a sidecar, so wards generated before the face tasks existed stay valid.
    """
    split_dir = Path(root) / split
    path = split_dir / FACES_FILE
    if path.is_file():
        return path
    count = spec.splits().get(split)
    if count is None:
        raise ValueError(f"the ward has no split {split!r}; it has {sorted(spec.splits())}")
    if not split_dir.is_dir():
        raise FileNotFoundError(f"ward split not found: {split_dir}")
    write_faces(path, [face_sample(spec, split, i) for i in range(count)], FACE_ATTRIBUTES)
    log.info("wrote face labels of %d images to %s", count, path)
    return path


def render_sample(spec: WardSpec, split: str, index: int) -> tuple[np.ndarray, PoseRecord, str, str]:
    """Image ``index`` of ``split``: (BGR image, record with a placeholder path, identity id, pose kind).

    Depends only on (spec.seed, spec.image_size, spec.images_per_identity,
    spec.sites for val, split, index), never on other images.
    """
    style, identity_id, identity, rng, kind, pose, joints = _posed(spec, split, index)
    size = spec.image_size
    image = render_frame(joints, style=style, identity=identity, size=size, rng=rng, kind=kind, depth=pose[:, 2])
    visible = inside(joints, (size, size))
    center, scale = person_box(joints)
    record = PoseRecord(Path("/") / split / f"{index:06d}.png", center, scale,
                        np.where(visible[:, None], joints, 0.0), visible, head_box(joints))
    return image, record, identity_id, kind


def manifest_for(spec: WardSpec) -> dict:
    """What ``manifest.json`` of a ward generated from ``spec`` contains."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "render_version": RENDER_VERSION,
        "spec": without_as_before(dataclasses.asdict(spec), "data.synth."),  # older wards stay valid
        "splits": spec.splits(),
        "layout": "<split>/annotations.json (MPII json, 1-based), headboxes.json, identities.json, "
                  "meta.json, images/*.png",
    }


def _draw(job: tuple[WardSpec, str, Path, int]) -> tuple[dict, list, str, dict]:
    """Render image ``index`` of ``split``, write its PNG, and return its annotation, head box, identity, meta."""
    spec, split, images, index = job
    image, record, identity_id, kind = render_sample(spec, split, index)
    name = f"{split}_{index:06d}.png"
    if not cv2.imwrite(str(images / name), image):
        raise OSError(f"cannot write image file {images / name}")
    center, scale = box_to_json(record.center, record.scale)
    joints = np.where(record.visible[:, None], record.joints + 1.0, -1.0)
    annotation = {
        "image": name,
        "center": [round(c, 4) for c in center],
        "scale": round(scale, 6),
        "joints": [[round(float(x), 4), round(float(y), 4)] for x, y in joints],
        "joints_vis": [int(v) for v in record.visible],
    }
    headbox = [[round(float(v) + 1.0, 4) for v in corner] for corner in record.headbox]
    meta = {"identity": identity_id, "kind": kind, "style": _style_for(spec, split, index)[0].name}
    return annotation, headbox, identity_id, meta


def _write_split(split_dir: Path, spec: WardSpec, split: str, count: int, bar, pool=None) -> None:
    images = split_dir / "images"
    images.mkdir(parents=True)
    jobs = [(spec, split, images, index) for index in range(count)]
    drawn = pool.map(_draw, jobs, chunksize=16) if pool is not None else map(_draw, jobs)
    annotations, headboxes, identities, meta = [], [], [], []
    for annotation, headbox, identity_id, info in drawn:  # in index order whoever drew them
        annotations.append(annotation)
        headboxes.append(headbox)
        identities.append(identity_id)
        meta.append(info)
        bar.update(1)
    for file_name, payload in (("annotations.json", annotations), ("headboxes.json", headboxes),
                               ("identities.json", identities), ("meta.json", meta)):
        (split_dir / file_name).write_text(json.dumps(payload))


def _pool(workers: int | None, total: int):
    """A process pool for a ward worth it (each image depends only on the seed, its split and index), else None."""
    if workers is None:
        workers = min(os.cpu_count() or 1, 16) if total >= PARALLEL_FROM else 1
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if workers == 1:
        return None
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn: the caller may hold torch's threads, which a forked child must not inherit
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))


# below this many images one process draws the ward (starting workers costs about a second each)
PARALLEL_FROM = 2000


def generate_ward(out_dir: str | Path, spec: WardSpec, *, progress: bool = True, workers: int | None = None) -> Path:
    """Write every split of ``spec`` under ``out_dir`` and return its path.

    ``workers``: processes drawing the images (None: one per core, up to 16, for a ward of at least
    ``PARALLEL_FROM`` images; one below). The files are the same whatever the number.

    Files appear atomically: everything is written to a temporary sibling
    directory that is renamed into place at the end, so an interrupted run
    leaves no half-written ward behind. Refuses to touch an existing
    non-empty directory (use ``ensure_ward`` to reuse one).
    """
    from tqdm import tqdm

    if not isinstance(spec, WardSpec):
        raise ValueError(f"spec must be a WardSpec, got {type(spec).__name__}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not empty; use ensure_ward() or pick another directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    splits = spec.splits()
    start = time.perf_counter()
    pool = _pool(workers, sum(splits.values()))
    try:
        with tqdm(total=sum(splits.values()), desc=f"synthetic ward -> {out}", unit="img",
                  disable=not progress) as bar:
            for split, count in splits.items():
                _write_split(tmp / split, spec, split, count, bar, pool)
        (tmp / "manifest.json").write_text(json.dumps(manifest_for(spec), indent=2))
        try:
            if out.exists():
                out.rmdir()  # empty (checked above); rename() needs it gone on some systems
            tmp.rename(out)
        except OSError:
            if _read_manifest(out) == manifest_for(spec):  # a concurrent process won the race
                log.info("%s was generated concurrently with the same spec; using it", out)
                shutil.rmtree(tmp)
                return out
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    elapsed = time.perf_counter() - start
    total = sum(splits.values())
    log.info("generated %d synthetic images in %.1f s (%.0f images/min) at %s",
             total, elapsed, 60.0 * total / max(elapsed, 1e-9), out)
    return out


def _read_manifest(out: Path) -> dict | None:
    path = out / "manifest.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot parse {path}: {err}; delete {out} to regenerate it") from err


def ensure_ward(out_dir: str | Path, spec: WardSpec, *, progress: bool = True) -> Path:
    """Return ``out_dir`` holding the ward of ``spec``, generating it only if it is absent.

    An existing directory generated from a different spec (or by an older
    generator) is never overwritten: that raises ValueError naming the
    differences, so results are not silently mixed.
    """
    out = Path(out_dir)
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return generate_ward(out, spec, progress=progress)
    found = _read_manifest(out)
    if found is None:
        raise ValueError(f"{out} exists but has no manifest.json, so it is not a synthetic ward; "
                         "point data.root elsewhere or delete it")
    wanted = manifest_for(spec)
    if found != wanted:
        keys = sorted(k for k in set(found) | set(wanted) if found.get(k) != wanted.get(k))
        details = [f"{k}: on disk {found.get(k)!r}, requested {wanted.get(k)!r}" for k in keys]
        raise ValueError(f"{out} holds a different synthetic ward ({'; '.join(details)}); "
                         "delete it or choose another directory")
    log.info("reusing synthetic ward at %s", out)
    return out


def load_identities(root: str | Path, split: str) -> list[str]:
    """Identity id of every record of a split (aligned with annotations.json)."""
    path = Path(root) / split / "identities.json"
    try:
        ids = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise FileNotFoundError(f"identity sidecar not found: {path}") from err
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot parse identity sidecar {path}: {err}") from err
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise ValueError(f"{path}: expected a json list of identity strings")
    return ids
