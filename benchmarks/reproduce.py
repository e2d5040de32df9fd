"""Every measurement behind the results pages, from one command.

    python benchmarks/reproduce.py [--out runs/reproduce] [--only NAME ...] [--list] [--dry-run] [--force]

Each entry below runs the commands of one measurement, in order, each in its own process from the repository
root with this interpreter; the output goes to the terminal (the commands' own progress bars) and to
``OUT/NAME/<i>.log``. An entry is done when ``OUT/NAME/done.json`` exists (each command's exit code and
seconds): rerunning skips it (``--force`` reruns), and a failed command stops its entry and is rerun next time.
The files an entry lists in ``results`` are then copied to ``benchmarks/results/``, from which
``tools/render_results.py`` renders the tables of docs/results/ (``tests/test_reproduce.py`` checks that every
rendered table's file is one an entry writes). Entries without ``results`` re-measure numbers the archive page
keeps by hand.

On the 2-core CPU the whole list takes many hours (the study, the levers and the seeded runs dominate); with a
CUDA build of torch the same commands train on the GPU. Run it as a file (Opacus installs a top-level
``benchmarks`` package that shadows ``python -m benchmarks...``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
FEDPOSE = ("{py}", "-m", "fedpose.cli.main")


@dataclass(frozen=True)
class Entry:
    name: str
    what: str
    commands: tuple[tuple[str, ...], ...]  # "{py}" is this interpreter, "{out}" this entry's folder
    results: tuple[str, ...] = ()  # files of {out} copied to benchmarks/results/ when the entry is done
    records: tuple[str, ...] = ()  # folders of benchmarks/results/ its commands write themselves, cell by cell


def _levers(tag: str, *flags: str, rounds: int = 19) -> tuple[str, ...]:
    return ("{py}", "benchmarks/federation_levers.py", "--rounds", str(rounds), "--eval-every", "3", "--no-progress",
            "--out", "{out}", "--tag", tag, *flags)


def _train(out: str, *flags: str) -> tuple[str, ...]:
    return (*FEDPOSE, "train", "--config", "configs/default.yaml", "--method", "fpdp", "--seed", "1", "--quiet",
            "--out", "{out}/" + out, *flags)


ENTRIES: tuple[Entry, ...] = (
    Entry("main", "the main command's federation from its own start, over 3 noise seeds", (
        ("{py}", "benchmarks/main_seeds.py", "--config", "default", "--pretrain-seed", "0", "--seeds", "1", "2", "3",
         "--out", "{out}"),
    ), results=("main.json",)),
    Entry("pretraining", "the public-pretrained start over seeds and CPU kernels", (
        ("{py}", "benchmarks/pretrain_seeds.py", "--recipe", "no-jitter=pretrain.photometric=0", "--recipe",
         "shipped=", "--seeds", "0", "1", "2", "--capabilities", "native", "avx2", "--out", "{out}"),
    ), results=("pretraining.json",)),
    Entry("start-by-cpu", "the main command's start on this machine, added to those measured on other CPUs", (
        ("{py}", "benchmarks/start_by_cpu.py", "--out", "{out}"),
    ), results=("start_by_cpu.json",)),
    Entry("methods", "the five methods on the default config, 3 seeds", (
        ("{py}", "benchmarks/compare_methods.py", "--config", "configs/default.yaml", "--seeds", "1", "2", "3",
         "--out", "{out}", "--reuse"),
    )),
    Entry("patient", "record level vs patient level (fpdp, one seed)", (
        _train("record"),
        _train("patient-64", "--unit", "patient"),
        _train("patient-16", "--unit", "patient", "--batch-size", "16"),
    )),
    Entry("levers", "does the federation learn: the levers at 19 rounds x 10 local steps", (
        _levers("default fresh Adam FedAvg", "--seeds", "1", "2", "3"),
        _levers("dpsgd, fresh Adam FedAvg", "--method", "dpsgd", "--seeds", "1"),
        _levers("local SGD 0.01 + server Adam 0.01", "--optimizer", "sgd", "--lr", "0.01", "--server-optimizer",
                "adam", "--server-lr", "0.01", "--seeds", "1"),
        _levers("keep site Adam state", "--site-optimizer", "keep", "--seeds", "1"),
        _levers("default at 10 rounds", "--seeds", "1", rounds=10),
        _levers("B 32, 20 local steps", "--batch-size", "32", "--local-steps", "20", "--seeds", "1"),
        _levers("B 128, 5 local steps", "--batch-size", "128", "--local-steps", "5", "--seeds", "1"),
        ("{py}", "benchmarks/compare_methods.py", "--config", "configs/default.yaml", "--methods", "fpdp", "--seeds",
         "1", "2", "3", "--out", "{out}/centralized", "--reuse"),
    )),
    Entry("study", "the privacy-utility grid that fits this CPU", (
        (*FEDPOSE, "study", "--config", "configs/study-cpu.yaml", "--out", "{out}/study", "--threads", "1"),
        (*FEDPOSE, "study", "--config", "configs/study-ablations-cpu.yaml", "--out", "{out}/ablations", "--threads",
         "1", "--jobs", "2"),
    ), results=("study/results.csv",)),
    Entry("study-30", "the five methods, the eps sweep and the federation's reference at 30 epochs (hours; each "
                      "finished cell is kept in benchmarks/results/study-30, so a rerun or another clone continues)", (
        (*FEDPOSE, "study", "--config", "configs/study-30.yaml", "--out", "{out}/study-30", "--record",
         "benchmarks/results/study-30", "--threads", "1", "--jobs", "2"),
    ), records=("study-30",)),
    Entry("study-face", "the face tasks beside body pose: nonprivate, dpsgd and fpdp at eps 5 and 0.8, uncertainty "
                        "weighting on and off, and without face heads (about an hour; cells kept in "
                        "benchmarks/results/study-face)", (
        (*FEDPOSE, "study", "--config", "configs/study-face.yaml", "--out", "{out}/study-face", "--record",
         "benchmarks/results/study-face", "--threads", "1", "--jobs", "2"),
    ), records=("study-face",)),
    Entry("recordlevel", "record-level DP recipes: the public gradient norms C is chosen from, the public proxy ward "
                         "the settings are chosen on, then the ward (cells kept in benchmarks/results/)", (
        ("{py}", "benchmarks/public_grad_norms.py", "--out", "{out}/public_grad_norms.json"),
        (*FEDPOSE, "study", "--config", "configs/study-recordlevel-proxy.yaml", "--out", "{out}/proxy", "--record",
         "benchmarks/results/study-recordlevel-proxy", "--threads", "1"),
        (*FEDPOSE, "study", "--config", "configs/study-recordlevel.yaml", "--out", "{out}/ward", "--record",
         "benchmarks/results/study-recordlevel", "--threads", "1"),
    ), results=("public_grad_norms.json",), records=("study-recordlevel-proxy", "study-recordlevel")),
    Entry("recordlevel-dp", "full-dimension dpsgd where the records let it learn: its rates on the public proxy at the "
                            "noise of 1,600 and 6,400 records per site, then the ward with its diagnostics (sigma "
                            "fixed, sigma 0) and ceilings (minutes a cell at 400 records per site; cells kept in "
                            "benchmarks/results/)", (
        (*FEDPOSE, "study", "--config", "configs/study-recordlevel-dp-proxy.yaml", "--out", "{out}/dp-proxy",
         "--record", "benchmarks/results/study-recordlevel-dp-proxy", "--threads", "1"),
        (*FEDPOSE, "study", "--config", "configs/study-recordlevel-dp.yaml", "--out", "{out}/dp-ward", "--record",
         "benchmarks/results/study-recordlevel-dp", "--threads", "1"),
    ), records=("study-recordlevel-dp-proxy", "study-recordlevel-dp")),
    Entry("recordlevel-eps", "the best record-level recipe at epsilon 0.8, 2, 4, 8 and 16, 400 records per site "
                             "(about ten minutes a cell; cells kept in benchmarks/results/)", (
        (*FEDPOSE, "study", "--config", "configs/study-recordlevel-eps.yaml", "--out", "{out}/eps", "--record",
         "benchmarks/results/study-recordlevel-eps", "--threads", "1"),
    ), records=("study-recordlevel-eps",)),
    Entry("scale", "the data-scale curve: 400, 1,600 and 6,400 records per site (hours per cell at the largest; "
                   "cells kept in benchmarks/results/study-scale)", (
        (*FEDPOSE, "study", "--config", "configs/study-scale.yaml", "--out", "{out}/scale", "--record",
         "benchmarks/results/study-scale", "--threads", "1"),
    ), records=("study-scale",)),
    Entry("proj", "why proj ends below dpsgd: signal and noise of a step under Adam and SGD, and 30-epoch runs", (
        ("{py}", "benchmarks/proj_diagnosis.py", "--train", "--runs", "{out}/runs",
         "--out", "{out}/proj_diagnosis.json"),
    ), results=("proj_diagnosis.json",)),
    Entry("fpdp-terms", "what fpdp's private term adds to the blurred copies: the terms of a step at 400 and 1,600 "
                        "records per site (seconds; the 1,600-record ward is generated and pretrained first)", (
        ("{py}", "benchmarks/fpdp_terms.py", "--out", "{out}/fpdp_terms.json"),
    ), results=("fpdp_terms.json",)),
    Entry("attacks", "what the guarantee means: audits, membership inference, re-identification", (
        ("{py}", "benchmarks/privacy_attacks.py", "--out", "{out}"),
    ), results=("privacy_attacks.json",)),
    Entry("reconstruction", "what one Feature-DP reply gives a server that crafts its weights: at the public batch "
                            "the kit pins, the drawn records' label statistics; with one record, its blurred image "
                            "and labels, read back and scored", (
        ("{py}", "benchmarks/feature_dp_reconstruction.py", "--out", "{out}", "--png",
         "{out}/feature-dp-reconstruction.png"),
    ), results=("feature_dp_reconstruction.json",)),
    Entry("dp-step", "a private step against a non-private one, its memory, and the public basis (machine idle)", (
        ("{py}", "benchmarks/dp_step.py", "--repeats", "9", "--out", "{out}/dp_step.json"),
        ("{py}", "benchmarks/dp_step.py", "--chunks", "--variants", "tinyvit-small,tinyvit-5m", "--repeats", "9",
         "--out", "{out}/dp_step_chunks.json"),
    ), results=("dp_step.json", "dp_step_chunks.json")),
    Entry("dp-step-cuda", "the same steps on a GPU at the paper's input and batch (a machine with CUDA torch)", (
        ("{py}", "benchmarks/dp_step.py", "--device", "cuda", "--variants", "tinyvit-5m", "--repeats", "5",
         "--input", "256x192", "--batch", "256", "--chunk", "32", "--out", "{out}/dp_step_cuda.json"),
    ), results=("dp_step_cuda.json",)),
    Entry("batch-assembly", "how fast the training process assembles batches on this CPU, per image and on the "
                            "device path, by thread count (machine idle)", (
        ("{py}", "benchmarks/batch_assembly.py", "--threads", "1,2", "--batch", "256", "--rounds", "5", "--out",
         "{out}/batch_assembly.json"),
    ), results=("batch_assembly.json",)),
    Entry("batch-assembly-gpu", "how fast the training process assembles batches, per image on the GPU machine's "
                                "CPU and on its GPU, by thread count", (
        ("{py}", "benchmarks/batch_assembly.py", "--threads", "1,16", "--batch", "256", "--rounds", "2", "--device",
         "cuda", "--out", "{out}/batch_assembly_gpu.json"),
    ), results=("batch_assembly_gpu.json",)),
    Entry("study-paper-gpu", "the paper's model and input: the record-level recipe, fpdp, non-private, psi-only and "
                             "the start (CUDA torch; benchmarks/gpu_session.sh runs it with the above)", (
        (*FEDPOSE, "study", "--config", "configs/study-paper-gpu.yaml", "--out", "{out}/study-paper-gpu", "--record",
         "benchmarks/results/study-paper-gpu", "--jobs", "2"),
    ), records=("study-paper-gpu",)),
    Entry("study-paper-gpu-500", "the paper's setting end to end: the public start, then the record-level recipe, "
                                 "fpdp and non-private, 516 steps of 256 each (CUDA torch; benchmarks/gpu_session.sh)",
          (
        (*FEDPOSE, "study", "--config", "configs/study-paper-gpu-500.yaml", "--out", "{out}/study-paper-gpu-500",
         "--record", "benchmarks/results/study-paper-gpu-500", "--jobs", "2"),
    ), records=("study-paper-gpu-500",)),
    Entry("deploy-round", "a round on Flower's deployment engine, warm start and cold (machine idle)", (
        ("{py}", "benchmarks/deploy_round.py", "--rounds", "4", "--out", "{out}/deploy_round.json"),
    ), results=("deploy_round.json",)),
    Entry("edge-latency", "PyTorch eager against onnxruntime, and the camera pipeline (machine idle)", (
        ("{py}", "benchmarks/edge_latency.py", "--repeats", "200", "--frames", "300", "--threads", "2", "--out",
         "{out}/edge_latency.json"),
    ), results=("edge_latency.json",)),
    Entry("edge-accuracy", "the camera on the demo clip against the same model on the validation split's crops, "
                           "the public-pretrained start and the main command's federated model", (
        (*FEDPOSE, "simulate", "--config", "configs/default.yaml", "--out", "{out}/federation", "--seed", "0",
         "--quiet"),
        ("{py}", "benchmarks/edge_accuracy.py", "--model", "pretrained=runs/pretrained/model.pt", "--model",
         "federated={out}/federation/model.pt", "--threads", "1", "--out", "{out}/edge_accuracy.json"),
    ), results=("edge_accuracy.json",)),
    Entry("benchmarks", "downlink, DP pixelization", (
        ("{py}", "benchmarks/federation.py", "--json", "{out}/federation.json"),
        ("{py}", "benchmarks/pixelize.py"),
    )),
)


def command(entry_cmd: tuple[str, ...], out: Path) -> list[str]:
    return [part.replace("{py}", sys.executable).replace("{out}", str(out)) for part in entry_cmd]


def run_entry(entry: Entry, out: Path) -> bool:
    """Run one entry's commands in order; True when all succeeded (then done.json is written)."""
    out.mkdir(parents=True, exist_ok=True)
    steps = []
    for i, part in enumerate(entry.commands, 1):
        argv = command(part, out)
        print(f"  [{i}/{len(entry.commands)}] {' '.join(argv)}", flush=True)
        t0 = time.perf_counter()
        with open(out / f"{i}.log", "w", encoding="utf-8") as log:
            proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    bufsize=1)
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            code = proc.wait()
        seconds = time.perf_counter() - t0
        steps.append({"command": argv, "exit_code": code, "seconds": round(seconds, 1)})
        if code != 0:
            print(f"  failed (exit {code}) after {seconds:.0f} s: see {out / f'{i}.log'}", flush=True)
            return False
    (out / "done.json").write_text(json.dumps({"entry": entry.name, "steps": steps}, indent=2) + "\n")
    for name in entry.results:
        (RESULTS / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(out / name, RESULTS / name)
        print(f"  {out / name} -> {RESULTS / name} (render the pages: python tools/render_results.py)", flush=True)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/reproduce"))
    parser.add_argument("--only", nargs="+", choices=[e.name for e in ENTRIES], help="these entries only")
    parser.add_argument("--list", action="store_true", help="list the entries and whether each is done")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--force", action="store_true", help="rerun entries that are done")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    chosen = [e for e in ENTRIES if not args.only or e.name in args.only]
    if args.list or args.dry_run:
        for e in chosen:
            done = (out / e.name / "done.json").exists()
            print(f"{e.name:<11} {'done' if done else 'to run':<7} {e.what}" +
                  (f" -> benchmarks/results/{', '.join(e.results + e.records)}" if e.results or e.records
                   else " (the archive's numbers)"))
            if args.dry_run:
                for part in e.commands:
                    print("    " + " ".join(command(part, out / e.name)))
        return 0
    failed = []
    t0 = time.perf_counter()
    for n, e in enumerate(chosen, 1):
        if (out / e.name / "done.json").exists() and not args.force:
            print(f"[{n}/{len(chosen)}] {e.name}: done (rerun with --force)", flush=True)
            continue
        print(f"[{n}/{len(chosen)}] {e.name}: {e.what} ({time.perf_counter() - t0:.0f} s so far)", flush=True)
        if not run_entry(e, out / e.name):
            failed.append(e.name)
    print(f"{len(chosen) - len(failed)} of {len(chosen)} entries done in {time.perf_counter() - t0:.0f} s; outputs "
          f"under {out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
