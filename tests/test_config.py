"""Config: YAML loading, validation at the boundary, dotted keys for Flower."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedpose.shared.errors import ConfigError
from fedpose.shared.configuration.schema import config_from_dict, load_config, replace
from fedpose.shared.configuration.flat import flatten, unflatten

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["default.yaml", "paper.yaml"])
def test_shipped_configs_load(name):
    cfg = load_config(ROOT / "configs" / name)
    assert cfg.train.method == "fpdp"
    assert cfg.privacy.k <= cfg.privacy.m


def test_paper_config_is_the_papers_setting():
    cfg = load_config(ROOT / "configs" / "paper.yaml")
    assert cfg.model.variant == "tinyvit-5m"
    assert cfg.data.input_size == (256, 192)
    assert cfg.model.split_ratio == 2.0
    assert (cfg.privacy.k, cfg.privacy.m, cfg.train.epochs, cfg.privacy.accountant) == (50, 100, 25, "rdp")


def test_unknown_key_is_rejected_with_its_path():
    with pytest.raises(ConfigError, match=r"unknown config key train\.learning_rate"):
        config_from_dict({"train": {"learning_rate": 0.1}})
    with pytest.raises(ConfigError, match=r"unknown config key data\.synth\.people"):
        config_from_dict({"data": {"synth": {"people": 3}}})


def test_wrong_types_name_the_key():
    with pytest.raises(ConfigError, match=r"train\.lr: expected a number"):
        config_from_dict({"train": {"lr": "fast"}})
    with pytest.raises(ConfigError, match=r"train\.method: expected one of"):
        config_from_dict({"train": {"method": "dp"}})
    with pytest.raises(ConfigError, match=r"data\.input_size: expected 2 items"):
        config_from_dict({"data": {"input_size": [64, 48, 3]}})
    with pytest.raises(ConfigError, match=r"data\.augment: expected true/false"):
        config_from_dict({"data": {"augment": "yes"}})


@pytest.mark.parametrize(
    "section, message",
    [
        ({"privacy": {"epsilon": 0}}, "privacy.epsilon"),
        ({"privacy": {"delta": 1.5}}, "privacy.delta"),
        ({"privacy": {"clip_norm": -1}}, "privacy.clip_norm"),
        ({"privacy": {"k": 120, "m": 100}}, "lower k or raise m"),
        ({"data": {"train_splits": ["public"], "public_split": "public"}}, "disjoint"),
    ],
)
def test_bad_values_say_what_to_change(section, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        config_from_dict(section)


def test_flat_view_round_trips_and_overrides(tmp_path):
    cfg = load_config(ROOT / "configs" / "default.yaml")
    flat = flatten(cfg)
    assert flat["privacy.epsilon"] == cfg.privacy.epsilon
    assert config_from_dict(unflatten(flat)) == cfg
    cfg2 = replace(cfg, **{"train.lr": 0.5, "privacy.epsilon": 0.2})
    assert (cfg2.train.lr, cfg2.privacy.epsilon) == (0.5, 0.2)
    over = load_config(ROOT / "configs" / "default.yaml", {"train.method": "dpsgd"})
    assert over.train.method == "dpsgd" and over.train.lr == cfg.train.lr
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(bad)
    with pytest.raises(ConfigError, match="missing.yaml"):
        load_config(tmp_path / "missing.yaml")


def test_one_source_of_defaults_and_config_show_resolves_every_set(capsys):
    """A partial config trains what the shipped default trains: the dataclass defaults are configs/default.yaml
    (before, strategy, epochs, psi strength and rounds differed); data.source alone has no default, on purpose."""
    import json

    from fedpose.cli.main import main
    from fedpose.shared.configuration.schema import Config, load_config
    from fedpose.shared.configuration.flat import flatten

    shipped, defaults = flatten(load_config("default")), flatten(Config())
    assert {k for k in shipped if shipped[k] != defaults[k]} == {"data.source"}
    assert main(["config", "show", "--config", "default", "--set", "train.lr=0.0005", "--set",
                 "data.input_size=[64, 64]", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["train"]["lr"] == 0.0005 and shown["data"]["input_size"] == [64, 64]
    assert main(["config", "show", "--set", "train.nope=1"]) == 3
    assert "train.nope" in capsys.readouterr().err
