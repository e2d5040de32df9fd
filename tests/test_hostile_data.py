"""Issue #15, data boundaries: pixel-hash disjointness, duplicate private images, path traversal,
corrupt/huge/odd image files and annotation entries refused with one clear ValueError."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedpose.shared.data.mpii import load_mpii
from fedpose.shared.data.records import PoseRecord, content_hash
from fedpose.shared.data.split import check_disjoint, check_no_duplicates

JOINTS = [[10.0 + i, 20.0 + i] for i in range(16)]


def _png(path: Path, seed: int = 0, *, level: int = 6, size: tuple[int, int] = (40, 30)) -> Path:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, compress_level=level)
    return path


def _record(path: Path) -> PoseRecord:
    return PoseRecord(path.resolve(), [20.0, 15.0], 0.2, np.zeros((16, 2)), np.zeros(16, bool))


def _split(tmp_path: Path, entries: list[dict]) -> tuple[Path, Path]:
    images = tmp_path / "split" / "images"
    images.mkdir(parents=True, exist_ok=True)
    ann = tmp_path / "split" / "annotations.json"
    ann.write_text(json.dumps(entries))
    return ann, images


def _entry(name: object, **extra: object) -> dict:
    return {"image": name, "center": [20.0, 15.0], "scale": 0.2, "joints": JOINTS,
            "joints_vis": [1] * 16, **extra}


# --------------------------------------------------------------------------- item 1: pixel hash


def test_recompressed_public_png_is_caught_by_pixel_hash(tmp_path: Path) -> None:
    public = _png(tmp_path / "pub" / "a.png", seed=1, level=0)
    private = _png(tmp_path / "priv" / "b.png", seed=1, level=9)
    assert public.read_bytes() != private.read_bytes()  # different files, same pixels
    assert content_hash(public) == content_hash(private)
    with pytest.raises(ValueError, match="share 1 image"):
        check_disjoint([_record(public)], [_record(private)])


def test_content_hash_differs_for_different_pixels(tmp_path: Path) -> None:
    assert content_hash(_png(tmp_path / "a.png", 1)) != content_hash(_png(tmp_path / "b.png", 2))


def test_content_hash_of_non_image_is_a_value_error_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "x.png"
    bad.write_bytes(b"not an image at all")
    with pytest.raises(ValueError, match="x.png"):
        content_hash(bad)


# --------------------------------------------------------------------------- item 2: duplicates


def test_duplicate_private_images_refused(tmp_path: Path) -> None:
    a = _png(tmp_path / "s0" / "a.png", seed=3, level=1)
    b = _png(tmp_path / "s1" / "b.png", seed=3, level=8)
    c = _png(tmp_path / "s1" / "c.png", seed=4)
    with pytest.raises(ValueError, match="twice"):
        check_no_duplicates([_record(a), _record(b), _record(c)], what="private data")


def test_several_people_in_one_image_are_not_duplicates(tmp_path: Path) -> None:
    a = _png(tmp_path / "a.png", seed=3)
    check_no_duplicates([_record(a), _record(a)], what="private data")


# --------------------------------------------------------------------------- item 3: path traversal


@pytest.mark.parametrize("name", ["../../../outside.png", "../outside.png", "sub/../../outside.png"])
def test_traversal_names_refused(tmp_path: Path, name: str) -> None:
    _png(tmp_path / "outside.png")
    _png(tmp_path / "split" / "outside.png")
    ann, images = _split(tmp_path, [_entry(name)])
    with pytest.raises(ValueError, match="outside|leaves"):
        load_mpii(ann, images)


def test_absolute_name_refused(tmp_path: Path) -> None:
    target = _png(tmp_path / "outside.png")
    ann, images = _split(tmp_path, [_entry(str(target.resolve()))])
    with pytest.raises(ValueError, match="absolute|leaves|outside"):
        load_mpii(ann, images)


def test_subfolder_name_is_fine(tmp_path: Path) -> None:
    ann, images = _split(tmp_path, [_entry("sub/a.png")])
    _png(images / "sub" / "a.png")
    assert len(load_mpii(ann, images)) == 1


# --------------------------------------------------------------------------- item 11: odd files


@pytest.mark.parametrize("name", [5, None, ["a.png"], ""])
def test_non_string_image_names_refused(tmp_path: Path, name: object) -> None:
    ann, images = _split(tmp_path, [_entry(name)])
    with pytest.raises(ValueError, match="image"):
        load_mpii(ann, images)


@pytest.mark.parametrize("content", [b"", b"\x89PNG\r\n\x1a\n", b"hello, world", b"\xff\xd8\xff\xe0garbage"])
def test_corrupt_zero_byte_and_non_image_files_refused(tmp_path: Path, content: bytes) -> None:
    ann, images = _split(tmp_path, [_entry("a.png")])
    (images / "a.png").write_bytes(content)
    with pytest.raises(ValueError, match="a.png"):
        load_mpii(ann, images)


def test_truncated_png_refused(tmp_path: Path) -> None:
    ann, images = _split(tmp_path, [_entry("a.png")])
    good = _png(tmp_path / "good.png", size=(200, 200)).read_bytes()
    (images / "a.png").write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match="a.png"):
        load_mpii(ann, images)


def test_huge_image_header_refused_before_decoding(tmp_path: Path) -> None:
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 100000, 100000, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 10)) \
        + chunk(b"IEND", b"")
    ann, images = _split(tmp_path, [_entry("a.png")])
    (images / "a.png").write_bytes(png)
    with pytest.raises(ValueError, match="a.png.*(pixels|large)"):
        load_mpii(ann, images)


def test_non_utf8_annotation_file_refused(tmp_path: Path) -> None:
    ann, images = _split(tmp_path, [])
    ann.write_bytes(b'[{"image": "\xff\xfe.png"}]')
    with pytest.raises(ValueError, match="annotations.json"):
        load_mpii(ann, images)


def test_string_scale_not_coerced(tmp_path: Path) -> None:
    ann, images = _split(tmp_path, [_entry("a.png", scale="5")])
    _png(images / "a.png")
    with pytest.raises(ValueError, match="scale"):
        load_mpii(ann, images)


def test_zero_area_headbox_refused(tmp_path: Path) -> None:
    ann, images = _split(tmp_path, [_entry("a.png")])
    _png(images / "a.png")
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps([[[5.0, 5.0], [5.0, 9.0]]]))
    with pytest.raises(ValueError, match="head box 0"):
        load_mpii(ann, images, headboxes=heads)


# --------------------------------------------------------------------------- item 2: centralized runs


def _layout_split(root: Path, split: str, names_seeds: list[tuple[str, int]]) -> None:
    images = root / split / "images"
    for name, seed in names_seeds:
        _png(images / name, seed=seed)
    (root / split / "annotations.json").write_text(json.dumps([_entry(name) for name, _ in names_seeds]))


def test_centralized_private_data_with_a_copied_image_refused(tmp_path: Path) -> None:
    from fedpose.shared.configuration.schema import config_from_dict
    from fedpose.shared.training.runs import private_records

    _layout_split(tmp_path, "site-0", [("a.png", 1), ("b.png", 2)])
    _layout_split(tmp_path, "site-1", [("c.png", 3), ("copy-of-a.png", 1)])
    cfg = config_from_dict({"data": {"root": str(tmp_path), "train_splits": ["site-0", "site-1"]}})
    with pytest.raises(ValueError, match="same image twice"):
        private_records(tmp_path, cfg)


def test_batch_size_above_n_refused_with_the_numbers() -> None:
    from fedpose.shared.training.runs import check_batch_size

    with pytest.raises(ValueError, match=r"train\.batch_size = 64.*40"):
        check_batch_size(64, 40)
    check_batch_size(40, 40)
