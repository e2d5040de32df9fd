"""What a round can cost at this site in the worst case, bounded before it is charged (P13).

With ``round_seconds`` a charged round's answer leaves at the next multiple of that period after its request
arrived (``fedpose.client.site.hold_reply``). Which multiple it leaves at would track the realised batch if a
server could choose a round whose cost straddles a multiple, so the worst case of every round must fit one period:

- the policy pins what multiplies the cost besides the model (the steps, the multiplicity, the chunk size, the
  public batch), and bounds the model and its input (``max_parameters``, ``max_input_size``);
- the worst-case batch is the upper tail of the Poisson batch (``worst_units``: the smallest b with
  P[batch > b] <= ``TAIL`` for a Poisson of mean ``expected_batch``), computed from the policy's public
  constants only, so that a refusal says nothing about how many records the site holds. The site's own check
  refuses data whose Binomial(n, q) tail is above it (more records than the policy declares);
- every chunk of a site's step is padded to ``chunk_size`` rows (``persample.chunks_of``), or to the rows
  ``round_chunk`` sizes from the free memory under the policy's ``chunk_memory`` (at most ``chunk_size``), so each
  costs the same time and memory whatever its real rows; a round is at most ``steps x (chunks + public chunks)``;
- before the charge (``check_round_cost``) one blank chunk of the request's own model at its input size is timed
  (zero rows: no private record is read) and the request is refused, nothing spent, when the elapsed time plus
  ``SAFETY`` times that worst case does not fit ``round_seconds``. ``SAFETY`` covers what is not timed (loading
  the data, the optimizer, the evaluation of the received model); a round that still overruns leaves at the next
  multiple and the site's log says so.

``fedpose site check`` (``worst_case_report``) measures the same at the policy's limits, with the kit's model at
``max_input_size``: the time of a round against ``round_seconds`` and the peak memory of one chunk against what
the machine has free, and refuses a policy whose worst case does not fit.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fedpose.client.policy import SitePolicy
from fedpose.shared.configuration.methods import WITH_PUBLIC, clips_groups, rows_per_record
from fedpose.shared.flower.messages import Refusal, RefusalCode

if TYPE_CHECKING:  # torch is imported where it is used
    import torch

log = logging.getLogger(__name__)

# P[a step's batch > worst_units] at most this (a round of 10 steps: 1e-5; beyond it the round may overrun).
TAIL = 1e-6
# What the timed chunks leave out (data loading, the optimizer, evaluating the received model), as a factor.
SAFETY = 1.5


def worst_units(policy: SitePolicy) -> int:
    """The smallest b with P[Poisson(expected_batch) > b] <= TAIL: the worst-case batch, from public constants."""
    from scipy.stats import poisson

    return int(poisson.isf(TAIL, policy.expected_batch)) + 1


def data_worst_units(policy: SitePolicy, units: int) -> int:
    """The same tail for the site's own data: Binomial(units, sample_rate) (the operator's check only)."""
    from scipy.stats import binom

    return int(binom.isf(TAIL, units, policy.sample_rate)) + 1


def rows_per_unit(policy: SitePolicy, images: str = "raw") -> int | None:
    """Rows one sampled unit puts into the step: K copies of a record (2 with ``raw+psi``), or at patient level
    at most ``max_records_per_patient`` (None: no cap, so no worst case)."""
    if policy.unit == "patient":
        return policy.max_records_per_patient
    return policy.augment_multiplicity * (2 if images == "raw+psi" else 1)


def chunks_per_round(policy: SitePolicy, *, steps: int, method: str, images: str = "raw",
                     chunk_size: int | None = None) -> int:
    """Padded chunks of ``chunk_size`` rows (default: the policy's) a round of ``steps`` runs at most: the private
    batch at its worst case, and the public term (``public_batch_size`` rows, one mean gradient: no dearer than as
    many private rows)."""
    rows = rows_per_unit(policy, images)
    if rows is None:
        raise ValueError("at patient level a round's worst case needs max_records_per_patient (its rows per "
                         "patient) in the policy")
    chunk = policy.chunk_size if chunk_size is None else chunk_size
    private = max(1, math.ceil(worst_units(policy) * rows / chunk))
    public = math.ceil(policy.public_batch_size / chunk) if method in WITH_PUBLIC else 0
    return steps * (private + public)


@dataclass(frozen=True)
class ChunkCost:
    """One padded chunk of a private step: its seconds, and its peak memory above what was held before (bytes;
    ``fedpose.shared.training.chunk_memory.measured_peak``: on CUDA the allocator's peak, on a CPU the tensors')."""

    seconds: float
    peak_bytes: int


def blank_chunk_cost(model: Any, trainable: list[str], *, input_size: tuple[int, int], face_tasks: tuple[str, ...],
                     chunk_size: int, grouped: bool, peak: bool = True) -> ChunkCost:
    """Time one padded private chunk of ``model`` on blank rows (``chunk_memory.blank_chunk``: no record is read);
    on CUDA after one warm-up (kernel choices), on CPU the first run (slower than the next: an overestimate, which is
    on the safe side). ``peak``: measure its peak memory too, in a run of its own (0 otherwise).
    """
    from fedpose.shared.training.chunk_memory import blank_chunk, measured_peak

    device = next(model.parameters()).device
    run = blank_chunk(model, trainable, input_size=input_size, face_tasks=face_tasks, chunk_size=chunk_size,
                      grouped=grouped)
    if device.type == "cuda":
        run()  # warm-up: first-call allocations and kernel choices
    started = time.perf_counter()
    run()
    seconds = time.perf_counter() - started
    return ChunkCost(seconds=seconds, peak_bytes=measured_peak(run, device) if peak else 0)


def _grouped(policy: SitePolicy, images: str = "raw") -> bool:
    """Whether the policy's step clips groups of rows (``DPSpec.grouped`` of the spec the site will build)."""
    return clips_groups(policy.unit, rows_per_record(images, policy.augment_multiplicity))


def round_chunk(request: Any, policy: SitePolicy, model: torch.nn.Module, trainable: list[str]) -> int:
    """The rows of every chunk of this round: the policy's ``chunk_size``, or with its ``chunk_memory`` the most
    rows, at most ``chunk_size``, whose blank chunk of the request's own model fits that share of the free memory
    (``fedpose.shared.training.chunk_memory.chunk_for``; chosen once per site process for one shape of request).

    Before the charge and on blank rows only: a chunk that cannot fit is a refusal (POLICY), nothing spent. The
    choice goes to the site's log (INFO; the fixed chunk of a site that sizes nothing at DEBUG), never into the
    reply.
    """
    import torch

    from fedpose.shared.training.chunk_memory import chunk_for

    cfg = request.config
    if policy.chunk_memory is None:
        log.debug("site %s round %d: chunk of %d rows (chunk_size=%d; no chunk_memory: not sized)", policy.site,
                  request.round, policy.chunk_size, policy.chunk_size)
        return policy.chunk_size
    try:
        choice = chunk_for(model, trainable, input_size=cfg.data.input_size, face_tasks=cfg.model.face_tasks,
                           grouped=_grouped(policy, cfg.train.images), cap=policy.chunk_size,
                           fraction=policy.chunk_memory)
    except (ValueError, MemoryError, torch.OutOfMemoryError) as err:
        raise Refusal(RefusalCode.POLICY, f"no chunk of the requested model fits this site's chunk_memory="
                                          f"{policy.chunk_memory:g} of its free memory: ask for a smaller model or "
                                          "input") from err
    log.info("site %s round %d: %s, chunk_memory=%g of the free memory", policy.site, request.round,
             choice.describe(), policy.chunk_memory)
    return choice.size


def check_round_cost(request: Any, policy: SitePolicy, model: torch.nn.Module, trainable: list[str], *,
                     elapsed: float, chunk_size: int | None = None) -> None:
    """Refuse (POLICY, before the charge: nothing spent) a request whose worst case does not fit ``round_seconds``.

    Reads no private record: one blank chunk of the request's own model is timed at the round's chunk
    (``chunk_size``, default the policy's; ``round_chunk``); the worst case counts the policy's public constants
    only (``chunks_per_round``). ``elapsed``: the seconds since the request arrived, by the clock the site's answer
    is held to; the time this check takes is added. Without ``round_seconds`` there is no clock to fit.
    """
    if policy.round_seconds is None:
        return
    import torch

    cfg = request.config
    images = cfg.train.images
    chunk = policy.chunk_size if chunk_size is None else chunk_size
    try:
        chunks = chunks_per_round(policy, steps=request.steps, method=cfg.train.method, images=images,
                                  chunk_size=chunk)
    except ValueError as err:
        raise Refusal(RefusalCode.POLICY, f"with round_seconds {err}") from err
    started = time.perf_counter()
    try:
        cost = blank_chunk_cost(model, trainable, input_size=cfg.data.input_size, face_tasks=cfg.model.face_tasks,
                                chunk_size=chunk, grouped=_grouped(policy, images), peak=False)
    except (MemoryError, torch.OutOfMemoryError) as err:  # the blank chunk allocates what every chunk does
        raise Refusal(RefusalCode.POLICY, "one chunk of the requested model does not fit this site's memory at "
                                          f"chunk_size={chunk}: ask for a smaller model or input") from err
    elapsed += time.perf_counter() - started
    worst = elapsed + SAFETY * chunks * cost.seconds
    if worst > policy.round_seconds:
        raise Refusal(RefusalCode.POLICY, f"this request's worst case does not fit this site's round_seconds="
                                          f"{policy.round_seconds:g}: {chunks} chunks of {chunk} rows "
                                          f"({request.steps} steps at the batch's upper tail) at {cost.seconds:.3g} s "
                                          f"each, x{SAFETY:g}, after {elapsed:.1f} s, is {worst:.1f} s; ask for "
                                          "fewer steps or a smaller model or input")


def reference_chunk_cost(policy: SitePolicy) -> ChunkCost:
    """One padded chunk of the kit's model at the policy's largest input, on the device a round would use."""
    from fedpose.shared.configuration.schema import ModelConfig
    from fedpose.shared.model.posenet import build_model
    from fedpose.shared.model.strategy import apply_strategy
    from fedpose.shared.training.loop import select_device

    model = build_model(ModelConfig(face_tasks=policy.face_tasks), policy.max_input_size)
    model.to(select_device("auto"))
    trainable = apply_strategy(model, "full")
    return blank_chunk_cost(model, trainable, input_size=policy.max_input_size, face_tasks=policy.face_tasks,
                            chunk_size=policy.chunk_size, grouped=_grouped(policy))


def worst_case_report(policy: SitePolicy, units: int) -> list[str]:
    """The worst case of a round at the policy's limits, in lines for the operator; ValueError when it does not fit
    (``fedpose site check``). ``units``: the site's records (patients) as its check kept them."""
    from fedpose.shared.training.chunk_memory import free_memory
    from fedpose.shared.training.loop import select_device

    lines = []
    public, own = worst_units(policy), data_worst_units(policy, units)
    if own > public and policy.round_seconds is None:
        lines.append(f"alert: this site's worst-case batch ({own}) is above the {public} its policy's "
                     f"expected_batch={policy.expected_batch:g} declares: more records than the policy was written "
                     "for (with round_seconds this check refuses it)")
    elif own > public:
        raise ValueError(f"this site's data has a worst-case batch of {own} (Binomial({units}, {policy.sample_rate:g})"
                         f" upper tail {TAIL:g}) above the {public} its policy's expected_batch="
                         f"{policy.expected_batch:g} declares: more records than the policy was written for; write "
                         "it again (`fedpose site-policy --expected-batch B`)")
    method = "fpdp" if set(policy.allowed_methods) & set(WITH_PUBLIC) else "dpsgd"
    cost = reference_chunk_cost(policy)
    free = free_memory(select_device("auto"))
    h, w = policy.max_input_size
    # the step's input images are held whole (float32, 3 channels): at the batch's upper tail
    rows = rows_per_unit(policy, "raw+psi" if policy.augment_multiplicity == 1 else "raw")
    inputs = public * (rows or 1) * 3 * h * w * 4
    need = cost.peak_bytes + inputs
    lines.append(f"peak memory of a private step: one chunk ({policy.chunk_size} rows of the kit's model at {h}x{w}, "
                 f"every chunk is padded to it) {cost.peak_bytes / 2**20:.0f} MiB + the batch's images at its upper "
                 f"tail {inputs / 2**20:.0f} MiB, of {free / 2**20:.0f} MiB free")
    if need > free:
        raise ValueError(f"a private step at {h}x{w} needs {need / 2**20:.0f} MiB (one chunk of {policy.chunk_size} "
                         f"rows and the batch's images), more than the {free / 2**20:.0f} MiB this machine has free: "
                         "lower chunk_size or max_input_size")
    try:
        chunks = chunks_per_round(policy, steps=policy.steps_per_round, method=method)
    except ValueError as err:
        if policy.round_seconds is not None:
            raise ValueError(f"site policy: with round_seconds {err}") from err
        return lines
    seconds = SAFETY * chunks * cost.seconds
    lines.append(f"worst case of a round: {policy.steps_per_round} steps, batch up to {public} "
                 f"(P[more] <= {TAIL:g} a step), {chunks} chunks at {cost.seconds:.3g} s, x{SAFETY:g}: {seconds:.1f} s"
                 + ("" if policy.round_seconds is None else f" of round_seconds={policy.round_seconds:g}"))
    if policy.round_seconds is not None and seconds > policy.round_seconds:
        raise ValueError(f"the worst case of a round ({seconds:.1f} s with the kit's model at {h}x{w}) does not fit "
                         f"round_seconds={policy.round_seconds:g}: raise round_seconds, or lower steps_per_round, "
                         "max_input_size or augment_multiplicity")
    return lines
