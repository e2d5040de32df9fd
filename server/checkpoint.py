"""Server checkpoint: global weights + ledger snapshot + round in ONE file, written atomically.

The file is written to a temporary sibling, fsynced and renamed over the
previous one, so a killed server leaves either the old or the new
checkpoint, never a mix. The server optimizer's moments (FedAvgM / FedAdam) are in
it too, so a resumed federation takes the same steps. ``--resume`` loads it, reconciles the SQLite
ledger with the snapshot (``fedpose.server.ledger.reconcile``) and continues at
``round + 1``: completed rounds are neither lost nor counted twice.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

FORMAT = 1


@dataclass
class ServerState:
    round: int  # last completed round
    federation: str  # id sent to sites (their ledgers and basis caches are keyed by it)
    weights: dict[str, torch.Tensor]
    ledger: dict[str, Any]  # ServerLedger.snapshot() after that round
    history: list[dict[str, Any]]  # rounds.jsonl records so far
    optimizer: dict[str, Any] | None = None  # ServerOptimizer.state_dict() (FedAvgM / FedAdam moments)


def save_state(path: str | Path, state: ServerState) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT,
        "round": int(state.round),
        "federation": state.federation,
        "weights": {k: v.detach().cpu() for k, v in state.weights.items()},
        "ledger": state.ledger,
        "history": state.history,
        "optimizer": state.optimizer,
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        torch.save(payload, fh)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    log.info("checkpoint after round %d: %s", state.round, path)


def load_state(path: str | Path) -> ServerState:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no server checkpoint at {path}: nothing to resume (run without --resume)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for corrupt files
        raise ValueError(f"server checkpoint {path} cannot be read: {err}") from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path} is not a fedpose server checkpoint (format {FORMAT})")
    return ServerState(
        round=int(payload["round"]), federation=str(payload["federation"]), weights=payload["weights"],
        ledger=payload["ledger"], history=list(payload["history"]), optimizer=payload.get("optimizer"),
    )
