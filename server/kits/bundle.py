"""The Flower app the sites approve, written from this fedpose install (``fedpose server build-app``).

A server installs fedpose from a wheel: its site-packages hold the apps' packages but no Flower app project
(no pyproject.toml with ``[tool.flwr.app]``), so ``flwr build`` and ``flwr run`` cannot use them as they are.
``build-app --out DIR`` writes that project into DIR (a pyproject.toml and the packages below, copied from
where they are installed) and its bundle, ``DIR.fab``: the bytes ``flwr build --app DIR`` writes and ``flwr run
DIR`` (``fedpose server run --app DIR``) submits. Two installs of the same release write the same bundle, so a
site can rebuild it from its own install and compare the SHA-256 before approving it.

The app is described once, here (its packages, components and run config); pyproject.toml's
``[tool.flwr.app]``, used by ``flwr run .`` in a clone, says the same (a test compares them).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "fedpose"  # the installed distribution: the app's name, version and description
PUBLISHER = "fedpose"
ROOT_PACKAGE = "fedpose"  # the one import root; the bundle holds fedpose/__init__.py and the packages below
PACKAGES = ("shared", "client", "server", "configs")  # the packages of fedpose the bundle carries: code and configs
COMPONENTS = {"serverapp": "fedpose.server.server_app:app", "clientapp": "fedpose.client.client_app:app"}
MARK = "# Written by fedpose server build-app"  # the first line of the pyproject.toml it writes


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)  # strings and numbers: a TOML basic string is a JSON string


def pyproject() -> str:
    """The app's pyproject.toml: the installed release's name and version, the app's components and run config."""
    from fedpose.shared.flower.run_config import RUN_CONFIG_DEFAULTS

    dist = metadata.distribution(DISTRIBUTION)
    core = [r for r in dist.requires or [] if ";" not in r]  # what the apps import besides the train extra
    app = {"publisher": PUBLISHER, "fab-include": [f"{ROOT_PACKAGE}/**", "pyproject.toml"]}
    lines = [MARK + f" from {DISTRIBUTION} {dist.version}: the Flower app the sites approve.", "",
             "[project]", f"name = {_toml(dist.metadata['Name'])}", f"version = {_toml(dist.version)}",
             f"description = {_toml(dist.metadata['Summary'] or '')}",
             f"license = {{ text = {_toml(dist.metadata['License'] or '')} }}", f"dependencies = {_toml(core)}", "",
             "[tool.flwr.app]", *(f"{k} = {_toml(v)}" for k, v in app.items()), "",
             "[tool.flwr.app.components]", *(f"{k} = {_toml(v)}" for k, v in COMPONENTS.items()), "",
             "[tool.flwr.app.config]", *(f"{k} = {_toml(v)}" for k, v in RUN_CONFIG_DEFAULTS.items())]
    return "\n".join(lines) + "\n"


def package_folder(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the package {name} of fedpose is not installed here: reinstall fedpose[train]")
    return Path(list(spec.submodule_search_locations)[0])


def write_app(out: Path) -> Path:
    """Write the app into ``out`` (new, empty, or written here before: then replaced); returns ``out``."""
    out = out.expanduser().resolve()
    from flwr.cli.utils import validate_project_name

    validate_project_name(out.name, "--out: the app folder's name")
    if out.exists() and any(out.iterdir()):
        project = out / "pyproject.toml"
        if not project.is_file() or not project.read_text().startswith(MARK):
            raise ValueError(f"{out} is not empty and was not written by fedpose server build-app: give --out a new "
                             "folder (e.g. /srv/fedpose/app)")
        for child in out.iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    out.mkdir(parents=True, exist_ok=True)
    root = out / ROOT_PACKAGE
    root.mkdir()
    shutil.copyfile(package_folder(ROOT_PACKAGE) / "__init__.py", root / "__init__.py")
    for name in PACKAGES:
        shutil.copytree(package_folder(f"{ROOT_PACKAGE}.{name}"), root / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (out / "pyproject.toml").write_text(pyproject())
    return out


def build_fab(app: Path, fab: Path) -> str:
    """Write the bundle of ``app`` (``flwr build``'s bytes) to ``fab``; returns its SHA-256."""
    from flwr.cli.build import build_fab_from_disk

    data = build_fab_from_disk(app)
    fab.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class BuiltApp:
    """What ``build_app`` wrote: the app folder, its bundle beside it (``<app>.fab``) and the bundle's SHA-256."""

    app: Path
    fab: Path
    sha256: str


def build_app(out: Path) -> BuiltApp:
    """Write the app into ``out`` (``write_app``) and its bundle beside it, ``<out>.fab`` (``build_fab``)."""
    app = write_app(out)
    fab = app.with_name(app.name + ".fab")
    return BuiltApp(app=app, fab=fab, sha256=build_fab(app, fab))
