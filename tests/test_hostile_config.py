"""Issue #15, config boundary: one YAML reader that refuses alias bombs, duplicate keys and
non-UTF-8 text, reads 1e-5 as a float, and range checks that name the key path."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fedpose.shared.errors import ConfigError
from fedpose.shared.configuration.schema import config_from_dict, load_config
from fedpose.shared.configuration.yaml_io import read_yaml

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
    f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
    for i in range(8)
)


def _write(tmp_path: Path, text: str | bytes, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


# --------------------------------------------------------------------------- item 7: alias bomb


def test_alias_bomb_refused_with_overrides(tmp_path: Path) -> None:
    path = _write(tmp_path, BOMB)
    with pytest.raises(ConfigError, match="alias"):
        load_config(path, {"train.lr": 0.1})
    with pytest.raises(ConfigError, match="alias"):
        read_yaml(path, what="site policy")


def test_deep_nesting_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="c.yaml"):
        read_yaml(_write(tmp_path, "a: " + "[" * 5000 + "]" * 5000), what="config file")


def test_oversized_file_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="too large"):
        read_yaml(_write(tmp_path, "# " + "x" * (2 << 20) + "\n"), what="config file")


# --------------------------------------------------------------------------- item 12: 1e-5


def test_scientific_notation_without_dot_is_a_float(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, "privacy:\n  delta: 1e-5\n  epsilon: 2E0\ntrain:\n  lr: 5e-4\n"))
    assert cfg.privacy.delta == 1e-5 and cfg.privacy.epsilon == 2.0 and cfg.train.lr == 5e-4
    assert read_yaml(_write(tmp_path, "x: 1e5\ny: '1e5'\nz: 10\n"), what="t") == {"x": 1e5, "y": "1e5", "z": 10}


def test_overrides_use_the_same_reader() -> None:
    from fedpose.shared.flower.run_config import parse_overrides

    assert parse_overrides("privacy.delta=1e-6 train.lr=3e-4") == {"privacy.delta": 1e-6, "train.lr": 3e-4}


# --------------------------------------------------------------------------- item 10: values


def test_duplicate_yaml_keys_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="duplicate key.*epsilon"):
        load_config(_write(tmp_path, "privacy:\n  epsilon: 0.8\n  epsilon: 80\n"))


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("federation", "round_timeout", math.nan),
        ("federation", "round_timeout", math.inf),
        ("model", "split_ratio", math.nan),
        ("model", "sigma", [math.nan, 2.0]),
        ("privacy", "clip_norm", math.nan),
        ("privacy", "epsilon", math.inf),
        ("train", "momentum", -0.5),
        ("train", "momentum", 1.5),
        ("train", "weight_decay", -1e-4),
        ("pretrain", "weight_decay", -1.0),
        ("model", "vis_weight", -0.1),
        ("data", "input_size", [100000, 100000]),
        ("model", "hidden", 10**7),
        ("privacy", "epsilon", 10**400),
    ],
)
def test_out_of_range_values_refused_with_key_path(section: str, key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"{section}\.{key}"):
        config_from_dict({section: {key: value}})


def test_duplicate_train_splits_refused() -> None:
    with pytest.raises(ConfigError, match=r"data\.train_splits.*site-0.*twice"):
        config_from_dict({"data": {"train_splits": ["site-0", "site-0"]}})


@pytest.mark.parametrize("val", ["public", "site-1"])
def test_val_split_must_differ_from_public_and_train(val: str) -> None:
    with pytest.raises(ConfigError, match=r"data\.val_split"):
        config_from_dict({"data": {"val_split": val}})


def test_min_sites_above_train_splits_refused() -> None:
    from fedpose.shared.flower.simulation import check_simulation_sites

    cfg = config_from_dict({"federation": {"min_sites": 4}, "data": {"train_splits": ["site-0", "site-1", "site-2"]}})
    with pytest.raises(ConfigError, match=r"federation\.min_sites"):
        check_simulation_sites(cfg)
    check_simulation_sites(config_from_dict({"federation": {"min_sites": 3}}))


# --------------------------------------------------------------------------- item 11: odd files


def test_non_utf8_config_refused_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="c.yaml.*UTF-8"):
        load_config(_write(tmp_path, b"train:\n  lr: \xff\xfe\n"))


def test_huge_integer_epsilon_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"privacy\.epsilon"):
        load_config(_write(tmp_path, "privacy:\n  epsilon: " + "9" * 400 + "\n"))
