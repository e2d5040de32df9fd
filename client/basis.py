"""The projection basis V at the site: received and checked, cached by version, or computed from the
site's copy of the public set at the received global weights (P2).

The cache (``basis-cache/`` beside the site's ledger) holds the latest V of a federation while it runs, p x k
float32 (about 180 MB for the default model), and nothing of it once its last round is done.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedpose.client.policy import SitePolicy
from fedpose.client.data import load_public
from fedpose.shared.flower.messages import BASIS, Refusal, RefusalCode, TrainRequest, record_basis
from fedpose.shared.private_files import open_private, private_dir
from fedpose.shared.privacy.step.subspace import check_orthonormal

if TYPE_CHECKING:  # the model module is imported where it is used
    from fedpose.shared.model.posenet import PoseNet

_CACHE_NAME = re.compile(r"(?P<federation>[A-Za-z0-9_.-]+)-v(?P<version>[0-9]+)\.npy")


def _cache_path(policy: SitePolicy, federation: str, version: int) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", federation)
    return Path(policy.ledger_path).parent / "basis-cache" / f"{safe}-v{version}.npy"


def cache_basis(policy: SitePolicy, federation: str, version: int, basis: torch.Tensor) -> None:
    """Keep the latest V of a federation on disk (atomic), dropping older versions."""
    path = _cache_path(policy, federation, version)
    private_dir(path.parent, own=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb", opener=open_private) as fh:  # 0600 whatever the umask
        np.save(fh, basis.detach().cpu().numpy(), allow_pickle=False)
    tmp.replace(path)
    mine = path.name.rsplit("-v", 1)[0]
    for old in path.parent.glob("*.npy"):  # this federation's older versions: its exact id, never a prefix
        match = _CACHE_NAME.fullmatch(old.name)
        if old != path and match is not None and match["federation"] == mine:
            old.unlink(missing_ok=True)


def drop_basis_cache(policy: SitePolicy, federation: str) -> None:
    """Forget every cached V of ``federation`` (after its last round: nothing asks for them again)."""
    folder = _cache_path(policy, federation, 0).parent
    if not folder.is_dir():
        return
    private_dir(folder, own=True)  # narrowed like every folder the site writes in (an older fedpose left 0755)
    mine = _cache_path(policy, federation, 0).name.rsplit("-v", 1)[0]
    for old in folder.glob("*.npy"):
        match = _CACHE_NAME.fullmatch(old.name)
        if match is not None and match["federation"] == mine:
            old.unlink(missing_ok=True)


def cached_basis(policy: SitePolicy, federation: str, version: int) -> torch.Tensor | None:
    path = _cache_path(policy, federation, version)
    if not path.is_file():
        return None
    # column by column, as a step projects with it (caches written row by row before are laid out again)
    return torch.from_numpy(np.asfortranarray(np.load(path, allow_pickle=False), dtype=np.float32))


def check_basis(basis: torch.Tensor, *, p: int, k: int) -> None:
    """Refuse a V that is not (p, k') with 1 <= k' <= k, not finite, or without orthonormal columns (to 1e-3).

    Fewer than k columns is what the server sends when the public gradients span fewer directions
    (``compute_basis``): a projection onto fewer orthonormal directions is still post-processing of the noised sum.
    """
    if basis.dim() != 2 or basis.shape[0] != p or not 1 <= basis.shape[1] <= k:
        raise Refusal(
            RefusalCode.BAD_BASIS,
            f"basis has shape {tuple(basis.shape)}, expected ({p}, k') with 1 <= k' <= {k} for the trainable "
            "parameters of this strategy",
        )
    if not bool(torch.isfinite(basis).all()):
        raise Refusal(RefusalCode.BAD_BASIS, "basis contains NaN or Inf")
    try:
        check_orthonormal(basis, tol=1e-3)
    except ValueError as err:
        raise Refusal(RefusalCode.BAD_BASIS, str(err)) from err


def obtain_basis(content: Any, request: TrainRequest, model: PoseNet, trainable: list[str],
                 policy: SitePolicy) -> tuple[torch.Tensor, float]:
    """V for this round: received (checked), cached by version, or computed here (basis_mode site).

    Nothing is written here: ``handle_train`` caches V only once the round is recorded, so a server
    cannot fill the site's disk with bases under new federation ids while every request is refused.
    """
    cfg = request.config
    named = dict(model.named_parameters())
    p = sum(named[name].numel() for name in trainable)
    k = cfg.privacy.k
    if BASIS in content.array_records:
        try:
            version, basis = record_basis(content[BASIS])
        except ValueError as err:
            raise Refusal(RefusalCode.BAD_BASIS, str(err)) from err
        if version != request.basis_version:
            raise Refusal(RefusalCode.BAD_BASIS, f"basis version {version} != requested {request.basis_version}")
        check_basis(basis, p=p, k=k)
        return basis, 0.0
    cached = cached_basis(policy, request.federation, request.basis_version)
    if cached is not None:
        check_basis(cached, p=p, k=k)
        return cached, 0.0
    if request.basis_mode == "broadcast":
        raise Refusal(RefusalCode.NEED_BASIS, f"basis version {request.basis_version} is not cached here; send V")
    # basis_mode "site": V from the site's copy of the PUBLIC set at the received global weights (P2).
    public = load_public(policy)  # approved by digest and disjoint from the private data (the site's checks)
    if public is None:
        raise Refusal(RefusalCode.POLICY, "basis_mode 'site' needs public_path in the site policy")
    from fedpose.shared.model.pose_loss import make_loss_fn
    from fedpose.shared.training.batches import make_dataset
    from fedpose.shared.privacy.step.subspace import public_basis_at

    t0 = time.perf_counter()
    device = next(model.parameters()).device
    basis = public_basis_at(model, make_loss_fn(model, trainable), trainable,
                            make_dataset(public, cfg, train=False), cfg.privacy, device).cpu()
    seconds = time.perf_counter() - t0
    check_basis(basis, p=p, k=k)
    return basis, seconds
