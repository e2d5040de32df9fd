"""Flower run config (flat scalars) <-> the fedpose Config, for the ServerApp and the ClientApp.

The run config (``[tool.flwr.app.config]`` in pyproject.toml, overridable
with ``flwr run . --run-config "..."``) carries only:

- ``config``: the fedpose YAML (absolute, relative to the working directory,
  or relative to the app directory: ``configs/default.yaml`` ships in the FAB);
- ``overrides``: space-separated ``dotted.key=value`` pairs (YAML values),
  e.g. ``"federation.rounds=2 train.batch_size=8"``;
- ``out``: results directory (empty: ``federation.out`` of the config);
- ``resume``: continue from ``out``'s checkpoint.

Relative paths inside the config (data root, pretrained weights, out) are
resolved against the working directory of the process that reads them.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedpose.shared.configuration.schema import Config, load_config
from fedpose.shared.errors import ConfigError
from fedpose.shared.configuration.yaml_io import parse_yaml

RUN_CONFIG_DEFAULTS: dict[str, Any] = {"config": "configs/default.yaml", "overrides": "", "out": "", "resume": False}

APP_ROOT = Path(__file__).resolve().parents[1]


def parse_overrides(text: str) -> dict[str, Any]:
    """``"a.b=1 c.d='x y'"`` -> {"a.b": 1, "c.d": "x y"} (values parsed as YAML)."""
    out: dict[str, Any] = {}
    for token in shlex.split(text or ""):
        key, sep, value = token.partition("=")
        if not sep or not key:
            raise ConfigError(f"run config overrides: {token!r} is not key=value (e.g. federation.rounds=2)")
        if key in out:
            raise ConfigError(f"run config overrides: {key} is given twice")
        out[key] = parse_yaml(value, what=f"run config overrides: value of {key}")
    return out


def resolve_config_path(path: str) -> Path:
    """An absolute path, else relative to the working directory, else to the app directory."""
    candidate = Path(path).expanduser()
    if candidate.is_absolute():
        return candidate
    for base in (Path.cwd(), APP_ROOT):
        if (base / candidate).is_file():
            return (base / candidate).resolve()
    raise ConfigError(f"run config: config file {path!r} not found in {Path.cwd()} or {APP_ROOT}")


def config_from_run_config(run_config: Mapping[str, Any]) -> Config:
    values = {**RUN_CONFIG_DEFAULTS, **dict(run_config)}
    return load_config(resolve_config_path(str(values["config"])), parse_overrides(str(values["overrides"])))


def out_dir(run_config: Mapping[str, Any], cfg: Config) -> Path:
    out = str(run_config.get("out") or "") or cfg.federation.out
    return Path(out).expanduser().resolve()


def server_config(run_config: Mapping[str, Any]) -> tuple[Config, Path]:
    """The ServerApp's config and results directory.

    Resuming (``resume=true``) with ``out`` set uses the config saved in ``out/config.yaml`` by the
    run being resumed: ``flwr run . pilot --run-config "out='/srv/fedpose/run1' resume=true"`` is
    enough; a ``config`` or ``overrides`` given as well is refused rather than silently ignored.
    """
    values = dict(run_config)
    if resume_flag(values) and str(values.get("out") or ""):
        out = Path(str(values["out"])).expanduser().resolve()
        saved = out / "config.yaml"
        if saved.is_file():
            if str(values.get("overrides") or "").strip():
                raise ConfigError(f"resume uses the config saved in {saved}; drop the overrides")
            return load_config(saved), out
        raise ConfigError(f"resume: {saved} not found: nothing to resume in {out}")
    cfg = config_from_run_config(values)
    return cfg, out_dir(values, cfg)


def resume_flag(run_config: Mapping[str, Any]) -> bool:
    value = run_config.get("resume", False)
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes")
    return bool(value)
