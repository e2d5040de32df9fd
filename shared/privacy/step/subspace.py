"""Gradient subspace for projected DP-SGD (FP-DP Algorithm 1, "g = V (V^T g)"), the per-tensor gradient scales
from public data, and both computed from a run's public set at the current weights.

The server computes per-sample gradients of the full loss on the public set
S_pub at the current global weights (invariant P2: nothing from any site),
stacks them as G (m x p, one row per public sample), and sends the top-k
left singular vectors V (p x k, orthonormal columns) of G^T. Projecting the
noisy private gradient onto span(V) keeps k of the p noise dimensions, which
is the k/p noise-variance reduction of the paper. The projection is
post-processing of the already-noised gradient, so it costs no privacy (P1).

We never form a p x p matrix: with K = G G^T (m x m) = U S^2 U^T we get the
right singular vectors of G, i.e. the left singular vectors of G^T, as
V = G^T U_k S_k^{-1}. Each column block of G contributes a float32 product
(fast BLAS) that is summed into a float64 Gram matrix; eigh runs in float64,
so memory is m x p (float32, G itself) + m x m.

Everyone who turns a parameter dict into a vector uses ``flat_vector`` /
``from_flat_vector`` here, with the parameters in sorted-name order, so the server's
V and the sites' gradients agree coordinate by coordinate.

Per-tensor gradient scales from public data (``train.tensor_scales: public``).

The weights of a pose network take gradients of very different sizes: at the proxy ward's public start the mean
gradient's RMS per tensor ranges from 2e-5 (stage-3 attention) to 0.5 (the task-uncertainty weights). Clipped as
one vector, a record's gradient then spends its bound C on its few largest tensors, and the public basis V is
built from the same lopsided gradients: 48 of 101 tensors keep a cosine under 0.3 with their own clipped gradient
once projected (benchmarks/projection_per_tensor.py). Adam hides that without DP by dividing each coordinate by
its running RMS, which under DP scales the noise too.

Here every tensor t is scaled by a_t = c / rms_t before clipping, with rms_t its per-sample gradients' RMS on
public data at the current weights and c their RMS over all coordinates: on public data every tensor then has the
same RMS c, and the overall scale is kept, so C means what it meant. The private step clips sum_i clip(a * g_i, C),
adds N(0, sigma^2 C^2 I), projects onto the V of the scaled public gradients and hands the result to the optimizer
as the step direction: the signal is preconditioned per tensor, the noise is not (Li et al. 2022, "Private
adaptive optimization with side information", per tensor). The scales are a function of public data and the
weights only (P2), so one record still changes the noisy sum by at most C: the accountant's input is unchanged.
Measured, it does not lift proj under SGD (docs/results/index.md, per-tensor steps under DP): spread evenly over
the tensors, the gradient no longer fits V's few directions.

A training step, the server and a site compute V (and the scales) with ``public_basis_at``,
``public_scaled_basis_at`` and ``public_scales_at``: the trained weights and the first m public samples on
the device, then ``compute_basis`` (``compute_scaled_basis``, ``public_scales``) on them; P2: public data only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from fedpose.shared.errors import NonFinitePublicGradients
from fedpose.shared.privacy.step.bookkeeping import per_sample_chunks
from fedpose.shared.privacy.step.persample import LossFn, batch_size_of, check_params
from fedpose.shared.training.allocator import keep_freed_memory
from fedpose.shared.training.batches import to_device

if TYPE_CHECKING:
    from fedpose.shared.configuration.schema import PrivacyConfig
    from fedpose.shared.data.dataset import PoseDataset
    from fedpose.shared.model.posenet import PoseNet

log = logging.getLogger(__name__)

# Columns of G per float32 partial product of the Gram matrix: bounds the
# float32 rounding of each partial sum (it is then accumulated in float64), and
# keeps the block (m x c) in cache while its product is formed.
_COLUMN_BLOCK = 1 << 14

# Eigenvalues of G G^T below DEFAULT_RTOL * max are treated as zero (rank
# deficiency): those directions have singular value < 1e-3 of the top one,
# i.e. they are numerical noise of float32 gradients, not signal.
DEFAULT_RTOL = 1e-6


def flat_vector(tensors: Mapping[str, Tensor]) -> Tensor:
    """Concatenate a parameter dict into one vector (p,), names in sorted order."""
    if not isinstance(tensors, Mapping) or len(tensors) == 0:
        raise ValueError("flat_vector needs a non-empty dict of tensors")
    return torch.cat([tensors[name].reshape(-1) for name in sorted(tensors)])


def flat_vector_per_sample(tensors: Mapping[str, Tensor]) -> Tensor:
    """{name: (B, *shape)} -> (B, p), same sorted-name order as ``flat_vector``."""
    if not isinstance(tensors, Mapping) or len(tensors) == 0:
        raise ValueError("flat_vector_per_sample needs a non-empty dict of tensors")
    names = sorted(tensors)
    size = tensors[names[0]].shape[0]
    return torch.cat([tensors[name].reshape(size, -1) for name in names], dim=1)


def from_flat_vector(vector: Tensor, *, like: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Inverse of ``flat_vector``: split a (p,) vector into tensors shaped like ``like``."""
    if not isinstance(like, Mapping) or len(like) == 0:
        raise ValueError("from_flat_vector needs a non-empty template dict `like`")
    if vector.dim() != 1:
        raise ValueError(f"from_flat_vector expects a 1-d vector, got shape {tuple(vector.shape)}")
    names = sorted(like)
    total = sum(like[name].numel() for name in names)
    if vector.numel() != total:
        raise ValueError(
            f"vector has {vector.numel()} entries but the parameters have {total}: the basis "
            "or gradient was built for a different set of trainable parameters"
        )
    out: dict[str, Tensor] = {}
    start = 0
    for name in names:
        count = like[name].numel()
        out[name] = vector[start : start + count].view(like[name].shape)
        start += count
    return out


def _check_basis_request(k: int, m: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise ValueError(f"k={k!r} must be a positive int (dimension of the gradient subspace)")
    if k > m:
        raise ValueError(
            f"k={k} exceeds the number of public samples m={m}: the basis has rank <= m; "
            "lower k or use more public samples"
        )


def projection_basis(grads: Tensor, k: int, *, rtol: float = DEFAULT_RTOL) -> Tensor:
    """Top-k left singular vectors of G^T from G (m x p): V (p x k), orthonormal columns.

    Uses the m x m Gram matrix (float32 block products summed in float64) and
    ``torch.linalg.eigh`` in float64 (see the module docstring). Refuses k > m,
    k <= 0 and rank deficiency (fewer than k eigenvalues above ``rtol`` * max):
    a basis with made-up directions would silently project away signal, so
    we ask for a smaller k or more public samples instead. Returns float32
    with the device of ``grads``, laid out column by column (``column_major``).
    """
    if grads.dim() != 2:
        raise ValueError(f"grads must be a 2-d (m, p) matrix, got shape {tuple(grads.shape)}")
    return basis_from_blocks([[grads]], k, rtol=rtol)


def basis_from_blocks(rows: list[list[Tensor]], k: int, *, rtol: float = DEFAULT_RTOL,
                      fewer: bool = False, clip: float | None = None) -> Tensor:
    """``projection_basis`` of the G whose row chunk ``a`` and column group ``j`` is ``rows[a][j]`` (b_a x p_j):
    G as the per-sample gradients come, chunk by chunk and tensor by tensor, never copied into one m x p matrix.
    ``fewer``: when G's numerical rank r is below k, return its r genuine directions (p x r) with a warning
    instead of refusing. ``clip``: the basis of D G, each row scaled to norm at most ``clip`` (D from the Gram
    matrix's diagonal, applied to it and to the coefficients: no second pass over G), so that one sample whose
    gradient dwarfs the others' cannot take V's directions."""
    if clip is not None and not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"clip must be a finite number > 0 (or None), got {clip}")
    if not rows or not rows[0] or any(len(row) != len(rows[0]) for row in rows):
        raise ValueError("G's blocks do not line up: every row chunk needs the same column groups")
    sizes = [row[0].shape[0] for row in rows]
    widths = [block.shape[1] for block in rows[0]]
    if any([block.shape[1] for block in row] != widths or any(block.shape[0] != size for block in row)
           for row, size in zip(rows, sizes)):
        raise ValueError("G's blocks do not line up: every row chunk needs the same column widths")
    m, p = sum(sizes), sum(widths)
    _check_basis_request(k, m)
    if k > p:
        raise ValueError(f"k={k} exceeds the number of parameters p={p}; lower k")
    device = rows[0][0].device
    starts = [sum(sizes[:a]) for a in range(len(rows))]
    gram = torch.zeros((m, m), dtype=torch.float64, device=device)  # (m, m)
    for j in range(len(widths)):
        for begin in range(0, widths[j], _COLUMN_BLOCK):
            # one (m, c) block of G from every row chunk: one m x m product per block is several times faster
            # than a product per pair of chunks (each of those reads its columns again for a few rows)
            block = torch.cat([row[j][:, begin:begin + _COLUMN_BLOCK].to(torch.float32) for row in rows])
            gram += (block @ block.T).to(torch.float64)
    # A NaN/inf anywhere in row i makes the squared norm K_ii NaN/inf: checking the m x m Gram
    # matrix is exact for that and costs nothing, where isfinite over G (m x p) costs seconds.
    if not torch.isfinite(gram).all():
        raise NonFinitePublicGradients("public per-sample gradients contain NaN/inf (or overflow); cannot build a "
                                       "basis")
    scale = None
    if clip is not None:  # D: min(1, clip / ||g_i||) per row; (D G)(D G)^T = D (G G^T) D
        scale = (clip / gram.diagonal().sqrt().clamp_min(1e-300)).clamp(max=1.0)
        gram = gram * scale[:, None] * scale[None, :]
    eigvals, eigvecs = torch.linalg.eigh(gram)  # ascending, (m,), (m, m)
    top = eigvals[-1].item()
    if not top > 0:
        raise ValueError("all public per-sample gradients are zero; cannot build a basis")
    kept = int((eigvals > rtol * top).sum().item())
    if kept < k:
        rank = (f"public gradients have numerical rank {kept} < k={k} (eigenvalues of G G^T below "
                f"{rtol:g} x max dropped)")
        if not fewer:
            raise ValueError(f"{rank}; lower k to at most {kept} or use more diverse public samples")
        log.warning("%s: V keeps their %d directions; the update is projected onto fewer directions than "
                    "asked (the privacy claim is unchanged: V is public and applied after the noise)", rank, kept)
        k = kept
    order = torch.arange(m - 1, m - 1 - k, -1, device=device)  # top-k, descending
    lam = eigvals[order]  # (k,)
    coeffs = (eigvecs[:, order] / lam.sqrt()).T  # (k, m) = (U_k S_k^{-1})^T
    if scale is not None:  # V = (D G)^T U_k S_k^{-1} = G^T (D U_k S_k^{-1})
        coeffs = coeffs * scale[None, :]
    coeffs = coeffs.to(torch.float32).contiguous()
    # V^T = S_k^{-1} U_k^T G (k, p), so that V comes out column by column (see column_major); written one block
    # of columns at a time, which stays in cache while every row chunk adds its product to it
    transposed = torch.empty((k, p), dtype=torch.float32, device=device)
    offset = 0
    for j, width in enumerate(widths):
        for begin in range(offset, offset + width, _COLUMN_BLOCK):
            end = min(offset + width, begin + _COLUMN_BLOCK)
            out = transposed[:, begin:end]
            columns = slice(begin - offset, end - offset)
            torch.matmul(coeffs[:, :sizes[0]], rows[0][j][:, columns].to(torch.float32), out=out)
            for a in range(1, len(rows)):
                out.addmm_(coeffs[:, starts[a]:starts[a] + sizes[a]], rows[a][j][:, columns].to(torch.float32))
        offset += width
    return transposed.T  # (p, k) = G^T U_k S_k^{-1}


def check_orthonormal(basis: Tensor, tol: float = 1e-3) -> None:
    """Raise ValueError unless ``basis`` (p x k) has orthonormal columns.

    Sites call this on every received V: a non-orthonormal V would make
    V (V^T g) something other than a projection (it could amplify the
    noise-free part of the gradient), so the site refuses it.
    """
    if not isinstance(basis, Tensor) or basis.dim() != 2:
        shape = tuple(basis.shape) if isinstance(basis, Tensor) else type(basis).__name__
        raise ValueError(f"basis must be a 2-d (p, k) tensor, got {shape}")
    p, k = basis.shape
    if k == 0 or k > p:
        raise ValueError(f"basis shape ({p}, {k}) must satisfy 0 < k <= p")
    if not torch.isfinite(basis).all():
        raise ValueError("basis contains NaN/inf")
    as64 = basis.to(torch.float64)
    error = (as64.T @ as64 - torch.eye(k, dtype=torch.float64, device=basis.device)).abs().max()
    if error.item() > tol:
        raise ValueError(
            f"basis columns are not orthonormal: max |V^T V - I| = {error.item():.3g} > {tol:g}; "
            "refusing it (recompute V on the server)"
        )


def column_major(basis: Tensor) -> Tensor:
    """``basis`` (p x k) with its columns contiguous (V^T stored row by row), copied only if it is not.

    ``project`` reads V twice a step: V^T g and V (V^T g), matrix-vector products the BLAS runs on one thread.
    With V stored row by row they took 7.7 ms and 4.1 ms for tinyvit-small's 97 MB V on a 2-core machine;
    column by column, 2.8 ms and 3.0 ms. Every V a step projects with is laid out so once.
    """
    return basis if basis.T.is_contiguous() else basis.T.contiguous().T


def project(basis: Tensor, vector: Tensor) -> Tensor:
    """V (V^T g): orthogonal projection of g (p,) onto span(V), V (p x k)."""
    if basis.dim() != 2 or vector.dim() != 1 or basis.shape[0] != vector.shape[0]:
        raise ValueError(
            f"cannot project a vector of shape {tuple(vector.shape)} with a basis of shape "
            f"{tuple(basis.shape)}: need V (p, k) and g (p,)"
        )
    coords = basis.T @ vector.to(basis.dtype)  # (k,)
    return (basis @ coords).to(vector.dtype)  # (p,)


def public_scales(loss_fn: LossFn, params: Mapping[str, Tensor], public_batch: Mapping[str, Tensor], *,
                  chunk_size: int, per_coordinate: bool = False) -> Scales:
    """a_t = c / rms_t for every tensor of ``params`` (module docstring); 1 where a tensor has no public gradient.
    ``per_coordinate``: a_j = c / max(rms_j, COORDINATE_FLOOR c) for every coordinate j instead (AdaDPS), each
    tensor's scales a tensor of its shape.

    P2: the only data argument is a public batch. ``compute_scaled_basis`` gives the same scales with V.
    """
    return scales_of(per_sample_chunks(loss_fn, params, public_batch, chunk_size=chunk_size),
                     {name: value.numel() for name, value in params.items()},
                     shapes={name: value.shape for name, value in params.items()} if per_coordinate else None)


# Per-coordinate scales (train.tensor_scales: coordinate): a coordinate whose public gradients are (nearly) zero is
# scaled as if their RMS were this fraction of the overall RMS c, so no coordinate is amplified more than 1 / floor
# times c / its own RMS: public statistics of 100 samples do not tell a dead coordinate from a rare one.
COORDINATE_FLOOR = 0.01

Scales = Mapping[str, "float | Tensor"]


def scales_of(chunks: Iterable[Mapping[str, Tensor]], sizes: Mapping[str, int], *,
              shapes: Mapping[str, torch.Size] | None = None) -> dict[str, float | Tensor]:
    """The scales of per-sample gradients given chunk by chunk ({name: (b, ...)}); non-finite rows are left out.
    ``shapes`` (each tensor's shape): one scale per coordinate (``public_scales``' per_coordinate), else per tensor."""
    squares: dict[str, float | Tensor] = dict.fromkeys(sizes, 0.0)
    rows = 0
    for grads in chunks:
        flat = {name: g.reshape(g.shape[0], -1).double() for name, g in grads.items()}
        finite = torch.stack([torch.isfinite(f).all(1) for f in flat.values()]).all(0)  # (b,)
        for name, f in flat.items():
            kept = f[finite].pow(2)
            squares[name] = squares[name] + (kept.sum(0) if shapes is not None else float(kept.sum()))
        rows += int(finite.sum())
    if rows == 0:
        raise NonFinitePublicGradients("no public sample gave a finite gradient; the tensor scales cannot be computed")
    c = math.sqrt(sum(float(total.sum()) if isinstance(total, Tensor) else total for total in squares.values())
                  / (rows * sum(sizes.values())))
    scales: dict[str, float | Tensor] = {}
    for name, total in squares.items():
        if shapes is not None:
            rms = (torch.as_tensor(total, dtype=torch.float64) / rows).sqrt()
            per = (c / rms.clamp_min(COORDINATE_FLOOR * c)) if c > 0 else torch.ones_like(rms)
            scales[name] = per.to(torch.float32).reshape(shapes[name])
            continue
        tensor_rms = math.sqrt(total / (rows * sizes[name]))
        scales[name] = c / tensor_rms if tensor_rms > 0 and c > 0 else 1.0
    return scales


def flat_factor(factor: float | Tensor) -> float | Tensor:
    """A tensor's scale as a factor of its per-sample gradients laid flat ((b, numel)): per coordinate, (numel,)."""
    return factor.reshape(-1) if isinstance(factor, Tensor) else factor


def scale(grads: Mapping[str, Tensor], scales: Scales | None) -> dict[str, Tensor]:
    """Each tensor times its scale (per-sample or not; per tensor or per coordinate); ``scales`` None: as they are."""
    if scales is None:
        return dict(grads)
    return {name: g * scales[name] for name, g in grads.items()}


def compute_basis(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    public_batch: Mapping[str, Tensor],
    *,
    k: int,
    chunk_size: int,
    rtol: float = DEFAULT_RTOL,
    clip: float | None = None,
) -> Tensor:
    """V (p x k) from per-sample gradients of the full loss on PUBLIC data at ``params``.

    Invariant P2: the only data argument is the public batch (S_pub, never a
    site's records), so V is a function of S_pub and the current global
    weights alone. Memory: m x p float32 for G (kept as the chunks' per-sample gradients) plus one chunk's tape.
    Training can leave the public gradients spanning fewer than k directions (their numerical rank r): V is then
    p x r, with a warning, rather than a refusal that would end a run midway (``basis_from_blocks``).
    ``clip``: V from the per-sample gradients each clipped to this norm (``basis_from_blocks``); None: as they are.
    """
    return _basis_of(_public_rows(loss_fn, params, public_batch, k=k, chunk_size=chunk_size), params, k=k, rtol=rtol,
                     clip=clip)


def compute_scaled_basis(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    public_batch: Mapping[str, Tensor],
    *,
    k: int,
    chunk_size: int,
    rtol: float = DEFAULT_RTOL,
    clip: float | None = None,
    per_coordinate: bool = False,
) -> tuple[Tensor, dict[str, float | Tensor]]:
    """``train.tensor_scales: public`` (or ``coordinate``) with a projection: the scales of the public per-sample
    gradients (``scales_of``) and the V of those gradients times their scales, from one pass over the
    public batch (P2, as ``compute_basis``), so that V spans the gradients a step with the same scales clips."""
    rows = _public_rows(loss_fn, params, public_batch, k=k, chunk_size=chunk_size)
    scales = scales_of(rows, {name: value.numel() for name, value in params.items()},
                       shapes={name: value.shape for name, value in params.items()} if per_coordinate else None)
    for grads in rows:
        for name, block in grads.items():
            block.mul_(flat_factor(scales[name]))
    return _basis_of(rows, params, k=k, rtol=rtol, clip=clip), scales


def _public_rows(loss_fn: LossFn, params: Mapping[str, Tensor], public_batch: Mapping[str, Tensor], *, k: int,
                 chunk_size: int) -> list[dict[str, Tensor]]:
    """G, chunk by chunk: {name: (b, numel)} per chunk of public samples (checked: the weights, k <= m)."""
    check_params(params)
    _check_basis_request(k, batch_size_of(public_batch))
    rows = []
    for grads in per_sample_chunks(loss_fn, params, public_batch, chunk_size=chunk_size):
        rows.append({name: g.reshape(g.shape[0], -1) for name, g in grads.items()})
    return rows


def _basis_of(rows: list[dict[str, Tensor]], params: Mapping[str, Tensor], *, k: int, rtol: float,
              clip: float | None) -> Tensor:
    names = sorted(params)  # flat_vector's order: one column group per tensor, one row chunk per chunk of samples
    basis = basis_from_blocks([[grads[name] for name in names] for grads in rows], k, rtol=rtol, fewer=True, clip=clip)
    log.info("projection basis from %d public samples: p=%d, k=%d", sum(next(iter(g.values())).shape[0] for g in rows),
             sum(value.numel() for value in params.values()), basis.shape[1])
    return basis


def public_basis_at(
    model: PoseNet,
    loss_fn: Callable,
    trainable: list[str],
    public: PoseDataset,
    privacy: PrivacyConfig,
    device: torch.device,
) -> torch.Tensor:
    """V (p x k) from m public per-sample gradients at the current weights (P2: public data only)."""
    current, batch = _public_inputs(model, trainable, public, privacy, device, basis=True)
    return compute_basis(loss_fn, current, batch, k=privacy.k, chunk_size=privacy.chunk_size,
                         clip=basis_clip_of(privacy))


def public_scaled_basis_at(model: PoseNet, loss_fn: Callable, trainable: list[str], public: PoseDataset,
                           privacy: PrivacyConfig, device: torch.device, *, per_coordinate: bool = False
                           ) -> tuple[torch.Tensor, dict[str, float | Tensor]]:
    """``train.tensor_scales`` with a projection: V of the scaled public gradients and the scales (P2)."""
    current, batch = _public_inputs(model, trainable, public, privacy, device, basis=True)
    return compute_scaled_basis(loss_fn, current, batch, k=privacy.k, chunk_size=privacy.chunk_size,
                                clip=basis_clip_of(privacy), per_coordinate=per_coordinate)


def basis_clip_of(privacy: PrivacyConfig) -> float | None:
    """The norm V's public rows are clipped to: privacy.basis_clip, else C (privacy.basis_rows: clipped), else none."""
    if privacy.basis_clip is not None:
        return privacy.basis_clip
    return privacy.clip_norm if privacy.basis_rows == "clipped" else None


def public_scales_at(model: PoseNet, loss_fn: Callable, trainable: list[str], public: PoseDataset,
                     privacy: PrivacyConfig, device: torch.device, *, per_coordinate: bool = False
                     ) -> Scales:
    """``train.tensor_scales`` without a projection: the scales from the m public samples (P2)."""
    current, batch = _public_inputs(model, trainable, public, privacy, device, basis=False)
    return public_scales(loss_fn, current, batch, chunk_size=privacy.chunk_size, per_coordinate=per_coordinate)


def _public_inputs(model: PoseNet, trainable: list[str], public: PoseDataset, privacy: PrivacyConfig,
                   device: torch.device, *, basis: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The trained weights (detached) and the first m public samples on the device; for a ``basis``, k <= m."""
    m = min(privacy.m, len(public))
    if basis and privacy.k > m:
        raise ValueError(f"privacy.k = {privacy.k} exceeds the {m} public samples available; lower k")
    batch = to_device(public.batch(list(range(m))), device)
    keep_freed_memory()
    named = dict(model.named_parameters())
    return {name: named[name].detach() for name in trainable}, batch
