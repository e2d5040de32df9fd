"""A site's local optimizer state kept across federated rounds (``federation.site_optimizer: keep``).

A fresh Adam every round restarts its bias correction: the first steps of each
round are full lr-sized steps along a mostly-noise DP gradient, and with 10
local steps per round the model random-walks. Keeping the moments across
rounds makes the federation behave like one long private run.

Privacy: the state is a function of the site's own DP-noised gradients (and of
the global weights it received), i.e. post-processing of what the site's
accountant already counts; it never leaves the site. It is stored next to the
site's ledger, keyed by federation id, and written atomically after the round's
ledger commit. A restarted site continues with what is on disk; a round whose
state was not saved (crash after the ledger commit) continues from the previous
round's state.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from fedpose.shared.configuration.schema import Config, TrainConfig


def state_path(ledger_path: str | Path, federation: str) -> Path:
    """``<ledger dir>/optimizer/<federation>.pt``."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", federation)
    return Path(ledger_path).parent / "optimizer" / f"{safe}.pt"


def save_state(path: str | Path, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], kind: str) -> None:
    """Write the optimizer state with the shapes of its parameters (temp file + rename: atomic)."""
    from fedpose.shared.private_files import open_private, private_dir

    path = Path(path)
    private_dir(path.parent, own=True)  # a site's state: its own account only (0700, the file 0600)
    blob = {"kind": kind, "shapes": [list(p.shape) for p in params], "state": optimizer.state_dict()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb", opener=open_private) as fh:
        torch.save(blob, fh)
    tmp.replace(path)


def load_state(path: str | Path, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], kind: str) -> bool:
    """Load a saved state into ``optimizer``; False when there is none. ValueError when it does not fit."""
    path = Path(path)
    if not path.is_file():
        return False
    blob = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(blob, dict) or not {"kind", "shapes", "state"} <= blob.keys():
        raise ValueError(f"optimizer state {path} is not a fedpose optimizer state; delete it to start afresh")
    if blob["kind"] != kind:
        raise ValueError(f"optimizer state {path} is for {blob['kind']!r}, this run uses {kind!r}; "
                         "delete it to start afresh")
    want = [list(p.shape) for p in params]
    if [list(s) for s in blob["shapes"]] != want:
        raise ValueError(f"optimizer state {path} was saved for {len(blob['shapes'])} parameters of other shapes "
                         f"than the {len(want)} trainable ones here (strategy or model changed?); "
                         "delete it to start afresh")
    optimizer.load_state_dict(blob["state"])
    return True


def trainable_params(model: torch.nn.Module, trainable: list[str]) -> list[torch.Tensor]:
    """The parameters in the order ``fedpose.shared.training.loop.local_train`` gives them to its optimizer."""
    named = dict(model.named_parameters())
    return [named[name] for name in trainable]


def site_optimizer(cfg: Config, model: torch.nn.Module, trainable: list[str], ledger_path: str | Path,
                   federation: str) -> torch.optim.Optimizer | None:
    """The optimizer for this round: None (``fresh``: local_train makes one) or the kept one, loaded from disk."""
    if cfg.federation.site_optimizer != "keep":
        return None
    from fedpose.shared.training.schedule import make_optimizer

    params = trainable_params(model, trainable)
    opt = make_optimizer(params, cfg.train)
    load_state(state_path(ledger_path, federation), opt, params, _kind(cfg.train))
    return opt


def keep_site_optimizer(cfg: Config, optimizer: torch.optim.Optimizer | None, model: torch.nn.Module,
                        trainable: list[str], ledger_path: str | Path, federation: str) -> None:
    """Save the state after the round (no-op for ``fresh``)."""
    if optimizer is None or cfg.federation.site_optimizer != "keep":
        return
    save_state(state_path(ledger_path, federation), optimizer, trainable_params(model, trainable), _kind(cfg.train))


def _kind(train: TrainConfig) -> str:
    return train.optimizer
