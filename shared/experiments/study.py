"""The privacy-utility study: a grid of runs read from one YAML file, expanded into cells with stable ids.

A study file (``configs/study.yaml``) names a base run config and the grid's axes: method x epsilon x clip x
strategy x setting (centralized | federated | reference) x seed, the non-private baselines and the ablations.
``expand`` turns it into ``Cell`` s, each with its resolved ``Config`` and an id hashing that config (output
paths left out) and its kind: a cell is done iff ``<out>/cells/<id>/metrics.json`` exists, so running a study
again resumes it. Running cells is ``shared/experiments/study_run.py`` (one subprocess per cell); tables and
figures are ``shared/experiments/study_report.py``.

``grids``: each puts its keys over the top-level axes (every method at one epsilon with three seeds, then an
epsilon sweep of two methods); a cell several grids name runs once. A grid's ``overrides`` (dotted keys, e.g.
another learning rate) go over the base config for its cells, which carry them as their ``variant``. The
``reference`` setting is a federation's reachable centralized reference: the pooled data with the sites' summed
batch (S x B), sqrt(S) times the noise multiplier (``privacy.noise_factor``) and one site's step count, so its
averaged gradient carries the noise of the federation's average.

Another axis (e.g. ``privacy.unit``) is a field of ``StudyAxes`` and of ``Cell``, one more loop in ``expand``
putting its value in with ``_cell``, and a column in ``COLUMNS``; cell ids need nothing (they hash the config).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from fedpose.shared.configuration.schema import Config, Strategy, config_from_dict, load_config, section_from_dict
from fedpose.shared.errors import ConfigError
from fedpose.shared.configuration.flat import flatten, flatten_plain, to_dict, unflatten
from fedpose.shared.configuration.yaml_io import read_yaml
from fedpose.shared.configuration.methods import METHODS, Method
from fedpose.shared.configuration.flat import identity_flat

Setting = Literal["centralized", "federated", "reference"]
Baseline = Literal["psi-only", "pretrained"]
SETTINGS: tuple[str, ...] = get_args(Setting)
BASELINES: tuple[str, ...] = get_args(Baseline)

# Keys that only say where a run writes: not part of a cell's identity.
_OUTPUT_KEYS = ("train.out", "federation.out")


@dataclass(frozen=True)
class StudyAxes:
    """The grid's values, checked like every config section (types, Literals, unknown keys)."""

    base: str
    methods: tuple[Method, ...] = METHODS
    epsilons: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8)
    clips: tuple[float, ...] = (0.01, 0.1, 1.0)
    strategies: tuple[Strategy, ...] = ("finetune", "full", "scratch")
    settings: tuple[Setting, ...] = ("centralized", "federated")
    seeds: tuple[int, ...] = (1, 2, 3)
    baselines: tuple[Baseline, ...] = ("psi-only", "pretrained")
    ablation_methods: tuple[Method, ...] = ("fpdp",)
    ablation_seeds: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        for name in ("methods", "epsilons", "clips", "strategies", "settings", "seeds", "ablation_methods",
                     "ablation_seeds"):
            values = getattr(self, name)
            if not values:
                raise ConfigError(f"study.{name}: list at least one value")
            repeated = [v for v in values if values.count(v) > 1]
            if repeated:
                raise ConfigError(f"study.{name}: {repeated[0]} is listed twice")
        for name in ("epsilons", "clips"):
            bad = [v for v in getattr(self, name) if not v > 0]
            if bad:
                raise ConfigError(f"study.{name}: every value must be > 0, got {bad[0]}")
        bad_seeds = [s for s in (*self.seeds, *self.ablation_seeds) if s < 0]
        if bad_seeds:
            raise ConfigError(f"study.seeds: seeds must be >= 0, got {bad_seeds[0]}")


@dataclass(frozen=True)
class Study:
    axes: StudyAxes
    base: Config  # the base run config with the study's overrides
    base_path: Path
    grids: tuple[StudyAxes, ...] = ()  # the file's grids, each over the top-level axes; () = the axes alone
    grid_overrides: tuple[tuple[tuple[str, Any], ...], ...] = ()  # per grid: (dotted key, value) over the base
    # name -> variants, each a tuple of (dotted key, value) put over the base config
    ablations: tuple[tuple[str, tuple[tuple[tuple[str, Any], ...], ...]], ...] = ()


@dataclass(frozen=True)
class Cell:
    """One run of the study: what it is (for the tables) and the config it runs."""

    id: str
    method: str  # a training method, or a baseline ("psi-only", "pretrained")
    setting: str
    strategy: str | None  # None: the pretrained baseline (no training)
    epsilon: float | None  # None: not private
    clip: float | None
    seed: int | None
    config: Config = field(repr=False)
    ablation: str = ""  # "" for the main grid
    variant: str = ""  # the ablation's overrides, e.g. "privacy.k=10"

    @property
    def kind(self) -> str:
        """What runs: train (centralized, incl. psi-only), federated (`fedpose simulate`), pretrained (eval only)."""
        if self.method == "pretrained":
            return "pretrained"
        return "federated" if self.setting == "federated" else "train"

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "method": self.method, "setting": self.setting,
                "strategy": self.strategy, "epsilon": self.epsilon, "clip": self.clip, "seed": self.seed,
                "ablation": self.ablation, "variant": self.variant}


# ---------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------


def load_study(path: str | Path, *, quick: bool = False) -> Study:
    """Read and validate a study file; ``quick`` puts its ``quick`` section over the top-level keys.

    ``base`` is relative to the study file. Every error is a ``ConfigError``
    naming the key (``study.epsilons``, ``study ablations.k[0]: ...``).
    """
    path = Path(path)
    raw = read_yaml(path, what="study file")
    if not isinstance(raw, dict):
        raise ConfigError(f"study file {path}: expected a mapping at top level, got {type(raw).__name__}")
    raw = dict(raw)
    quick_section = raw.pop("quick", None)
    if quick:
        if quick_section is None:
            raise ConfigError(f"study file {path} has no 'quick' section: --quick needs one")
        if not isinstance(quick_section, dict):
            raise ConfigError(f"study quick: expected a mapping, got {type(quick_section).__name__}")
        if "quick" in quick_section:
            raise ConfigError("study quick: a quick section cannot hold another one")
        raw.update(quick_section)
    overrides = _mapping(raw.pop("overrides", None) or {}, "study overrides")
    ablations_raw = _mapping(raw.pop("ablations", None) or {}, "study ablations")
    grids_raw = raw.pop("grids", None) or []
    if "base" not in raw:
        raise ConfigError("study.base: name the run config the grid varies (e.g. base: default.yaml)")
    axes = section_from_dict(StudyAxes, raw, "study")
    base_path = Path(axes.base).expanduser()
    if not base_path.is_absolute():
        base_path = path.parent / base_path
    try:
        base = load_config(base_path, flatten_plain(overrides))
    except ConfigError as err:
        raise ConfigError(f"study overrides over {base_path}: {err}") from err
    ablations = []
    for name, variants in ablations_raw.items():
        if not isinstance(variants, list) or not variants:
            raise ConfigError(f"study ablations.{name}: expected a list of variants (mappings of dotted keys)")
        resolved = []
        for i, variant in enumerate(variants):
            flat = flatten_plain(_mapping(variant, f"study ablations.{name}[{i}]"))
            try:
                with_variant(base, flat)
            except ConfigError as err:
                raise ConfigError(f"study ablations.{name}[{i}]: {err}") from err
            resolved.append(tuple(flat.items()))
        ablations.append((str(name), tuple(resolved)))
    grids, grid_overrides = _grids(grids_raw, raw, base)
    if "reference" in {s for g in (axes, *grids) for s in g.settings}:
        reference_values(base)  # the reference needs the sites' sizes: a clear error now, not in a cell
    return Study(axes=axes, base=base, base_path=base_path, ablations=tuple(ablations), grids=tuple(grids),
                 grid_overrides=tuple(grid_overrides))


def _grids(grids_raw: Any, raw: dict[str, Any], base: Config) -> tuple[list[StudyAxes], list[tuple]]:
    """The file's grids (each over the top-level keys ``raw``) and each grid's own overrides of ``base``."""
    if not isinstance(grids_raw, list):
        raise ConfigError(f"study grids: expected a list of mappings, got {type(grids_raw).__name__}")
    grids, grid_overrides = [], []
    for i, grid in enumerate(grids_raw):
        grid = _mapping(grid, f"study grids[{i}]")
        if "base" in grid:
            raise ConfigError(f"study grids[{i}]: a grid varies the study's base config; it cannot name another")
        grid = dict(grid)
        own = flatten_plain(_mapping(grid.pop("overrides", None) or {}, f"study grids[{i}].overrides"))
        try:
            with_variant(base, own)
        except ConfigError as err:
            raise ConfigError(f"study grids[{i}].overrides: {err}") from err
        grid_overrides.append(tuple(own.items()))
        try:
            grids.append(section_from_dict(StudyAxes, {**raw, **grid}, f"study grids[{i}]"))
        except ConfigError as err:  # the axes' own checks name "study.<field>": say which grid
            raise ConfigError(str(err) if str(err).startswith("study grids") else f"study grids[{i}]: {err}") \
                from err
    return grids, grid_overrides


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{what}: expected a mapping, got {type(value).__name__}")
    return value


def with_variant(cfg: Config, dotted: dict[str, Any]) -> Config:
    """``cfg`` with dotted keys put in, validated; unknown keys name their path."""
    flat = flatten(cfg)
    for key in dotted:
        if key not in flat and not any(k.startswith(key + ".") for k in flat):
            raise ConfigError(f"unknown config key {key}")
    return config_from_dict(unflatten({**flat, **dotted}))


# ---------------------------------------------------------------------------
# the grid
# ---------------------------------------------------------------------------


def cell_id(cfg: Config, *, kind: str) -> str:
    """Stable id of a run: the hash of its resolved config (output paths left out) and what runs."""
    flat = {k: v for k, v in identity_flat(cfg).items() if k not in _OUTPUT_KEYS}
    if kind == "pretrained":  # only the public pretraining decides the weights
        flat = {k: v for k, v in flat.items() if k.split(".")[0] in ("data", "model", "pretrain")}
    text = json.dumps({"kind": kind, "config": flat}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _cell(base: Config, *, method: str, setting: str, strategy: str | None, epsilon: float | None,
          clip: float | None, seed: int | None, ablation: str = "", variant: str = "") -> Cell:
    values: dict[str, Any] = {}
    if method == "psi-only":
        values.update({"train.method": "nonprivate", "train.images": "psi"})
    elif method != "pretrained":
        values["train.method"] = method
    if strategy is not None:
        values["train.strategy"] = strategy
    if epsilon is not None:
        values["privacy.epsilon"] = epsilon
    if clip is not None:
        values["privacy.clip_norm"] = clip
    if seed is not None:
        values["train.seed"] = seed
    if setting == "reference":
        values.update(reference_values(base))
    cfg = with_variant(base, values)
    kind = "pretrained" if method == "pretrained" else ("federated" if setting == "federated" else "train")
    return Cell(id=cell_id(cfg, kind=kind), method=method, setting=setting, strategy=strategy, epsilon=epsilon,
                clip=clip, seed=seed, config=cfg, ablation=ablation, variant=variant)


def reference_values(base: Config) -> dict[str, Any]:
    """The reference setting's overrides: batch S x B, noise x sqrt(S), a site's step count in the federation (to
    the nearest whole epoch). Needs equal-sized sites of known size (the synthetic ward)."""
    if base.data.source != "synthetic":
        raise ConfigError("study settings: the reference setting needs the sites' sizes (data.source: synthetic)")
    sites = len(base.data.train_splits)
    batch = base.train.batch_size * sites
    per_epoch = math.ceil(sites * base.data.synth.per_site / batch)
    epochs = max(1, round(base.federation.rounds * base.federation.local_steps / per_epoch))
    return {"train.batch_size": batch, "train.epochs": epochs, "privacy.noise_factor": math.sqrt(sites)}


def expand(study: Study) -> list[Cell]:
    """Every cell of the study, cheapest kinds first: baselines, centralized grid, federated grid, ablations.

    nonprivate ignores epsilon and clip (one cell per strategy and seed) and,
    like the baselines, runs centralized only: a federation trains privately
    (the site policy never accepts nonprivate). Ablation cells may share an
    id with a grid cell (the base variant): they are listed again under their
    ablation and run once.
    """
    cells: list[Cell] = []
    seen: set[str] = set()

    def add(cell: Cell) -> None:
        if cell.ablation or cell.id not in seen:
            seen.add(cell.id)
            cells.append(cell)

    for ax, own in zip(study.grids, study.grid_overrides) if study.grids else [(study.axes, ())]:
        base = with_variant(study.base, dict(own)) if own else study.base
        _expand_grid(base, ax, add, variant=", ".join(f"{k}={v}" for k, v in own))
    ax = study.axes
    for name, variants in study.ablations:
        for variant in variants:
            base = with_variant(study.base, dict(variant))
            label = ", ".join(f"{k}={v}" for k, v in variant)
            for method in ax.ablation_methods:
                private_method = method != "nonprivate"
                for seed in ax.ablation_seeds:
                    add(_cell(base, method=method, setting="centralized", strategy=base.train.strategy,
                              epsilon=base.privacy.epsilon if private_method else None,
                              clip=base.privacy.clip_norm if private_method else None, seed=seed,
                              ablation=name, variant=label))
    return [_isolate_caches(c, study.base) for c in cells]


def _expand_grid(base: Config, ax: StudyAxes, add: Any, *, variant: str) -> None:
    """One grid's cells (baselines, then the private methods per setting) passed to ``add``."""
    if "pretrained" in ax.baselines:
        add(_cell(base, method="pretrained", setting="centralized", strategy=None, epsilon=None, clip=None,
                  seed=None, variant=variant))
    for strategy in ax.strategies:
        for seed in ax.seeds:
            if "nonprivate" in ax.methods:
                add(_cell(base, method="nonprivate", setting="centralized", strategy=strategy, epsilon=None,
                          clip=None, seed=seed, variant=variant))
            if "psi-only" in ax.baselines:
                add(_cell(base, method="psi-only", setting="centralized", strategy=strategy, epsilon=None,
                          clip=None, seed=seed, variant=variant))
    private = [m for m in ax.methods if m != "nonprivate"]
    for setting in ax.settings:
        for strategy in ax.strategies:
            for clip in ax.clips:
                for epsilon in ax.epsilons:
                    for method in private:
                        for seed in ax.seeds:
                            add(_cell(base, method=method, setting=setting, strategy=strategy,
                                      epsilon=epsilon, clip=clip, seed=seed, variant=variant))


def _isolate_caches(cell: Cell, base: Config) -> Cell:
    """Give a cell whose data or model differs from the base its own data root / pretrained weights.

    Cells run in parallel share the base's cached data and weights; a variant changing them (another model,
    public style) would otherwise overwrite the shared cache. Paths derive from the cached artefact's own config,
    so variants that agree share them; the cell id is unchanged (computed before)."""
    def cache_key(c: Config) -> dict[str, Any]:  # what the cached data and weights depend on (not where they are)
        key = {s: to_dict(getattr(c, s)) for s in ("data", "model", "pretrain")}
        key["data"].pop("root")
        key["pretrain"].pop("out")
        return key

    # A variant that names its own data root or weights folder keeps it (used as given).
    cfg, values = cell.config, {}
    mine = cache_key(cfg)
    if cfg.data.root == base.data.root and mine["data"] != cache_key(base)["data"]:
        digest = hashlib.sha256(json.dumps(mine["data"], sort_keys=True).encode()).hexdigest()[:10]
        values["data.root"] = str(Path(base.data.root).parent / f"study-data-{digest}")
    if cfg.pretrain.out == base.pretrain.out and mine != cache_key(base):
        digest = hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).hexdigest()[:10]
        values["pretrain.out"] = str(Path(base.pretrain.out).parent / f"study-pretrained-{digest}")
    if not values:
        return cell
    return dataclasses.replace(cell, config=with_variant(cfg, values))


# ---------------------------------------------------------------------------
# results of cells
# ---------------------------------------------------------------------------

GROUPS: tuple[str, ...] = ("head", "shoulder", "elbow", "wrist", "hip", "knee", "ankle")
COLUMNS: tuple[str, ...] = ("cell_id", "setting", "method", "strategy", "epsilon", "clip", "seed", "ablation",
                            "variant", *GROUPS, "mean", "mean@0.1", "eps_spent", "seconds")


def cell_dir(out: str | Path, cell: Cell) -> Path:
    return Path(out) / "cells" / cell.id


def is_done(out: str | Path, cell: Cell) -> bool:
    return (cell_dir(out, cell) / "metrics.json").is_file()


def cell_row(cell: Cell, metrics: dict[str, Any]) -> dict[str, Any]:
    """One CSV row: the cell's point, PCKh per joint group, mean, mean@0.1, epsilon spent, seconds."""
    pckh = metrics["pckh"]
    eps = metrics.get("epsilon")
    row: dict[str, Any] = {
        "cell_id": cell.id, "setting": cell.setting, "method": cell.method, "strategy": cell.strategy,
        "epsilon": cell.epsilon, "clip": cell.clip, "seed": cell.seed, "ablation": cell.ablation,
        "variant": cell.variant,
    }
    row.update({g: float(pckh[g]) for g in GROUPS})
    row["mean"] = float(pckh["mean"])
    row["mean@0.1"] = float(metrics["pckh@0.1"]["mean"])
    row["eps_spent"] = float(eps) if eps is not None and math.isfinite(float(eps)) else None
    row["seconds"] = float(metrics.get("seconds", 0.0))
    return row


def collect(out: str | Path, cells: list[Cell]) -> list[dict[str, Any]]:
    """Rows of every finished cell, in the study's order (unfinished cells are left out)."""
    rows = []
    for cell in cells:
        path = cell_dir(out, cell) / "metrics.json"
        if path.is_file():
            rows.append(cell_row(cell, json.loads(path.read_text())))
    return rows
