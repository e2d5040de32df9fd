"""The one YAML reader and writer of the project (configs, site policies, run-config overrides), and the
atomic JSON writer of its results (``write_json``).

Strict on input: UTF-8 only, bounded size, no aliases, no duplicate keys, ``1e-5`` read as a
float (YAML 1.2 float syntax); never writes anchors or aliases.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from fedpose.shared.errors import ConfigError

# Largest YAML file (config, site policy) read: real ones are a few KB.
MAX_YAML_BYTES = 1 << 20

_FLOAT_TAG = "tag:yaml.org,2002:float"
# YAML 1.2's float syntax: PyYAML (YAML 1.1) reads ``1e-5`` (no dot) as a string.
_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-5`` as a float and refuses aliases and duplicate keys.

    Aliases (``*name``) are refused outright: they are never needed in a fedpose
    file and a few hundred bytes of nested aliases expand to gigabytes
    ("billion laughs") once anything walks the data.
    """

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != _FLOAT_TAG]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"YAML aliases (*{event.anchor}) are not accepted", event.start_mark
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:  # an unhashable key: SafeLoader's own error follows
                    break
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"duplicate key {key!r} (the later value would silently win)", key_node.start_mark,
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


_StrictLoader.add_implicit_resolver(_FLOAT_TAG, _FLOAT_RE, list("-+0123456789."))


def parse_yaml(text: str, *, what: str) -> Any:
    """Parse YAML text with the strict loader; errors are ``ConfigError`` naming ``what``."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise ConfigError(f"{what} is not valid YAML: {err}") from err
    except RecursionError as err:
        raise ConfigError(f"{what} is nested too deeply") from err


def read_yaml(path: str | Path, *, what: str) -> Any:
    """Parse a YAML file; errors name ``what`` and the file (``ConfigError``, a ValueError).

    The one YAML reader of the project (configs, site policies, run-config
    overrides): UTF-8 only, at most ``MAX_YAML_BYTES``, no aliases, no
    duplicate keys, ``1e-5`` read as a float (YAML 1.2 float syntax).
    """
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_YAML_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"cannot read {what} {path}: {err.strerror or err}") from err
    if len(raw) > MAX_YAML_BYTES:
        raise ConfigError(f"{what} {path} is too large (over {MAX_YAML_BYTES} bytes)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte {err.start}): {err.reason}") from err
    return parse_yaml(text, what=f"{what} {path}")


class _NoAliasDumper(yaml.SafeDumper):
    """Never writes anchors/aliases (the strict reader refuses them)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def yaml_text(data: Any) -> str:
    """Plain data as YAML text (no aliases, keys in order)."""
    return yaml.dump(data, Dumper=_NoAliasDumper, sort_keys=False)


def dump_yaml(data: Any, path: str | Path) -> None:
    """Write plain data as YAML (no aliases, keys in order)."""
    Path(path).write_text(yaml_text(data))


def write_json(path: str | Path, obj: Any) -> None:
    """``obj`` as indented JSON at ``path``, written to a temporary file and renamed: never half a file."""
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False))
    tmp.replace(path)
