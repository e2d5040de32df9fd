"""Benchmark: what one private step costs against a non-private one, side by side (not a test).

For tinyvit-small and tinyvit-5m (finetune parameters) at 128x96, batch 32, one optimizer step of:

- ``nonprivate``: the plain mean gradient of the batch;
- ``dpsgd``: per-sample clipping (book-keeping: one forward and one backward), one noise draw;
- ``dpsgd-generic``: the same step on the generic ``vmap(grad)`` path, for reference;
- ``fpdp``: DP-SGD, projection onto k = 50 directions and the public gradient on psi(x) of the
  same 32 images, compared with ``nonprivate-2x``, a non-private step over the same 64 images
  (the private batch and the psi batch), so the ratio shows what DP costs on top of the psi batch;
- ``opacus`` (when installed): Opacus' GradSampleModule hooks, clipping and noise on the same model.

Timing runs the kinds a site runs (non-private, non-private over both batches, DP-SGD, FP-DP) in one process
per model, and the reference kinds (the generic path, Opacus) in a second one beside a non-private step of its
own: with all of them in one process, the step after a reference kind paid for what that kind left behind
(FP-DP's ratio read 1.17-1.20 there and 1.14-1.19 in a process of its own). Each process keeps its freed memory
as ``local_train`` makes every training process do (``fedpose.shared.training.allocator``), runs interleaved rounds
(kind after kind, round after round, the kind that starts a round rotating), garbage collected between steps (outside
the timing: the reference kinds leave enough for one full collection to take 0.1-0.2 s of whichever step it fell
in), and reports each ratio's median over the rounds with its min-max spread: on a shared 2-core machine a
ratio measured in two separate runs can move by 30%.
Memory runs each configuration in its own process: the peak resident memory (live, see LIVE_MEMORY) above
the process's baseline of a DP step at chunk 16 for realised Poisson batches of 16, 32 and 64 (a site pins
the chunk, so the peak must not follow the batch), beside a non-private step at 32. The projection basis
(m = 100 public samples, k = 50, tinyvit-5m finetune) is timed three times in each of several processes of its
own: its time moves more between processes than within one.

    python benchmarks/dp_step.py [--repeats 7] [--variants tinyvit-small,tinyvit-5m] [--out FILE]

writes benchmarks/results/dp_step.json (rendered into docs/results/benchmarks.md).

``--chunks`` runs the sized chunk beside the fixed one instead: DP-SGD and FP-DP as a site runs them (every chunk
padded) with chunks of ``--fixed`` rows (16, a policy's default) and with the rows ``chunk_memory.chunk_for``
chooses (``--chunk-memory`` of the free memory, at most ``--cap`` rows, default the batch), beside the non-private
steps, interleaved in one process, each ratio with its min-max spread; the chosen chunk, its measured peak and
the seconds the choice took are printed too. On the CPU at 128x96, batch 32 (writes dp_step_chunks.json); with
``--device cuda`` at ``--input`` and ``--batch`` (dp_step_chunks_cuda.json):

    python benchmarks/dp_step.py --chunks --variants tinyvit-5m --repeats 5
    python benchmarks/dp_step.py --chunks --device cuda --variants tinyvit-5m --fixed 32 --cap 256 --repeats 5
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from pathlib import Path


INPUT = (128, 96)
BATCH = 32
K = 50
TARGETS = {"dpsgd": 1.10, "fpdp": 1.15, "basis_s": 2.0}


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _batch(size: int, seed: int, *, size_hw: tuple[int, int] = INPUT, device: str = "cpu"):
    import torch

    h, w = size_hw
    gen = torch.Generator().manual_seed(seed)
    batch = {
        "image": torch.rand(size, 3, h, w, generator=gen),
        "joints": torch.rand(size, 16, 2, generator=gen) * torch.tensor([w - 1.0, h - 1.0]),
        "visible": torch.ones(size, 16),
    }
    return {key: value.to(device) for key, value in batch.items()}


def _setup(variant: str, *, opacus_compatible: bool = False, size_hw: tuple[int, int] = INPUT,
           device: str = "cpu"):
    import torch

    from fedpose.shared.configuration.schema import ModelConfig
    from fedpose.shared.model.posenet import build_model
    from fedpose.shared.model.pose_loss import make_loss_fn
    from fedpose.shared.model.strategy import apply_strategy

    torch.manual_seed(0)
    # Opacus' hooks cannot produce per-sample gradients for parameters used outside a layer's forward
    # (the learned task weights) or through an index table (attention biases): its row leaves them out.
    model = build_model(ModelConfig(variant=variant, task_uncertainty=not opacus_compatible), size_hw).to(device)
    names = apply_strategy(model, "finetune")
    if opacus_compatible:
        names = [n for n in names if not n.endswith("attention_biases")]
        for name, p in model.named_parameters():
            p.requires_grad_(name in names)
    return model, names, make_loss_fn(model, names)


def _steps(variant: str, batch_size: int, chunk: int, kinds: list[str], *, size_hw: tuple[int, int] = INPUT,
           device: str = "cpu", padded: dict[str, int] | None = None):
    """{kind: step()} for one model; every kind updates the same model with SGD. ``padded``: more kinds,
    ``"<method>@<label>"`` -> rows, each that method's step as a site runs it (every chunk padded to its rows)."""
    import torch

    from fedpose.shared.privacy.step.fpdp import DPSpec, dp_gradient
    from fedpose.shared.privacy.step.psi import apply_psi, GaussianBlur

    model, names, loss_fn = _setup(variant, size_hw=size_hw, device=device)
    named = dict(model.named_parameters())
    params = [named[n] for n in names]
    opt = torch.optim.SGD(params, lr=1e-4)
    gen = torch.Generator(device=device).manual_seed(0)
    batch = _batch(batch_size, 1, size_hw=size_hw, device=device)
    psi_batch = both = basis = None
    padded = padded or {}
    if {"fpdp", "nonprivate-2x"} & set(kinds) or any(k.startswith("fpdp@") for k in padded):
        # only what the kinds use, so that memory runs hold nothing else
        psi_batch = apply_psi(GaussianBlur(0.06), batch)
        both = {key: torch.cat([batch[key], psi_batch.tensors[key]]) for key in batch}
        p = sum(named[n].numel() for n in names)
        sent = torch.linalg.qr(torch.randn(p, K, generator=torch.Generator().manual_seed(0)))[0].contiguous()
        if device == "cpu":  # V as a site trains with it: off the wire as the server sends it (float16), its layout
            from fedpose.shared.flower.messages import basis_record, record_basis

            basis = record_basis(basis_record(sent, version=1, dtype="float16"))[1]
        else:  # the same values and column layout without Flower (not installed on the GPU machine)
            basis = sent.half().float().t().contiguous().t().to(device)
    expected = BATCH if device == "cpu" else batch_size  # the CPU memory runs keep B = 32 at every realised size
    spec = dict(clip_norm=1.0, sigma=1.0, sample_rate=expected / 1000, expected_batch=float(expected),
                chunk_size=chunk)

    def generic(params_, batch_):  # hides the model from book-keeping: the vmap(grad) path
        return loss_fn(params_, batch_)

    def apply(grads) -> None:
        for n in names:
            named[n].grad = grads[n]
        opt.step()
        opt.zero_grad(set_to_none=True)

    def current():
        return {n: named[n].detach() for n in names}

    def nonprivate(images=None) -> None:
        model.losses(batch if images is None else images).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def private(method: str, fn=loss_fn, rows: int | None = None) -> None:
        sized = spec if rows is None else {**spec, "chunk_size": rows, "pad_chunks": True}
        grads, _ = dp_gradient(fn, current(), spec=DPSpec(method=method, **sized), private_batch=batch,
                               psi_batch=psi_batch if method == "fpdp" else None, generator=gen,
                               basis=basis if method == "fpdp" else None)
        apply(grads)

    steps = {
        "nonprivate": nonprivate,
        "nonprivate-2x": lambda: nonprivate(both),
        "dpsgd": lambda: private("dpsgd"),
        "dpsgd-generic": lambda: private("dpsgd", generic),
        "fpdp": lambda: private("fpdp"),
        "opacus": lambda: None,
    }
    if "opacus" in kinds:
        steps["opacus"] = _opacus_step(variant, batch, gen)
    for label, rows in padded.items():
        steps[label] = lambda method=label.partition("@")[0], rows=rows: private(method, rows=rows)
    return {k: steps[k] for k in [*kinds, *padded]}


def _opacus_step(variant: str, batch, gen):
    import warnings

    import torch
    from opacus.grad_sample import GradSampleModule

    from fedpose.shared.model.pose_loss import _LossModule

    warnings.filterwarnings("ignore")
    model, names, _ = _setup(variant, opacus_compatible=True)
    named = dict(model.named_parameters())
    opt = torch.optim.SGD([named[n] for n in names], lr=1e-4)
    gsm = GradSampleModule(_LossModule(model), batch_first=True, loss_reduction="sum")

    def step() -> None:  # Opacus' per-sample path: hooks fill p.grad_sample, then clip, sum, add noise
        gsm(batch).sum().backward()
        gs = [named[n].grad_sample for n in names]
        norms = torch.stack([g.reshape(g.shape[0], -1).norm(dim=1) for g in gs]).norm(dim=0)
        factor = (1.0 / (norms + 1e-6)).clamp(max=1.0)
        for n, g in zip(names, gs):
            summed = torch.einsum("i,i...->...", factor, g)
            named[n].grad = (summed + torch.normal(0.0, 1.0, summed.shape, generator=gen)) / BATCH
            named[n].grad_sample = None
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _time_variant(variant: str, repeats: int, kinds: list[str], queue) -> None:
    from fedpose.shared.training.allocator import keep_freed_memory

    keep_freed_memory()  # as local_train does in every training process
    steps = _steps(variant, BATCH, BATCH, kinds)
    for step in steps.values():  # warm-up: allocations, kernels
        step()
    # the garbage of the kind before (Opacus' hooks, vmap's wrappers) is collected before each step, not inside
    # the next kind's timed step: a full collection took up to 0.18 s in this process
    queue.put(_interleaved(steps, repeats, before=gc.collect))


def _interleaved(steps: dict, repeats: int, *, before=lambda: None, after=lambda: None) -> dict[str, list[float]]:
    """Each kind's step timed ``repeats`` times, round after round; every kind starts a round in turn and follows
    every other one. ``before`` runs before the clock starts, ``after`` before it stops (a GPU's synchronisation
    after a step belongs to the step)."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    order = list(steps)
    for round_ in range(repeats):
        shift = round_ % len(order)
        for kind in order[shift:] + order[:shift]:
            before()
            t0 = time.perf_counter()
            steps[kind]()
            after()
            times[kind].append(time.perf_counter() - t0)
    return times


def _ratios(times: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each kind's time over the round's non-private step, and FP-DP's over the non-private step on both batches."""
    ratios = {kind: [t / b for t, b in zip(times[kind], times["nonprivate"])] for kind in times}
    ratios["fpdp-vs-2x"] = [t / b for t, b in zip(times["fpdp"], times["nonprivate-2x"])]
    return ratios


def _memory(variant: str, kind: str, realised: int, queue) -> None:
    steps = _steps(variant, realised, 16, [kind])
    step = steps[kind]
    gc.collect()
    base = _maxrss_mb()  # model, weights and the batch itself: what every kind holds before its step
    step()
    step()
    queue.put(max(0.0, _maxrss_mb() - base))


def _basis(repeats: int, queue, *, size_hw: tuple[int, int] = INPUT, device: str = "cpu", sync=lambda: None):
    from fedpose.shared.training.allocator import keep_freed_memory
    from fedpose.shared.privacy.step.subspace import compute_basis

    if device == "cpu":
        keep_freed_memory()  # as public_basis_at does
    model, names, loss_fn = _setup("tinyvit-5m", size_hw=size_hw, device=device)
    named = dict(model.named_parameters())
    params = {n: named[n].detach() for n in names}
    public = _batch(100, 2, size_hw=size_hw, device=device)
    compute_basis(loss_fn, params, public, k=K, chunk_size=25)  # warm-up
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        compute_basis(loss_fn, params, public, k=K, chunk_size=25)
        sync()
        times.append(time.perf_counter() - t0)
    queue.put({"times": times, "parameters": sum(v.numel() for v in params.values())})


def _cuda(args) -> dict:
    """Every kind in one process on the GPU, timed between synchronisations; peak memory from torch's allocator."""
    import queue as queues

    import torch

    size_hw = tuple(int(v) for v in args.input.split("x"))
    kinds = ["nonprivate", "nonprivate-2x", "dpsgd", "fpdp"]
    result: dict = {"device": torch.cuda.get_device_name(0), "input": list(size_hw), "batch": args.batch,
                    "chunk": args.chunk, "k": K, "repeats": args.repeats, "variants": {}}
    for variant in args.variants.split(","):
        steps = _steps(variant, args.batch, args.chunk, kinds, size_hw=size_hw, device="cuda")
        peak = {}
        for kind, step in steps.items():  # warm-up, then each kind's peak above what the model and batch hold
            step()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peak[kind] = (torch.cuda.max_memory_allocated() - base) / 2**20
        times = _interleaved(steps, args.repeats, before=torch.cuda.synchronize, after=torch.cuda.synchronize)
        ratios = _ratios(times)
        result["variants"][variant] = {"ms": {k: _spread([1000 * t for t in ts]) for k, ts in times.items()},
                                       "ratio": {k: _spread(rs) for k, rs in ratios.items()}, "peak_mb": peak}
        print(f"\n{variant} @ {size_hw[0]}x{size_hw[1]}, batch {args.batch}, chunk {args.chunk}, "
              f"{result['device']}, {args.repeats} rounds")
        for kind in times:
            r, ms = result["variants"][variant]["ratio"][kind], result["variants"][variant]["ms"][kind]
            print(f"{kind:<15}{ms['median']:>10.1f} ms{r['median']:>8.2f}x  {r['min']:.2f}-{r['max']:.2f}"
                  f"  peak {peak[kind]:.0f} MB")
        r = result["variants"][variant]["ratio"]["fpdp-vs-2x"]
        print(f"fpdp / nonprivate-2x {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})")
        del steps
        torch.cuda.empty_cache()
    box: queues.Queue = queues.Queue()
    _basis(args.repeats, box, size_hw=size_hw, device="cuda", sync=torch.cuda.synchronize)
    basis = box.get()
    result["basis"] = {"seconds": _spread(basis["times"]), "m": 100, "k": K, "parameters": basis["parameters"]}
    print(f"basis (m=100, k={K}, tinyvit-5m finetune): {statistics.median(basis['times']):.3f} s")
    return result


def _chunk_comparison(variant: str, batch: int, fixed: int, cap: int, share: float, repeats: int,
                      size_hw: tuple[int, int], device: str, queue=None) -> dict | None:
    """DP-SGD and FP-DP as a site runs them (every chunk padded) at ``fixed`` rows a chunk and at the rows
    ``chunk_memory.chunk_for`` chooses (``share`` of the free memory, at most ``cap``), beside a non-private step,
    interleaved in one process."""
    import torch

    from fedpose.shared.training.allocator import keep_freed_memory
    from fedpose.shared.training.chunk_memory import chunk_for

    if device == "cpu":
        keep_freed_memory()  # as local_train does in every training process
    model, names, _ = _setup(variant, size_hw=size_hw, device=device)
    started = time.perf_counter()
    choice = chunk_for(model, names, input_size=size_hw, face_tasks=(), grouped=False, cap=cap, fraction=share)
    seconds = time.perf_counter() - started
    del model
    padded = {f"dpsgd@{fixed}": fixed, "dpsgd@auto": choice.size, f"fpdp@{fixed}": fixed, "fpdp@auto": choice.size}
    steps = _steps(variant, batch, fixed, ["nonprivate", "nonprivate-2x"], size_hw=size_hw, device=device,
                   padded=padded)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for step in steps.values():  # warm-up: allocations, kernels
        step()
        sync()
    times = _interleaved(steps, repeats, before=gc.collect if device == "cpu" else sync, after=sync)
    ratios = {kind: [t / b for t, b in zip(times[kind], times["nonprivate"])] for kind in times}
    for method in ("dpsgd", "fpdp"):  # the sized chunk against the fixed one, round by round
        ratios[f"{method}@auto-vs-{fixed}"] = [a / f for a, f in zip(times[f"{method}@auto"],
                                                                    times[f"{method}@{fixed}"])]
    ratios["fpdp@auto-vs-2x"] = [t / b for t, b in zip(times["fpdp@auto"], times["nonprivate-2x"])]
    result = {"chunk": {"size": choice.size, "cap": cap, "fixed": fixed, "share": share, "seconds": seconds,
                        "peak_mb": choice.peak_bytes / 2**20, "budget_mb": choice.budget_bytes / 2**20},
              "ms": {kind: _spread([1000 * t for t in ts]) for kind, ts in times.items()},
              "ratio": {kind: _spread(rs) for kind, rs in ratios.items()}}
    if queue is None:
        return result
    queue.put(result)
    return None


def _chunks(args, command: str) -> int:
    """``--chunks``: the sized chunk beside the fixed one, per variant; writes dp_step_chunks[_cuda].json."""
    from fedpose.shared.training.provenance import provenance

    cuda = args.device == "cuda"
    size_hw = tuple(int(v) for v in args.input.split("x")) if cuda else INPUT
    batch = args.batch if cuda else BATCH
    cap = args.cap or batch
    started = time.time()
    result: dict = {"input": list(size_hw), "batch": batch, "k": K, "repeats": args.repeats, "variants": {}}
    if cuda:
        import torch

        result["device"] = torch.cuda.get_device_name(0)
    for variant in args.variants.split(","):
        settings = (variant, batch, args.fixed, cap, args.chunk_memory, args.repeats, size_hw, args.device)
        run = _chunk_comparison(*settings) if cuda else _in_process(_chunk_comparison, *settings)
        result["variants"][variant] = run
        c = run["chunk"]
        print(f"\n{variant} @ {size_hw[0]}x{size_hw[1]}, batch {batch}, {args.device}, {args.repeats} rounds: chunk "
              f"chosen {c['size']} of cap {c['cap']} (peak {c['peak_mb']:.0f} MB of {c['budget_mb']:.0f} MB allowed, "
              f"chosen in {c['seconds']:.2f} s); fixed {c['fixed']}")
        print(f"{'step':<22}{'ms (median)':>12}{'x nonprivate':>14}{'  min-max':>14}")
        for kind in run["ms"]:
            r = run["ratio"][kind]
            print(f"{kind:<22}{run['ms'][kind]['median']:>12.1f}{r['median']:>14.2f}{r['min']:>8.2f}-{r['max']:.2f}")
        for kind in (f"dpsgd@auto-vs-{args.fixed}", f"fpdp@auto-vs-{args.fixed}", "fpdp@auto-vs-2x"):
            r = run["ratio"][kind]
            print(f"{kind:<34}{r['median']:>14.2f}{r['min']:>8.2f}-{r['max']:.2f}")
    result["provenance"] = provenance(command=command, seconds=time.time() - started)
    results = Path(__file__).resolve().parent / "results"
    out = args.out or results / ("dp_step_chunks_cuda.json" if cuda else "dp_step_chunks.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def _in_process(target, *args, env: dict[str, str] | None = None):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    saved = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})  # a spawned process starts with the parent's environment as it is now
    try:
        proc.start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    result = queue.get(timeout=3600)
    proc.join()
    return result


# glibc keeps freed heap blocks mapped, so its high-water mark also counts fragmentation (it grew with the
# number of chunks in one step); with every block above 64 KiB mapped on its own, the peak is the live memory.
LIVE_MEMORY = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="interleaved timing rounds (default: 7)")
    parser.add_argument("--variants", default="tinyvit-small,tinyvit-5m")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: benchmarks/results/dp_step.json (dp_step_cuda.json with --device cuda)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: every kind in one process on the GPU, at --input and --batch (default: cpu)")
    parser.add_argument("--input", default="256x192", help="HxW with --device cuda (default: the paper's 256x192)")
    parser.add_argument("--batch", type=int, default=256, help="batch with --device cuda (default: 256)")
    parser.add_argument("--chunk", type=int, default=32, help="per-sample chunk with --device cuda (default: 32)")
    parser.add_argument("--chunks", action="store_true",
                        help="instead: DP-SGD and FP-DP with padded chunks of --fixed rows beside chunks sized from "
                             "the free memory (--chunk-memory, at most --cap rows); writes dp_step_chunks[_cuda].json")
    parser.add_argument("--fixed", type=int, default=16, help="--chunks: the fixed chunk (default: 16, a policy's)")
    parser.add_argument("--cap", type=int, default=None, help="--chunks: the sized chunk's cap (default: the batch)")
    parser.add_argument("--chunk-memory", type=float, default=0.5,
                        help="--chunks: the share of the free memory the sized chunk may hold (default: 0.5)")
    args = parser.parse_args(argv)
    from fedpose.shared.training.provenance import provenance

    results = Path(__file__).resolve().parent / "results"
    command = " ".join(["python", "benchmarks/dp_step.py", *(argv if argv is not None else sys.argv[1:])])
    if args.chunks:
        return _chunks(args, command)
    if args.device == "cuda":
        started = time.time()
        result = _cuda(args)
        result["provenance"] = provenance(command=command, seconds=time.time() - started)
        out = args.out or results / "dp_step_cuda.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
        return 0
    args.out = args.out or results / "dp_step.json"

    kinds = ["nonprivate", "nonprivate-2x", "dpsgd", "fpdp"]  # what a site runs, in a process of their own
    try:
        import opacus  # noqa: F401

        references = ["nonprivate", "dpsgd-generic", "opacus"]  # beside their own non-private step
    except ImportError:
        references = ["nonprivate", "dpsgd-generic"]
    started = time.time()
    result: dict = {"input": list(INPUT), "batch": BATCH, "k": K, "repeats": args.repeats, "targets": TARGETS,
                    "variants": {}}
    for variant in args.variants.split(","):
        times = _in_process(_time_variant, variant, args.repeats, kinds)
        ratios = _ratios(times)
        reference = _in_process(_time_variant, variant, args.repeats, references)
        for kind in references[1:]:
            times[kind] = reference[kind]
            ratios[kind] = [t / b for t, b in zip(reference[kind], reference["nonprivate"])]
        memory = {f"dpsgd@{n}": _in_process(_memory, variant, "dpsgd", n, env=LIVE_MEMORY) for n in (16, 32, 64)}
        memory["nonprivate@32"] = _in_process(_memory, variant, "nonprivate", 32, env=LIVE_MEMORY)
        result["variants"][variant] = {
            "ms": {kind: _spread([1000 * t for t in ts]) for kind, ts in times.items()},
            "ratio": {kind: _spread(rs) for kind, rs in ratios.items()},
            "peak_mb": memory,
        }
        print(f"\n{variant} @ {INPUT[0]}x{INPUT[1]}, batch {BATCH}, finetune parameters, {args.repeats} rounds")
        print(f"{'step':<15}{'ms (median)':>12}{'x nonprivate':>14}{'  min-max':>14}")
        for kind in times:
            r = result["variants"][variant]["ratio"][kind]
            print(f"{kind:<15}{result['variants'][variant]['ms'][kind]['median']:>12.1f}{r['median']:>14.2f}"
                  f"{r['min']:>8.2f}-{r['max']:.2f}")
        r = result["variants"][variant]["ratio"]["fpdp-vs-2x"]
        print(f"{'fpdp / nonprivate-2x':<29}{r['median']:>14.2f}{r['min']:>8.2f}-{r['max']:.2f}")
        print("peak MB above baseline: " + ", ".join(f"{k} {v:.0f}" for k, v in memory.items()))
    if "tinyvit-5m" in args.variants:
        # the basis's time moves more between processes (up to a tenth) than within one: several processes,
        # each timed a few times, and the spread of their medians beside the overall one
        runs = [_in_process(_basis, 3) for _ in range(max(3, args.repeats // 3))]
        seconds = [t for run in runs for t in run["times"]]
        medians = [statistics.median(run["times"]) for run in runs]
        result["basis"] = {"seconds": _spread(seconds), "process_medians": medians, "m": 100, "k": K,
                           "parameters": runs[0]["parameters"]}
        print(f"\nbasis (m=100, k={K}, tinyvit-5m finetune, {runs[0]['parameters']} parameters): "
              f"{statistics.median(seconds):.2f} s (min {min(seconds):.2f}, max {max(seconds):.2f}); medians of "
              f"{len(runs)} processes {min(medians):.2f}-{max(medians):.2f}")
    result["provenance"] = provenance(command=command, seconds=time.time() - started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
