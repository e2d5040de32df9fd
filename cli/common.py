"""What the command modules share: the options every command takes (``--config``/``--set``, ``--json``,
``--quiet``/``--verbose``), the config they resolve to, and the lines a run's result is printed with.

Imported by ``fedpose.cli.main`` and by every command module it registers: it imports nothing of theirs, and
nothing heavy (the config is read inside ``load_cli_config``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

DEFAULT_CONFIG = "default"  # configs/default.yaml, shipped with fedpose (any command takes a name or a path)


def parse_sets(items: Sequence[str] | None) -> dict[str, Any]:
    """``--set key=value`` pairs (the value read as YAML: 0.5, true, [64, 48], null) as dotted overrides."""
    from fedpose.shared.errors import ConfigError
    from fedpose.shared.configuration.yaml_io import parse_yaml

    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip() or " " in key.strip():
            raise ConfigError(f"--set {item!r}: expected key=value with a dotted key, e.g. --set train.lr=0.0005")
        out[key.strip()] = parse_yaml(raw, what=f"--set {key.strip()}") if raw.strip() else ""
    return out


def load_cli_config(args: argparse.Namespace, overrides: dict[str, Any] | None = None, *, path: Any = None) -> Any:
    """The command's config: its --config (a file or a shipped name), then its --set pairs, then ``overrides``
    (the command's own flags that were given)."""
    from fedpose.shared.configuration.schema import load_config

    merged = {**parse_sets(getattr(args, "set", None)),
              **{k: v for k, v in (overrides or {}).items() if v is not None}}
    return load_config(path if path is not None else args.config, merged)


def emit_json(args: argparse.Namespace, payload: Any) -> bool:
    """With ``--json``: print the command's result as one JSON object on stdout (instead of the summary)."""
    if not getattr(args, "json", False):
        return False
    print(json.dumps(payload, indent=1, default=str))
    return True


def add_json(p: argparse.ArgumentParser, what: str = "the result (metrics.json's content)") -> None:
    p.add_argument("--json", action="store_true", help=f"print {what} as one JSON object instead of the summary")


def data_line(metrics: dict[str, Any]) -> str:
    """One line naming the data and the software a run's numbers came from (metrics.json has the rest)."""
    data, prov = metrics["data"], metrics["provenance"]
    commit = (prov.get("commit") or "unknown")[:10] + ("+changes" if prov.get("dirty") else "")
    return (f"data: {data['source']} at {data['root']} (digest {data['digest'][:12]}); torch "
            f"{prov['versions'].get('torch')}, {prov['threads']} threads, commit {commit}")


def add_config(p: argparse.ArgumentParser, *, default: str = DEFAULT_CONFIG, help: str | None = None) -> None:
    """--config and --set, the same on every command that takes a config."""
    p.add_argument("--config", default=default,
                   help=help or f"a YAML config file, or the name of a shipped one (default {default})")
    p.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                   help="override one config value, e.g. --set train.lr=0.0005 (repeat; YAML values)")


def add_common(p: argparse.ArgumentParser, *, config: bool = True) -> None:
    """--config and --set (unless ``config`` is False), --quiet and --verbose."""
    if config:
        add_config(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--verbose", action="store_true", help="debug logging")
