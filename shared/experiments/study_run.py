"""Running the privacy-utility study: one subprocess per cell, resumable, then its tables and figures.

The grid and its cells are ``shared/experiments/study.py``; this module runs them (``fedpose study``): the
data and the public pretrained weights every cell needs are prepared once here, then each unfinished cell
runs in its own process (``cell_command`` with the cell's folder: ``python -m fedpose.cli.study CELL_DIR``)
so parallel cells never share torch's threads: ``jobs`` processes with cores / jobs threads each.
A centralized cell is ``fedpose.shared.training.runs.run_train``; a federated one is the function
``fedpose simulate`` calls (Flower simulation, one site per private split), handed to ``run_cell`` by the
CLI, which alone may compose the server's and the sites' sides; the pretrained baseline evaluates the
public-pretrained weights.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

log = logging.getLogger("fedpose")

CELL_CONFIG = "cell-config.yaml"  # the cell's run config, as the study resolved it


def prepare(cells: list[Any], *, progress: bool) -> None:
    """Data and public pretrained weights of every distinct cache the cells use (cached; run once, here)."""
    from fedpose.shared.training.runs import ensure_data, ensure_pretrained

    done: set[tuple[str, str]] = set()
    for cell in cells:
        cfg = cell.config
        key = (cfg.data.root, cfg.pretrain.out)
        if key in done:
            continue
        done.add(key)
        ensure_data(cfg, progress=progress)
        if cfg.train.strategy != "scratch" or cell.kind == "pretrained":
            ensure_pretrained(cfg, progress=progress)


def write_cell(out: Path, cell: Any) -> Path:
    """The cell's folder with what its process needs: cell.json and cell-config.yaml (not config.yaml: a
    federated cell's folder is its federation's --out, where the server saves the config.yaml it resumes with)."""
    from fedpose.shared.configuration.schema import dump_config
    from fedpose.shared.experiments.study import cell_dir

    path = cell_dir(out, cell)
    path.mkdir(parents=True, exist_ok=True)
    (path / "cell.json").write_text(json.dumps(cell.describe(), indent=1))
    dump_config(cell.config, path / CELL_CONFIG)
    return path


# Relative seconds per image (nonprivate = 1), as the study-30 cells took them (full strategy, one thread, the
# machine shared by two cells): only for the progress bar's time left.
METHOD_COST = {"nonprivate": 1.0, "psi-only": 1.1, "dpsgd": 2.7, "proj": 3.0, "fdp": 2.6, "fpdp": 3.0}
FEDERATION_OVERHEAD = 20000.0  # Flower / Ray start-up and per-round evaluation, in nonprivate images


def cost(cell: Any) -> float:
    """Expected cost of a cell in nonprivate-image units (an estimate for the progress bar, never a result)."""
    cfg = cell.config
    if cell.kind == "pretrained":
        return 500.0
    factor = METHOD_COST.get(cell.method, 1.0)
    if cell.kind == "federated":
        images = cfg.federation.rounds * cfg.federation.local_steps * cfg.train.batch_size * len(cfg.data.train_splits)
        return images * factor + FEDERATION_OVERHEAD
    n = len(cfg.data.train_splits) * cfg.data.synth.per_site  # the synthetic ward's size; real data: a guess
    return cfg.train.epochs * n * factor


def portable_metrics(metrics: dict[str, Any], cell: Any) -> dict[str, Any]:
    """``metrics`` with this machine's absolute paths put back as the cell's config names them (a record is
    committed and read on other machines)."""
    metrics = json.loads(json.dumps(metrics))
    if isinstance(metrics.get("data"), dict) and "root" in metrics["data"]:
        metrics["data"]["root"] = cell.config.data.root
    if "checkpoint" in metrics:  # the pretrained baseline's weights
        metrics["checkpoint"] = str(Path(cell.config.pretrain.out) / Path(metrics["checkpoint"]).name)
    return metrics


def record_cell(out: Path, record: Path, cell: Any) -> None:
    """Keep a finished cell's description and metrics in ``record/<id>.json`` (small: meant to be committed)."""
    from fedpose.shared.experiments.study import cell_dir

    metrics = portable_metrics(json.loads((cell_dir(out, cell) / "metrics.json").read_text()), cell)
    record.mkdir(parents=True, exist_ok=True)
    (record / f"{cell.id}.json").write_text(json.dumps({"cell": cell.describe(), "metrics": metrics}, indent=1) + "\n")


def restore_cells(out: Path, record: Path, cells: list[Any]) -> int:
    """Cells recorded in ``record`` but not finished in ``out`` become finished there (another clone ran them)."""
    from fedpose.shared.experiments.study import cell_dir, is_done

    restored = 0
    for cell in cells:
        kept = record / f"{cell.id}.json"
        if is_done(out, cell) or not kept.is_file():
            continue
        data = json.loads(kept.read_text())
        if data.get("cell") != cell.describe():
            raise ValueError(f"{kept} records another cell than {cell.id} ({data.get('cell')}): remove it")
        path = cell_dir(out, cell)
        path.mkdir(parents=True, exist_ok=True)
        (path / "cell.json").write_text(json.dumps(cell.describe(), indent=1))
        (path / "metrics.json").write_text(json.dumps(data["metrics"], indent=1))
        restored += 1
    return restored


def run_cell(path: Path, *, simulate: Callable[..., dict[str, Any]]) -> None:
    """Run the cell in ``path`` (in this process) and write its metrics.json last (the done marker); a federated
    cell runs ``simulate`` (``fedpose.cli.local_federation.simulate``, what ``fedpose simulate`` calls)."""
    from fedpose.shared.configuration.schema import load_config

    spec = json.loads((path / "cell.json").read_text())
    # The thread count ``fedpose study`` gave this cell (cores / jobs, or --threads) is the run's own count: the
    # runtime section is never part of a cell's id, so the cell stays the same point of the grid.
    cfg = load_config(path / CELL_CONFIG, {"runtime.threads": int(os.environ.get("OMP_NUM_THREADS", "1"))})
    if spec["kind"] == "train":
        from fedpose.shared.training.runs import run_train

        run_train(cfg, path, progress=False)
    elif spec["kind"] == "pretrained":
        from fedpose.shared.model.posenet import load_checkpoint
        from fedpose.shared.training.runs import ensure_data, ensure_pretrained, load_records
        from fedpose.shared.metrics.evaluation import evaluate
        from fedpose.shared.configuration.yaml_io import write_json

        t0 = time.perf_counter()
        weights = ensure_pretrained(cfg, progress=False)
        model, _ = load_checkpoint(weights)
        report, _, _ = evaluate(model, load_records(ensure_data(cfg, progress=False), cfg.data.val_split))
        write_json(path / "metrics.json", {"kind": "pretrained", "checkpoint": str(Path(weights).resolve()),
                                           "epsilon": None, **report,
                                           "seconds": round(time.perf_counter() - t0, 2)})
    elif spec["kind"] == "federated":
        resume = may_resume(path, start_of(cfg))  # an interrupted federation continues from its checkpoint
        simulate(path / CELL_CONFIG, path, sets={"runtime.threads": cfg.runtime.threads}, resume=resume,
                 progress=False, quiet=True)
        if not (path / "metrics.json").is_file():
            raise RuntimeError(f"fedpose simulate failed in {path} (no metrics.json)")
    else:
        raise ValueError(f"{path}/cell.json: unknown kind {spec['kind']!r}")


START = "start.txt"  # the weights a federated cell started from: an interrupted run resumes only from the same


def start_of(cfg: Any) -> str:
    """What a cell starts from: the SHA-256 of the pretrained weights it loads, or "scratch"."""
    import hashlib

    from fedpose.shared.training.runs import ensure_pretrained

    if cfg.train.strategy == "scratch":
        return "scratch"
    return "sha256:" + hashlib.sha256(ensure_pretrained(cfg, progress=False).read_bytes()).hexdigest()


def may_resume(path: Path, start: str) -> bool:
    """Whether the interrupted federation in ``path`` may continue: only from the start it began with. A run
    begun from other weights (the pretraining was redone, or a run from before starts were kept) is removed,
    all but the cell's own two files, and the cell starts over; ``start`` is then kept for its next resume."""
    import shutil

    begun = (path / "checkpoint.pt").exists() or (path / "ledger.sqlite").exists()
    kept = (path / START).read_text().strip() if (path / START).is_file() else None
    if begun and kept == start:
        return True
    if begun:
        log.warning("%s: its interrupted run began from %s, the study starts from %s: starting it over", path,
                    kept or "unrecorded weights", start)
        for item in path.iterdir():
            if item.name not in ("cell.json", CELL_CONFIG, "log.txt"):
                shutil.rmtree(item) if item.is_dir() else item.unlink()
    (path / START).write_text(start + "\n")
    return False


def device_slots(jobs: int, gpus: int) -> list[int | None]:
    """The device each of ``jobs`` parallel cells runs on: GPUs round-robin when there are any, else the CPU."""
    return [j % gpus if gpus else None for j in range(jobs)]


def launch(path: Path, threads: int, slots: queue.Queue, cell_command: Sequence[str]) -> tuple[int, float, int | None]:
    """Run one cell in its own process (``cell_command`` and ``path``) on a free device slot (log in
    ``path/log.txt``); returns (exit code, seconds, GPU index or None)."""
    gpu = slots.get()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)  # the cell sees one GPU; train.device auto picks it
    t0 = time.perf_counter()
    try:
        with open(path / "log.txt", "ab") as fh, _CELLS_LOCK:
            if _STOPPING.is_set():
                return -int(signal.SIGTERM), 0.0, gpu
            cell = subprocess.Popen([*cell_command, str(path)], stdout=fh, stderr=subprocess.STDOUT, env=env)
            _CELLS.add(cell)
        code = cell.wait()
        with _CELLS_LOCK:
            _CELLS.discard(cell)
    finally:
        slots.put(gpu)
    return code, time.perf_counter() - t0, gpu


_CELLS: set[subprocess.Popen] = set()  # the cells running now: stopped with the study (``stop_cells``)
_CELLS_LOCK = threading.Lock()
_STOPPING = threading.Event()


def stop_cells(signum: int = signal.SIGTERM) -> None:
    """Start no more cells and pass ``signum`` on to the running ones: a study stopped by ``kill`` (SIGTERM
    reaches its own process only) or interrupted stops its cells too, instead of leaving them to train unseen.
    The next run starts them again (a federated cell from the last round its server saved)."""
    with _CELLS_LOCK:
        _STOPPING.set()
        for cell in _CELLS:
            if cell.poll() is None:
                cell.send_signal(signum)


def _on_sigterm(signum: int, frame: Any) -> None:
    stop_cells(signum)
    raise SystemExit(128 + signum)


def run_study(config: str | Path, out: str | Path, *, cell_command: Sequence[str], quick: bool = False, jobs: int = 1,
              threads: int | None = None, record: str | Path | None = None, report_only: bool = False,
              quiet: bool = False) -> int:
    """``fedpose study``: run every unfinished cell of the study file ``config`` under ``out`` (``jobs`` at a
    time, each with ``threads`` torch threads, default cores / jobs), keep the finished ones in ``record``, then
    write the CSV, tables and figures; 1 when a cell failed (the next run retries it), else 0."""
    from tqdm import tqdm

    from fedpose.shared.experiments.study import collect, expand, is_done, load_study
    from fedpose.shared.experiments.study_report import write_report

    if jobs < 1 or (threads is not None and threads < 1):
        raise ValueError(f"--jobs and --threads must be >= 1, got {jobs} and {threads}")
    study = load_study(config, quick=quick)
    out = Path(out)
    cells = expand(study)
    unique = list({c.id: c for c in cells}.values())
    record = Path(record) if record else None
    if record is not None and (restored := restore_cells(out, record, unique)):
        print(f"{restored} cells finished elsewhere restored from {record}", flush=True)
    todo = [c for c in unique if not is_done(out, c)]
    print(f"study {config}{' (quick)' if quick else ''}: {len(unique)} cells, "
          f"{len(unique) - len(todo)} done, {len(todo)} to run", flush=True)
    failed: list[str] = []
    if todo and report_only:
        print(f"--report-only: {len(todo)} unfinished cells left out of the report", flush=True)
    elif todo:
        per_cell = max(1, (os.cpu_count() or 1) // jobs)
        if threads is not None:
            per_cell = threads
        import torch

        torch.set_num_threads(per_cell * jobs)
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        slots: queue.Queue = queue.Queue()
        for device in device_slots(jobs, gpus):
            slots.put(device)
        print(f"{jobs} cells at a time, {per_cell} CPU threads each" +
              (f", on {gpus} GPUs round-robin" if gpus else ", on the CPU"), flush=True)
        prepare(todo, progress=not quiet)
        paths = {c.id: write_cell(out, c) for c in todo}
        # The bar counts expected work (``cost``), so its time left weighs a federated fpdp cell
        # above a nonprivate one; the cell count is in its postfix.
        total = sum(cost(c) for c in todo)
        bar = tqdm(total=round(total), desc="study", disable=quiet, dynamic_ncols=True,
                   bar_format="{l_bar}{bar}| {percentage:3.0f}% of the work [{elapsed}<{remaining}] {postfix}")
        finished = len(unique) - len(todo)
        bar.set_postfix_str(f"{finished}/{len(unique)} cells")
        _STOPPING.clear()
        main = threading.current_thread() is threading.main_thread()  # only the main thread may set a handler
        previous = signal.signal(signal.SIGTERM, _on_sigterm) if main else None
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(launch, paths[c.id], per_cell, slots, cell_command): c for c in todo}
            try:
                for future in as_completed(futures):
                    cell = futures[future]
                    code, seconds, gpu = future.result()
                    what = f"{cell.setting} {cell.method} {cell.strategy or ''} eps={cell.epsilon} C={cell.clip} " \
                           f"seed={cell.seed}{' ' + cell.variant if cell.variant else ''}"
                    where = "CPU" if gpu is None else f"GPU {gpu}"
                    if code == 0 and is_done(out, cell):
                        if record is not None:
                            record_cell(out, record, cell)
                        tqdm.write(f"done   {cell.id}  {what}  ({seconds:.0f} s on the {where})")
                    else:
                        failed.append(cell.id)
                        tqdm.write(f"FAILED {cell.id}  {what}  (exit {code}; see {paths[cell.id] / 'log.txt'})")
                    finished += 1
                    bar.set_postfix_str(f"{finished}/{len(unique)} cells", refresh=False)
                    bar.update(min(round(cost(cell)), bar.total - bar.n))
            except BaseException:  # Ctrl-C or SIGTERM: the running cells stop too, before the pool waits on them
                stop_cells()
                raise
            finally:
                if main:
                    signal.signal(signal.SIGTERM, previous)
        bar.close()
    if record is not None:  # cells finished before --record was given are kept too
        for cell in unique:
            if is_done(out, cell) and not (record / f"{cell.id}.json").is_file():
                record_cell(out, record, cell)
    rows = collect(out, cells)
    written = write_report(out, rows, cells, study)
    print(f"wrote {', '.join(str(p.relative_to(out)) for p in written)} in {out} ({len(rows)} rows)")
    if failed:
        print(f"{len(failed)} cells failed: {', '.join(failed)}; run the same command again to retry them",
              file=sys.stderr)
        return 1
    return 0


def run_cell_process(path: Path, *, simulate: Callable[..., dict[str, Any]]) -> None:
    """One cell in its own process, as ``fedpose study`` starts it: logging to its log.txt, torch's threads as
    the study gave them (``OMP_NUM_THREADS``), then ``run_cell``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    run_cell(path, simulate=simulate)
