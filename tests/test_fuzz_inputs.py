"""Issue #15: property-based fuzzing of every reader of untrusted input.

Each property: any input gives a valid object or raises the project's error type
(a ValueError, or FileNotFoundError for a missing file, which the CLI prints as
one line) with a message; never another exception. Memory is capped around each
example (RLIMIT_AS: current size + 1.5 GiB), so an input that would allocate
gigabytes fails the test instead of the machine. Derandomized with fixed
example counts so CI stays within a few seconds per property.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.filterwarnings("ignore")

FUZZ = settings(max_examples=60, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
PROJECT_ERRORS = (ValueError, FileNotFoundError)


@contextlib.contextmanager
def memory_cap(extra_mb: int = 1536) -> Iterator[None]:
    """Lower this process's address-space soft limit to its current size + ``extra_mb`` for the block."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    size_kb = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                   if line.startswith("VmSize:"))
    cap = size_kb * 1024 + (extra_mb << 20)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _check(fn, *args, **kwargs):
    with memory_cap():
        try:
            return fn(*args, **kwargs)
        except PROJECT_ERRORS as err:
            assert str(err).strip(), f"{type(err).__name__} without a message"
            return None


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.integers(),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
)
plain = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                     max_leaves=12)


# --------------------------------------------------------------------------- config


SECTIONS = {
    "data": ["root", "train_splits", "public_split", "val_split", "input_size", "augment", "synth"],
    "model": ["variant", "split_ratio", "sigma", "joint_channels", "hidden", "task_uncertainty", "vis_weight"],
    "privacy": ["epsilon", "delta", "clip_norm", "accountant", "psi", "psi_param", "k", "m", "basis_every",
                "chunk_size"],
    "train": ["method", "strategy", "epochs", "batch_size", "optimizer", "lr", "momentum", "weight_decay", "seed"],
    "federation": ["rounds", "local_steps", "min_sites", "basis_mode", "round_timeout"],
}
config_values = st.one_of(plain, st.lists(st.integers(min_value=-5, max_value=10**6), min_size=2, max_size=2),
                          st.lists(st.sampled_from(["site-0", "site-1", "public", "val"]), max_size=3))
config_dicts = st.fixed_dictionaries({}, optional={
    section: st.dictionaries(st.sampled_from(keys + ["bogus"]), config_values, max_size=4)
    for section, keys in SECTIONS.items()
})


@FUZZ
@given(config_dicts)
def test_config_from_dict_fuzz(data: dict) -> None:
    from fedpose.shared.configuration.schema import Config, config_from_dict

    cfg = _check(config_from_dict, data)
    if cfg is not None:
        assert isinstance(cfg, Config)
        assert all(math.isfinite(v) for v in (cfg.privacy.epsilon, cfg.train.lr, cfg.federation.round_timeout))


yaml_text = st.one_of(
    st.text(max_size=200),
    st.lists(st.sampled_from(["train:", "  lr: 1e-3", "  lr: &a 1", "  x: *a", "privacy:", "  delta: 1e-5",
                              "  epsilon: .nan", "  epsilon: 0.8", "  epsilon: 0.8", "- [", "]", "{a: 1}",
                              "!!python/object:os.system {}", "data:", "  input_size: [64, 48]", "\t", "? a",
                              "%YAML 1.1", "---", "...", "  train_splits: [site-0, site-0]"]),
             max_size=8).map("\n".join),
)


@FUZZ
@given(st.one_of(yaml_text.map(str.encode), st.binary(max_size=100)))
def test_yaml_config_file_fuzz(tmp_path_factory: pytest.TempPathFactory, raw: bytes) -> None:
    from fedpose.shared.configuration.schema import load_config

    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_bytes(raw)
    _check(load_config, path, {"train.lr": 0.1})


# --------------------------------------------------------------------------- policy (reader only)


policy_values = st.one_of(scalars.filter(lambda v: not (isinstance(v, int) and abs(v) > 2**60)),
                          st.lists(st.sampled_from(["fpdp", "dpsgd", "nope"]), max_size=3))


@FUZZ
@given(st.dictionaries(st.sampled_from(["site", "epsilon", "delta", "max_rounds", "data_path", "ledger_path",
                                        "min_sigma", "public_path", "accountant", "methods", "seed", "x"]),
                       policy_values, max_size=12))
def test_policy_from_dict_fuzz(data: dict) -> None:
    from fedpose.client.policy import policy_from_dict

    _check(policy_from_dict, data)


def test_policy_huge_integer_epsilon() -> None:
    from fedpose.client.policy import policy_from_dict

    for key in ("epsilon", "delta", "sample_rate", "expected_batch", "clip_norm"):
        data = {"policy_version": 3, "site": "a", "epsilon": 1.0, "delta": 1e-5, "lifetime_rounds": 1,
                "rounds_per_federation": 1, "sample_rate": 0.1, "expected_batch": 16, "steps_per_round": 1,
                "clip_norm": 1.0,
                "psi": "blur", "psi_min": 0.03, "augment": True, "data_path": "d", "ledger_path": "l"}
        data[key] = 10**400
        with pytest.raises(ValueError, match=key):
            policy_from_dict(data)


@FUZZ
@given(st.one_of(yaml_text.map(str.encode), st.binary(max_size=60)))
def test_load_policy_fuzz(tmp_path_factory: pytest.TempPathFactory, raw: bytes) -> None:
    from fedpose.client.policy import load_policy

    path = tmp_path_factory.mktemp("pol") / "policy.yaml"
    path.write_bytes(raw)
    _check(load_policy, path)


# --------------------------------------------------------------------------- MPII / COCO readers


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from PIL import Image

    root = tmp_path_factory.mktemp("split")
    (root / "images").mkdir()
    Image.fromarray(np.zeros((30, 40, 3), np.uint8)).save(root / "images" / "a.png")
    (root / "images" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\nxx")
    (root / "outside.png").write_bytes((root / "images" / "a.png").read_bytes())
    return root


names = st.one_of(st.sampled_from(["a.png", "bad.png", "../outside.png", "/etc/passwd", "", "sub/../a.png",
                                   "missing.png"]), plain)
numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10**6), plain)
mpii_entry = st.one_of(plain, st.fixed_dictionaries({
    "image": names, "center": st.one_of(st.lists(numbers, min_size=2, max_size=2), plain),
    "scale": numbers,
    "joints": st.one_of(st.lists(st.lists(numbers, min_size=2, max_size=2), min_size=16, max_size=16), plain),
    "joints_vis": st.one_of(st.lists(st.integers(0, 1), min_size=16, max_size=16), plain),
}))


@FUZZ
@given(st.one_of(st.lists(mpii_entry, max_size=3), plain))
def test_mpii_reader_fuzz(split: Path, entries: object) -> None:
    from fedpose.shared.data.mpii import load_mpii

    ann = split / "annotations.json"
    ann.write_text(json.dumps(entries))
    records = _check(load_mpii, ann, split / "images")
    for record in records or []:
        assert record.image.parent == (split / "images").resolve()


coco_ann = st.fixed_dictionaries({
    "id": st.one_of(st.integers(0, 5), plain), "image_id": st.one_of(st.integers(0, 2), plain),
    "category_id": st.just(1), "iscrowd": st.one_of(st.integers(0, 1), plain),
    "num_keypoints": st.one_of(st.integers(0, 17), plain),
    "bbox": st.one_of(st.lists(numbers, min_size=4, max_size=4), plain),
    "keypoints": st.one_of(st.lists(st.integers(-1, 50), min_size=51, max_size=51), plain),
})
coco_img = st.fixed_dictionaries({"id": st.one_of(st.integers(0, 2), plain), "file_name": names},
                                 optional={"height": st.one_of(st.just(30), plain),
                                           "width": st.one_of(st.just(40), plain)})


@FUZZ
@given(st.one_of(plain, st.fixed_dictionaries({"images": st.one_of(st.lists(coco_img, max_size=2), plain),
                                               "annotations": st.one_of(st.lists(coco_ann, max_size=3), plain),
                                               "categories": st.just([{"id": 1, "name": "person"}])})))
def test_coco_reader_fuzz(split: Path, data: object) -> None:
    from fedpose.shared.data.coco import load_coco

    ann = split / "coco.json"
    ann.write_text(json.dumps(data))
    _check(load_coco, ann, split / "images")


# --------------------------------------------------------------------------- NPZ restore, pixelize options


big = st.one_of(st.integers(-2, 64), st.integers(0, 2**40), st.sampled_from([200000, 2**31, 2**62]))


@FUZZ
@given(b=big, s_b=big, height=big, width=big, channels=st.integers(-1, 4),
       simple=st.tuples(st.integers(0, 4), st.integers(0, 4)), complex_n=st.integers(0, 3),
       mask=st.tuples(st.integers(0, 5), st.integers(0, 5)),
       dtype=st.sampled_from(["float32", "float64", "int64", "bool", "U1"]), value=st.floats(-1, 300))
def test_npz_restore_fuzz(tmp_path_factory: pytest.TempPathFactory, b, s_b, height, width, channels, simple,
                          complex_n, mask, dtype, value) -> None:
    from fedpose.shared.pixelization.storage import restore

    path = tmp_path_factory.mktemp("npz") / "f.npz"
    with open(path, "wb") as f:
        np.savez_compressed(
            f, simple_means=np.full(simple, value).astype(dtype),
            complex_means=np.zeros((complex_n, 1, 1, 1), dtype=dtype), cell_mask=np.zeros(mask, bool),
            b=np.int64(b), s_b=np.int64(s_b), height=np.int64(height), width=np.int64(width),
            channels=np.int64(channels))
    image = _check(restore, path)
    if image is not None:
        assert image.shape[:2] == (height, width)


@FUZZ
@given(st.binary(max_size=300))
def test_npz_restore_random_bytes(tmp_path_factory: pytest.TempPathFactory, raw: bytes) -> None:
    from fedpose.shared.pixelization.storage import restore

    path = tmp_path_factory.mktemp("npz") / "r.npz"
    path.write_bytes(b"PK\x03\x04" + raw if raw[:1] == b"\0" else raw)
    _check(restore, path)


pix_tokens = st.lists(st.tuples(st.sampled_from(["eps", "b", "m", "n", "noise", "color", "x", ""]),
                                st.one_of(st.sampled_from(["1", "0", "16", "4", "1e20", "nan", "inf", "-3", "0.5",
                                                           "laplace", "off", "2" * 30, "", "1e-300"]),
                                          st.text(max_size=5))), max_size=6)


@FUZZ
@given(st.one_of(pix_tokens.map(lambda ts: ",".join(f"{k}={v}" for k, v in ts)), st.text(max_size=30)))
def test_pixelize_option_parser_fuzz(text: str) -> None:
    from fedpose.edge.pipeline.options import parse_pixelize
    from fedpose.shared.pixelization.spec import PixelizeSpec

    parsed = _check(parse_pixelize, text)
    if parsed is not None:
        spec, color = parsed
        assert isinstance(spec, PixelizeSpec) and isinstance(color, bool)
        assert math.isfinite(spec.eps) and spec.eps > 0
