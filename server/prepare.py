"""What the server needs before a federation, as explicit steps: ``fedpose server prepare``.

The ServerApp needs three things, all public: the public split (it computes the projection
basis V from it in broadcast mode, and the sites pin it by digest), a validation split to
evaluate the global model after each round, and the public pretrained weights the federation
starts from. ``prepare_server`` makes or checks each one, with progress output, and writes a
config with absolute paths; ``require_prepared`` is what the ServerApp runs first, so that a
server that was not prepared stops at once with the command to run, instead of generating data
in whatever directory its SuperLink was started from and pretraining for minutes in silence.
``export_public`` writes the public split as one archive, with its digest, for the sites: each site unpacks
its copy and approves it by that digest (``fedpose site approve-public --digest``).

What the server can evaluate on: only data it may hold, i.e. public data (a held-out part of
the public set, or a public benchmark's validation split). It never sees a site's images. The
sites evaluate the global model on their own held-out data themselves (``eval_path`` in a
site policy); those numbers stay at the site (client/evaluation.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from fedpose.shared.configuration.schema import Config, dump_config, replace
from fedpose.shared.errors import ConfigError


def absolute_paths(cfg: Config, base: str | Path | None = None) -> Config:
    """The config with its data, pretrained-weights and results paths made absolute: a relative path is taken
    under ``base`` (default: the working directory)."""
    root = Path.cwd() if base is None else Path(base).expanduser().resolve()

    def under(value: str) -> str:
        path = Path(value).expanduser()
        return str((path if path.is_absolute() else root / path).resolve())

    return replace(cfg, **{"data.root": under(cfg.data.root), "pretrain.out": under(cfg.pretrain.out),
                           "federation.out": under(cfg.federation.out)})


def require_prepared(cfg: Config, *, config_path: str = "<this run's config>") -> None:
    """Refuse to start a federation whose public data or pretrained weights are missing, or whose
    paths are relative (they would depend on the directory the SuperLink was started from)."""
    from fedpose.shared.data.mpii import load_split
    from fedpose.shared.training.runs import pretrained_problem

    root = Path(cfg.data.root).expanduser().resolve()
    fix = f"prepare the server first: fedpose server prepare --config {config_path} --out DIR"
    problems = [f"{key} = {value!r} is relative (it would resolve against this process's working directory "
                f"{Path.cwd()})" for key, value in (("data.root", cfg.data.root), ("pretrain.out", cfg.pretrain.out))
                if not Path(value).expanduser().is_absolute()]
    for what, split in (("public split", cfg.data.public_split), ("validation split", cfg.data.val_split)):
        try:
            if not load_split(root, split):
                problems.append(f"the {what} {root / split} is empty")
        except (OSError, ValueError) as err:
            problems.append(f"the {what} {root / split} cannot be read ({err})")
    if cfg.train.strategy != "scratch":
        problem = pretrained_problem(cfg)
        if problem is not None:
            problems.append(problem)
    if problems:
        raise ConfigError("the server is not prepared: " + "; ".join(problems) + f"; {fix}")


def prepare_server(cfg: Config, out: str | Path, *, progress: bool = True,
                   echo: Callable[[str], None] = print) -> Path:
    """Make or check the public split, the validation split and the pretrained weights; write
    ``out/server.yaml`` (absolute paths). The config's relative paths (data, pretrained weights, results)
    are taken under ``out``, so everything the server needs lies there. Returns the config's path."""
    from fedpose.shared.data.mpii import load_split
    from fedpose.shared.data.split import check_disjoint, check_no_duplicates, manifest_digest
    from fedpose.shared.training.runs import ensure_data, pretrained_problem, run_pretrain

    out = Path(out).expanduser().resolve()
    cfg = absolute_paths(cfg, out)
    root = Path(cfg.data.root)
    generated = not root.exists()
    echo(f"[1/3] public data under {root}" + (" (generating the synthetic ward)" if generated else ""))
    t0 = time.perf_counter()
    ensure_data(cfg, progress=progress)
    public = load_split(root, cfg.data.public_split)
    val = load_split(root, cfg.data.val_split)
    if not public or not val:
        empty = cfg.data.public_split if not public else cfg.data.val_split
        raise ConfigError(f"split {root / empty} is empty: the server needs public and validation records")
    check_no_duplicates(public, what=f"the public split {cfg.data.public_split}")
    check_disjoint(public, val)  # a validation image that is also in S_pub would flatter every round
    echo(f"      public split      {root / cfg.data.public_split}: {len(public)} records, "
         f"digest {manifest_digest(public)} (each site pins this value as public_digest)")
    echo(f"      validation split  {root / cfg.data.val_split}: {len(val)} records, evaluated after every "
         "round; it must be public data, never a site's records")
    echo(f"      {time.perf_counter() - t0:.0f} s")
    if cfg.train.strategy == "scratch":
        echo("[2/3] pretrained weights: none needed (train.strategy = scratch)")
    else:
        path = Path(cfg.pretrain.out) / "model.pt"
        problem = pretrained_problem(cfg)
        if problem is None:
            echo(f"[2/3] pretrained weights {path}: present, made with this config")
        else:
            echo(f"[2/3] pretrained weights: {problem}; pretraining on the public split only "
                 f"({cfg.pretrain.epochs} epochs)")
            t0 = time.perf_counter()
            metrics = run_pretrain(cfg, progress=progress)
            echo(f"      {path}: PCKh@0.5 {metrics['pckh']['mean']:.2f} on the validation split, "
                 f"{time.perf_counter() - t0:.0f} s")
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "server.yaml"
    dump_config(cfg, config_path)
    echo(f"[3/3] server config {config_path} (absolute paths)")
    echo("      send the sites the public split: fedpose server export-public --config "
         f"{config_path} --out {out / PUBLIC_ARCHIVE}")
    echo("      once the sites run, start the federation with: fedpose server run --connection pilot --app "
         f"{out / 'app'} --config {config_path} --out {out / 'run1'}")
    return config_path


PUBLIC_ARCHIVE = "public-split.tar.gz"
PUBLIC_FOLDER = "public-split"  # the folder the archive unpacks to


def export_public(cfg: Config, out: str | Path, *, echo: Callable[[str], None] = print) -> str:
    """Write the config's public split (its whole folder: annotations, images, sidecars) as the gzipped tar
    ``out``, unpacking to ``public-split/``, and print its digest: the value each site approves its copy by.
    Returns the digest. Only the server's prepared public split goes in; it is checked first as ``prepare``
    checks it (no image twice), so a site is never sent a set the server itself would refuse."""
    import os
    import tarfile

    from fedpose.shared.data.mpii import load_split
    from fedpose.shared.data.split import check_no_duplicates, manifest_digest

    root = Path(cfg.data.root).expanduser().resolve()
    split = root / cfg.data.public_split
    if not (split / "annotations.json").is_file():
        raise ConfigError(f"the public split {split} is not there (no annotations.json): prepare the server first, "
                          "fedpose server prepare --config CONFIG --out DIR, then export the config it wrote")
    records = load_split(root, cfg.data.public_split)
    if not records:
        raise ConfigError(f"the public split {split} has no records")
    check_no_duplicates(records, what=f"the public split {split}")
    digest = manifest_digest(records)
    out = Path(out).expanduser().resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(split, arcname=PUBLIC_FOLDER, filter=lambda info: info if info.isfile() or info.isdir() else None)
    os.replace(partial, out)
    images = len({r.image for r in records})
    echo(f"public split {split}: {len(records)} annotated people in {images} images -> {out} "
         f"({out.stat().st_size / 1e6:.1f} MB)")
    echo(f"digest {digest}")
    echo(f"send each site {out.name} and this digest (the digest by a second channel: the site approves only a copy "
         "whose images match it). At the site:\n"
         f"  tar -xzf {out.name} -C <the site's folder>\n"
         f"  fedpose site approve-public --policy policy.yaml --digest {digest} <the site's folder>/{PUBLIC_FOLDER}")
    return digest

