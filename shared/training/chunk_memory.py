"""The chunk of a private step sized from the device's free memory: the most rows whose measured peak fits a share
of what the device has free, never more than ``chunk_size``, which stays the cap.

Per-sample work runs in sequential chunks (``fedpose.shared.privacy.step.persample.chunks_of``); on a GPU a chunk of
32 under-fills the device, and a site with memory to spare gains by running more rows at once. With
``privacy.chunk_memory`` (a centralized run) or a site policy's ``chunk_memory``, the size is chosen once, before the
first step, from one blank chunk of the model at its input size (zero rows: no record is read) measured at a few
sizes (``choose_chunk_size``): a chunk's peak is about affine in its rows, so two sizes give its cost per row, and
the size it predicts is measured too, then the next one, so the choice is the largest that was seen to fit.

What the choice depends on is public or the machine's: the model, the trained tensors, the input size, whether
rows are clipped in groups, the cap and the share, and the free memory when it is made. It never depends on the
realised (Poisson) batch, and a site still pads every chunk to the chosen size, so a step's peak memory does not
follow the batch (P13). It is made once per process for one shape of request (``chunk_for`` keeps it), so every
step of a run and every round of a site process with that model and input runs the same chunk.

The peak of a chunk (``measured_peak``): on CUDA torch's allocator peak above what was allocated before; on a CPU
the peak of the bytes held by tensors made while it runs, followed op by op (``_LivePeak``). The process's
resident set cannot serve here: a training process keeps its freed memory (``allocator.keep_freed_memory``), so
a second chunk often takes no new page at all. The share left over covers what a chunk does not hold: the batch's
images, the optimizer, the basis, other processes.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

log = logging.getLogger(__name__)


class _LivePeak(TorchDispatchMode):
    """The most bytes held at once by the storages of the tensors that the ops run under it make (CPU's analogue
    of the CUDA allocator's peak). A storage counts from the op that made it until it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._held: set[int] = set()

    def _freed(self, key: int, size: int) -> None:
        self._held.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {value.untyped_storage().data_ptr() for value in tree_flatten((args, kwargs))[0]
                  if isinstance(value, torch.Tensor)}
        for value in tree_flatten(out)[0]:
            if not isinstance(value, torch.Tensor):
                continue
            storage = value.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            # a view or an in-place op's result shares an input's storage: nothing new is held
            if size == 0 or key in self._held or key in inputs:
                continue
            self._held.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, size)
        return out


def measured_peak(run: Callable[[], Any], device: torch.device) -> int:
    """Bytes above what was held before that ``run()`` holds at its peak: the CUDA allocator's, else ``_LivePeak``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        return max(int(torch.cuda.max_memory_allocated(device) - before), 0)
    with _LivePeak() as live:
        run()
    return live.peak


def free_memory(device: torch.device) -> int:
    """Bytes the machine can still give a round: free GPU memory and what this process's allocator keeps unused, or
    MemAvailable of /proc/meminfo."""
    if device.type == "cuda":
        free = int(torch.cuda.mem_get_info(device)[0])
        return free + int(torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")


def blank_chunk(model: Any, trainable: list[str], *, input_size: tuple[int, int], face_tasks: tuple[str, ...],
                chunk_size: int, grouped: bool) -> Callable[[], None]:
    """One padded private chunk of ``model`` on ``chunk_size`` blank rows (zeros: no record is read), as a call.

    ``grouped``: the step clips groups (patients, augmented copies), as ``fpdp.clipped_group_sum`` does. Each call
    runs in training mode and leaves the model's buffers and mode as they were: a blank forward leaves no trace.
    """
    from fedpose.shared.data.dataset import PoseDataset
    from fedpose.shared.model.pose_loss import make_loss_fn
    from fedpose.shared.privacy.step.fpdp import clipped_grad_sum, clipped_group_sum

    device = next(model.parameters()).device
    empty = PoseDataset([], input_size=input_size, augment=None, face_tasks=bool(face_tasks)).batch([])
    batch = {k: v.new_zeros((chunk_size, *v.shape[1:])).to(device) for k, v in empty.items() if k != "index"}
    named = dict(model.named_parameters())
    params = {n: named[n].detach() for n in trainable}
    loss_fn: Any = make_loss_fn(model, trainable)  # a LossFn (PoseLoss is callable as one)
    groups = torch.arange(chunk_size)

    def run() -> None:
        was_training = model.training
        buffers = {name: value.clone() for name, value in model.named_buffers()}
        model.train()
        try:
            if grouped:
                clipped_group_sum(loss_fn, params, batch, groups=groups, clip_norm=1.0, chunk_size=chunk_size,
                                  pad=True)
            else:
                clipped_grad_sum(loss_fn, params, batch, clip_norm=1.0, chunk_size=chunk_size, pad=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        finally:
            model.train(was_training)
            with torch.no_grad():
                for name, value in model.named_buffers():
                    value.copy_(buffers[name])

    return run


@dataclass(frozen=True)
class ChunkChoice:
    """The rows of every chunk of a run (``size``), the cap it was chosen under, its measured peak and the
    allowance it fits (bytes)."""

    size: int
    cap: int
    peak_bytes: int
    budget_bytes: int

    def describe(self) -> str:
        return (f"chunk of {self.size} rows (chunk_size={self.cap} the cap; its peak {self.peak_bytes / 2**20:.0f} "
                f"MiB of the {self.budget_bytes / 2**20:.0f} MiB allowed)")


def choose_chunk_size(measure: Callable[[int], int], *, cap: int, budget_bytes: int) -> ChunkChoice:
    """The most rows, at most ``cap``, whose peak ``measure(rows)`` (bytes) fits ``budget_bytes``.

    The peaks at 1 and 2 rows give the cost of a row; the size they predict is measured, smaller ones while it does
    not fit, and the next larger one once it does, so the size returned was seen to fit and the next was seen not
    to (or is above the cap). ValueError when one row does not fit.
    """
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f"cap={cap!r} must be a positive int (the chunk_size that bounds the choice)")
    seen: dict[int, int] = {}

    def peak(rows: int) -> int:
        if rows not in seen:
            seen[rows] = measure(rows)
        return seen[rows]

    if peak(1) > budget_bytes:
        raise ValueError(f"one row of the private step holds {peak(1) / 2**20:.0f} MiB at its peak, more than the "
                         f"{budget_bytes / 2**20:.0f} MiB allowed: raise chunk_memory, free the device, or ask for a "
                         "smaller model or input")
    size = 1
    if cap > 1:
        per_row = max(peak(2) - peak(1), 1)
        size = max(1, min(cap, 1 + (budget_bytes - peak(1)) // per_row))
        while size > 1 and peak(size) > budget_bytes:  # the fit is a line; a real peak may bend
            size = max(1, min(size - 1, size * budget_bytes // peak(size)))
        while size < cap and peak(size + 1) <= budget_bytes:
            size += 1
    return ChunkChoice(size=size, cap=cap, peak_bytes=peak(size), budget_bytes=budget_bytes)


# One choice per process for one shape of request: every step of a run and every round of a site process that
# trains the same model at the same input runs the same chunk.
_CHOSEN: dict[tuple, ChunkChoice] = {}


def chunk_for(model: Any, trainable: list[str], *, input_size: tuple[int, int], face_tasks: tuple[str, ...],
              grouped: bool, cap: int, fraction: float) -> ChunkChoice:
    """The chunk of ``model``'s private step: the most rows, at most ``cap``, whose blank chunk's measured peak fits
    ``fraction`` of the device's free memory (``choose_chunk_size``); chosen once per process for this shape of
    request. ValueError when one row does not fit; on CUDA a probe that runs out of memory counts as not fitting.
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ValueError(f"chunk_memory={fraction!r} must be a share of the free memory in (0, 1)")
    device = next(model.parameters()).device
    key = (str(device), tuple(input_size), tuple(face_tasks), grouped, cap, float(fraction), tuple(trainable),
           tuple((name, tuple(p.shape), p.dtype) for name, p in model.named_parameters()))
    if key in _CHOSEN:
        return _CHOSEN[key]
    budget = int(fraction * free_memory(device))

    def measure(rows: int) -> int:
        run = blank_chunk(model, trainable, input_size=input_size, face_tasks=face_tasks, chunk_size=rows,
                          grouped=grouped)
        try:
            return measured_peak(run, device)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            return budget + 1

    if device.type == "cuda":
        blank_chunk(model, trainable, input_size=input_size, face_tasks=face_tasks, chunk_size=1,
                    grouped=grouped)()  # first-call allocations and kernel choices, outside the peaks
    choice = choose_chunk_size(measure, cap=cap, budget_bytes=budget)
    _CHOSEN[key] = choice
    log.info("private step on %s: %s", device, choice.describe())
    return choice
