"""`fedpose study`: the privacy-utility grid (config validation, grid expansion, the quick grid end to end)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedpose.shared.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def write_study(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "study.yaml"
    path.write_text(text)
    return path


def study_text(**fields: str) -> str:
    base = {
        "base": str(REPO / "configs" / "default.yaml"),
        "methods": "[nonprivate, dpsgd, fpdp]",
        "epsilons": "[0.2, 0.8]",
        "clips": "[1.0]",
        "strategies": "[full]",
        "settings": "[centralized, federated]",
        "seeds": "[1, 2]",
        "baselines": "[psi-only, pretrained]",
    }
    base.update(fields)
    return "".join(f"{k}: {v}\n" for k, v in base.items() if v is not None)


def test_shipped_study_config_and_its_quick_grid_load():
    from fedpose.shared.experiments.study import load_study

    full = load_study(REPO / "configs" / "study.yaml")
    assert full.axes.methods == ("nonprivate", "dpsgd", "proj", "fdp", "fpdp")
    assert full.axes.epsilons == (0.2, 0.4, 0.6, 0.8)
    assert full.axes.clips == (0.01, 0.1, 1.0)
    assert full.axes.strategies == ("finetune", "full", "scratch")
    assert full.axes.settings == ("centralized", "federated")
    quick = load_study(REPO / "configs" / "study.yaml", quick=True)
    assert len(quick.axes.epsilons) == 1 and quick.base.train.epochs == 1
    # The domain-shift ablation: the shifted public set is generated and pretrained on apart from the shared cache.
    from fedpose.shared.experiments.study import expand

    public_set = {c.config.data.synth.public_style: c for c in expand(full) if c.ablation == "public_set"}
    assert set(public_set) == {"public", "shifted"}
    same, shifted = public_set["public"], public_set["shifted"]
    assert shifted.config.data.root != same.config.data.root and shifted.config.pretrain.out != same.config.pretrain.out


def test_grid_expands_to_one_cell_per_point_and_seed(tmp_path):
    from fedpose.shared.experiments.study import expand, load_study

    cells = expand(load_study(write_study(tmp_path, study_text())))
    grid = [c for c in cells if not c.ablation]
    # nonprivate: once per strategy and seed (eps and C do not apply), centralized only (a federation
    # trains privately); dpsgd and fpdp: 2 eps x 1 C x 2 settings x 2 seeds; baselines: psi-only per seed,
    # pretrained once.
    by_method = {m: [c for c in grid if c.method == m] for m in ("nonprivate", "dpsgd", "fpdp", "psi-only",
                                                                   "pretrained")}
    assert len(by_method["nonprivate"]) == 2 and {c.setting for c in by_method["nonprivate"]} == {"centralized"}
    assert all(c.epsilon is None and c.clip is None for c in by_method["nonprivate"])
    assert len(by_method["dpsgd"]) == len(by_method["fpdp"]) == 2 * 2 * 2
    assert len(by_method["psi-only"]) == 2 and len(by_method["pretrained"]) == 1
    ids = [c.id for c in grid]
    assert len(set(ids)) == len(ids)  # every point has its own id
    fpdp = next(c for c in grid if c.method == "fpdp" and c.setting == "federated" and c.epsilon == 0.2)
    assert fpdp.config.train.method == "fpdp" and fpdp.config.privacy.epsilon == 0.2 and fpdp.config.train.seed == 1
    # ids are stable: the same study expands to the same ids
    assert [c.id for c in expand(load_study(write_study(tmp_path, study_text())))] == [c.id for c in cells]


def test_ablation_variants_resolve_and_the_default_variant_is_the_grid_cell(tmp_path):
    from fedpose.shared.experiments.study import expand, load_study

    text = study_text(seeds="[1]", settings="[centralized]", epsilons="[0.8]") + (
        "ablations:\n  k: [{privacy.k: 10}, {privacy.k: 50}]\n  dplh: [{model.task_uncertainty: false}]\n"
        "  mine: [{data.root: /elsewhere/ward, data.synth.seed: 3}]\n"
    )
    cells = expand(load_study(write_study(tmp_path, text)))
    k = [c for c in cells if c.ablation == "k"]
    assert [c.variant for c in k] == ["privacy.k=10", "privacy.k=50"]
    assert k[0].config.privacy.k == 10 and k[0].method == "fpdp"
    grid_fpdp = next(c for c in cells if not c.ablation and c.method == "fpdp")
    assert k[1].id == grid_fpdp.id  # the default k is the grid's own cell: run once
    dplh = next(c for c in cells if c.ablation == "dplh")
    assert dplh.config.model.task_uncertainty is False
    assert dplh.config.pretrain.out != grid_fpdp.config.pretrain.out  # another model: its own pretraining
    assert dplh.config.data.root == grid_fpdp.config.data.root  # same data: shared
    mine = next(c for c in cells if c.ablation == "mine")
    assert mine.config.data.root == "/elsewhere/ward"  # a variant that names its data keeps it
    assert mine.config.pretrain.out not in (grid_fpdp.config.pretrain.out, dplh.config.pretrain.out)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("methods", "[fpdp, sgd]", "study.methods\\[1\\]"),
        ("methods", "[]", "study.methods: list at least one"),
        ("epsilons", "[0.8, -1]", "study.epsilons: .* > 0"),
        ("clips", "[0]", "study.clips: .* > 0"),
        ("seeds", "[1, 1]", "study.seeds: 1 is listed twice"),
        ("settings", "[centralised]", "study.settings\\[0\\]"),
        ("baselines", "[blur]", "study.baselines\\[0\\]"),
        ("strategies", "full", "study.strategies: expected a list"),
        ("base", "nowhere.yaml", "config file .*nowhere.yaml does not exist"),
        ("seeds", "[1]\nepochs: 3", "unknown config key study.epochs"),
        ("seeds", "[1]\noverrides: {train.lr: fast}", "train.lr"),
        ("seeds", "[1]\nablations: {k: [{privacy.kk: 3}]}", "study ablations.k\\[0\\].*privacy.kk"),
        ("seeds", "[1]\nablations: {k: 3}", "study ablations.k: expected a list"),
    ],
)
def test_bad_study_configs_name_what_is_wrong(tmp_path, field, value, message):
    from fedpose.shared.experiments.study import expand, load_study

    with pytest.raises(ConfigError, match=message):
        expand(load_study(write_study(tmp_path, study_text(**{field: value}))))


def test_quick_without_a_quick_section_is_refused(tmp_path):
    from fedpose.shared.experiments.study import load_study

    with pytest.raises(ConfigError, match="no 'quick' section"):
        load_study(write_study(tmp_path, study_text()), quick=True)


def test_the_epsilon_figure_draws_only_panels_it_has_points_for(tmp_path):
    """The figure draws the grid's default-variant cells (each variant is a recipe of its own, not a point of the
    epsilon curve). A study whose private cells all change the recipe, or whose federated cells do, gets no empty
    figure or panel, and no legend warning."""
    import warnings

    from fedpose.shared.experiments.study_report import eps_figures

    def row(setting, variant="", method="proj"):
        return {"method": method, "setting": setting, "strategy": "full", "clip": 1.0, "epsilon": 0.8, "seed": 1,
                "ablation": "", "variant": variant, "mean": 38.0}

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert eps_figures(tmp_path, [row("federated", "train.lr=0.003")]) == []
        written = eps_figures(tmp_path, [row("centralized"), row("federated", "train.lr=0.003")])
    assert [p.name for p in written] == ["pckh_vs_eps_full_C1.png"]
    import matplotlib.image

    height, width = matplotlib.image.imread(written[0]).shape[:2]
    assert width < 1.5 * height  # one panel (centralized), not an empty federated one beside it


def test_gap_recovered_per_point_with_the_centralized_reference_for_federations():
    from fedpose.shared.experiments.study_report import gap_rows

    def row(method, setting, eps, mean, seed=1):
        return {"method": method, "setting": setting, "strategy": "full", "clip": None if method == "nonprivate"
                else 1.0, "epsilon": None if method == "nonprivate" else eps, "seed": seed, "ablation": "",
                "mean": mean}

    rows = [row("nonprivate", "centralized", None, 60.0), row("dpsgd", "centralized", 0.8, 40.0),
            row("fpdp", "centralized", 0.8, 55.0), row("proj", "centralized", 0.8, 41.0),
            row("fdp", "centralized", 0.8, 42.0), row("dpsgd", "federated", 0.8, 30.0),
            row("fpdp", "federated", 0.8, 36.0)]
    gaps = {g["setting"]: g for g in gap_rows(rows)}
    assert gaps["centralized"]["gap_recovered"] == pytest.approx(0.75)
    assert gaps["centralized"]["ordering"] == "holds"
    assert gaps["federated"]["gap_recovered"] == pytest.approx(6 / 30)
    assert gaps["federated"]["reference"] == "centralized nonprivate"
    assert gaps["federated"]["ordering"] == "n/a (proj, fdp not run)"


@pytest.mark.slow
def test_quick_study_runs_resumes_and_writes_every_output(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "fedpose.cli.main", "study", "--config", str(REPO / "configs" / "study.yaml"),
           "--out", str(tmp_path / "study"), "--quick"]
    first = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=2400)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    out = tmp_path / "study"
    with open(out / "results.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    columns = ["cell_id", "setting", "method", "strategy", "epsilon", "clip", "seed", "ablation", "variant", "head",
               "shoulder", "elbow", "wrist", "hip", "knee", "ankle", "mean", "mean@0.1", "eps_spent", "seconds"]
    assert list(rows[0]) == columns
    settings = {(r["method"], r["setting"]) for r in rows}
    assert {("fpdp", "centralized"), ("fpdp", "federated"), ("dpsgd", "federated"), ("nonprivate", "centralized"),
            ("psi-only", "centralized"), ("pretrained", "centralized")} <= settings
    for r in rows:
        assert 0.0 <= float(r["mean"]) <= 100.0
        if r["method"] in ("dpsgd", "fpdp"):
            assert 0.0 < float(r["eps_spent"]) <= float(r["epsilon"]) + 1e-9
    assert (out / "tables.md").read_text().count("| Head | Shoulder | Elbow | Wrist | Hip | Knee | Ankle | Mean |") >= 2
    assert (out / "gap_recovered.csv").is_file() and (out / "gap_recovered.md").is_file()
    assert (out / "pckh_vs_eps_finetune_C1.png").stat().st_size > 0
    assert (out / "qualitative.png").stat().st_size > 0
    # Each cell ran with the thread count the study gave it (cores / jobs), not the config's runtime.threads.
    trained = [json.loads(p.read_text()) for p in out.glob("cells/*/metrics.json")]
    expected = max(1, (os.cpu_count() or 1) // 1)
    assert {m["provenance"]["threads"] for m in trained if "provenance" in m} == {expected}
    assert "on the CPU" in first.stdout
    done = sorted(out.glob("cells/*/metrics.json"))
    stamps = [p.stat().st_mtime_ns for p in done]

    second = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"{len(done)} cells, {len(done)} done, 0 to run" in second.stdout
    assert [p.stat().st_mtime_ns for p in done] == stamps  # nothing was rerun


def _children(pid: int) -> set[int]:
    """The processes ``pid`` started, from any of its threads (a study starts its cells from a thread pool)."""
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the process tree from Linux /proc")
def test_a_study_stopped_with_sigterm_stops_its_running_cell(tmp_path):
    """`kill PID` (a scheduler's stop, systemd, a closed ssh session) reaches the study's own process only; the
    cell it runs must stop with it, not go on training unseen (before: it did, for as long as the cell ran)."""
    import signal
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    long_cell = study_text(methods="[nonprivate]", epsilons="[0.8]", strategies="[finetune]", settings="[centralized]",
                           seeds="[1]", baselines="[]") + (  # the quick grid's tiny ward, one cell of 10^4 epochs
        "overrides: {data.root: runs/study-quick/data, data.synth: {sites: 3, per_site: 40, public: 60, val: 30, "
        "seed: 0, image_size: 64}, data.input_size: [32, 32], pretrain.out: runs/study-quick/pretrained, "
        "pretrain.epochs: 1, pretrain.batch_size: 16, train.epochs: 10000, train.batch_size: 8}\n")
    cmd = [sys.executable, "-m", "fedpose.cli.main", "study", "--config", str(write_study(tmp_path, long_cell)),
           "--out", str(tmp_path / "study"), "--quiet"]
    study = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        cells: set[int] = set()
        while not cells and time.monotonic() < deadline and study.poll() is None:
            cells = _children(study.pid)
            time.sleep(0.5)
        assert cells, "no cell started within 900 s"
        time.sleep(2.0)  # the cell is importing torch or training
        study.send_signal(signal.SIGTERM)
        assert study.wait(timeout=60) != 0
        deadline = time.monotonic() + 30  # the cell alone would train for hours
        while any(_alive(c) for c in cells) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not any(_alive(c) for c in cells), "the running cell outlived its study"
    finally:
        try:
            os.killpg(study.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        study.wait()


def test_parallel_cells_go_to_the_gpus_round_robin():
    from fedpose.shared.experiments.study_run import device_slots

    assert device_slots(3, 2) == [0, 1, 0] and device_slots(2, 0) == [None, None] and device_slots(1, 4) == [0]


def test_progress_weights_cells_by_their_expected_cost(tmp_path):
    from fedpose.shared.experiments.study_run import cost
    from fedpose.shared.experiments.study import expand, load_study

    cells = {(c.setting, c.method, c.epsilon): c for c in expand(load_study(write_study(tmp_path, study_text())))}
    central = [cost(cells[("centralized", m, 0.8)]) for m in ("dpsgd", "fpdp")]
    assert 0 < cost(cells[("centralized", "pretrained", None)]) < cost(cells[("centralized", "nonprivate", None)])
    assert central[0] < central[1]
    assert cost(cells[("federated", "fpdp", 0.8)]) > 0


def test_report_only_runs_nothing_and_reports_what_is_finished(tmp_path, capsys):
    from fedpose.cli.main import main

    config = write_study(tmp_path, study_text())
    assert main(["study", "--config", str(config), "--out", str(tmp_path / "out"), "--report-only", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "0 done, 21 to run" in printed and "21 unfinished cells left out" in printed
    assert not (tmp_path / "out" / "cells").exists()
    assert (tmp_path / "out" / "results.csv").read_text().startswith("cell_id,setting,method,")


def test_grids_put_their_keys_over_the_axes_and_shared_cells_run_once(tmp_path):
    from fedpose.shared.experiments.study import expand, load_study

    text = study_text(methods="[dpsgd, fpdp]", epsilons="[0.8]", seeds="[1, 2]", baselines="[]") + (
        "grids:\n  - {methods: [nonprivate, dpsgd, fpdp]}\n  - {epsilons: [0.2, 0.8]}\n"
        "  - {methods: [proj], epsilons: [0.2], seeds: [1], settings: [centralized]}\n")
    cells = expand(load_study(write_study(tmp_path, text)))
    points = [(c.setting, c.method, c.epsilon, c.seed) for c in cells]
    assert len(points) == len(set(points)) == len({c.id for c in cells})  # eps 0.8 is in two grids: run once
    assert sum(m == "nonprivate" for _, m, _, _ in points) == 2
    assert sorted(p for p in points if p[1] == "proj") == [("centralized", "proj", 0.2, 1)]
    assert {(e, s) for st, m, e, s in points if m == "fpdp" and st == "federated"} == {
        (e, s) for e in (0.2, 0.8) for s in (1, 2)}
    # the first grid's cells come first (eps 0.8 before the sweep)
    assert [c.epsilon for c in cells if c.method == "dpsgd"][:4] == [0.8] * 4
    # a grid's own overrides: its cells carry them as their variant and get their own ids
    tuned = expand(load_study(write_study(tmp_path, text + "  - {methods: [dpsgd], overrides: {train.lr: 0.0001}}\n")))
    own = [c for c in tuned if c.variant]
    assert {c.variant for c in own} == {"train.lr=0.0001"} and {c.method for c in own} == {"dpsgd"}
    assert all(c.config.train.lr == 0.0001 for c in own) and len(own) == 2 * 2  # 2 settings x 2 seeds
    assert not {c.id for c in own} & {c.id for c in cells}
    assert [c.id for c in tuned if not c.variant] == [c.id for c in cells]  # the other cells keep their ids
    for bad, message in (("grids: [{base: other.yaml}]", "grids\\[0\\]: a grid varies the study's base"),
                         ("grids: [{overrides: {train.lr: fast}}]", "study grids\\[0\\].overrides: .*train.lr"),
                         ("grids: [{seeds: [1, 1]}]", "study grids\\[0\\]: study.seeds: 1 is listed twice"),
                         ("grids: {methods: [fpdp]}", "study grids: expected a list")):
        with pytest.raises(ConfigError, match=message):
            load_study(write_study(tmp_path, study_text() + bad + "\n"))


def test_reference_setting_pools_the_sites_batch_and_noise_of_the_federation(tmp_path):
    import dataclasses
    import math

    from fedpose.shared.experiments.study import expand, load_study
    from fedpose.shared.training.runs import plan_sigma

    text = study_text(methods="[fpdp]", epsilons="[0.8]", seeds="[1]", baselines="[]",
                      settings="[centralized, reference]") + "overrides: {federation.rounds: 19}\n"
    cells = {c.setting: c for c in expand(load_study(write_study(tmp_path, text)))}
    pooled, reference = cells["centralized"].config, cells["reference"].config
    sites = len(pooled.data.train_splits)
    assert reference.train.batch_size == sites * pooled.train.batch_size
    assert reference.privacy.noise_factor == pytest.approx(math.sqrt(sites)) and pooled.privacy.noise_factor == 1.0
    n = sites * pooled.data.synth.per_site
    steps = reference.train.epochs * math.ceil(n / reference.train.batch_size)
    site_steps = pooled.federation.rounds * pooled.federation.local_steps
    assert abs(steps - site_steps) <= math.ceil(n / reference.train.batch_size) / 2  # one site's steps, to an epoch
    # sigma is the accountant's for the site's sampling rate and steps, times sqrt(S)
    site = plan_sigma(dataclasses.replace(reference, privacy=pooled.privacy), n=n, steps=steps)
    assert plan_sigma(reference, n=n, steps=steps) == pytest.approx(math.sqrt(sites) * site)
    with pytest.raises(ConfigError, match="reference setting needs the sites' sizes"):
        load_study(write_study(tmp_path, text.replace("overrides: {", "overrides: {data.source: files, ")))


def test_noise_factor_only_adds_noise_and_a_federation_refuses_it():
    from fedpose.shared.configuration.schema import load_config, replace

    cfg = load_config(REPO / "configs" / "default.yaml")
    for bad in (0.5, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="privacy.noise_factor: (must be a finite number >= 1|expected a finite)"):
            replace(cfg, **{"privacy.noise_factor": bad})  # (the type check names non-finite values itself)
    from fedpose.server.run import run_federation

    with pytest.raises(ConfigError, match="privacy.noise_factor: for centralized reference runs only"):
        run_federation(None, replace(cfg, **{"privacy.noise_factor": 2.0}), REPO / "runs" / "never-written")


def test_record_keeps_finished_cells_and_another_out_resumes_from_it(tmp_path, capsys):
    from fedpose.cli.main import main
    from fedpose.shared.experiments.study import GROUPS, cell_dir, expand, load_study

    config = write_study(tmp_path, study_text(methods="[dpsgd]", epsilons="[0.8]", seeds="[1]", baselines="[]",
                                              settings="[centralized]"))
    cell = expand(load_study(config))[0]
    first = tmp_path / "first"
    cell_dir(first, cell).mkdir(parents=True)
    pckh = {**{g: 40.0 for g in GROUPS}, "mean": 41.5}
    (cell_dir(first, cell) / "metrics.json").write_text(json.dumps(
        {"pckh": pckh, "pckh@0.1": {"mean": 12.0}, "epsilon": 0.79, "seconds": 3.0,
         "data": {"root": str((tmp_path / "machine" / "ward").resolve())}}))
    record = tmp_path / "record"
    assert main(["study", "--config", str(config), "--out", str(first), "--record", str(record), "--report-only",
                 "--quiet"]) == 0
    kept = json.loads((record / f"{cell.id}.json").read_text())
    assert kept["cell"]["method"] == "dpsgd" and kept["metrics"]["pckh"]["mean"] == 41.5
    assert kept["metrics"]["data"]["root"] == cell.config.data.root  # as configured: no path of this machine
    second = tmp_path / "second"  # a clean clone: nothing ran there, the record has the cell
    assert main(["study", "--config", str(config), "--out", str(second), "--record", str(record), "--report-only",
                 "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "1 cells finished elsewhere restored" in printed and "1 done, 0 to run" in printed
    rows = list(csv.DictReader(open(second / "results.csv")))
    assert [(r["method"], r["mean"], r["eps_spent"]) for r in rows] == [("dpsgd", "41.5000", "0.7900")]
    kept["cell"]["seed"] = 7  # a record that does not describe the cell it is named for is refused
    (record / f"{cell.id}.json").write_text(json.dumps(kept))
    assert main(["study", "--config", str(config), "--out", str(tmp_path / "third"), "--record", str(record),
                 "--report-only", "--quiet"]) != 0
    assert "records another cell than" in capsys.readouterr().err
    assert not (tmp_path / "third" / "cells").exists()


def test_relaunching_a_federated_cell_keeps_the_config_its_federation_saved(tmp_path):
    """A federated cell's folder is also its federation's --out, where the server saves the config it resumes
    with (config.yaml, absolute paths): launching the cell again must not overwrite that file."""
    from fedpose.shared.experiments.study_run import write_cell
    from fedpose.shared.experiments.study import cell_dir, expand, load_study

    config = write_study(tmp_path, study_text(methods="[fpdp]", epsilons="[0.8]", seeds="[1]", baselines="[]",
                                              settings="[federated]"))
    cell = expand(load_study(config))[0]
    out = tmp_path / "out"
    saved = cell_dir(out, cell) / "config.yaml"
    saved.parent.mkdir(parents=True)
    saved.write_text("# the federation's own config, saved by its server\n")
    path = write_cell(out, cell)
    assert saved.read_text() == "# the federation's own config, saved by its server\n"
    assert (path / "cell.json").is_file() and any(p.suffix == ".yaml" and p != saved for p in path.iterdir())


def test_an_interrupted_federated_cell_resumes_only_from_the_weights_it_began_with(tmp_path):
    """A federated cell killed mid-run resumes from its checkpoint; one that began from other pretrained weights
    (the start was pretrained again in between, or it began before starts were kept) starts over instead of
    finishing on top of the other start."""
    from fedpose.shared.experiments.study_run import START, may_resume, write_cell
    from fedpose.shared.experiments.study import expand, load_study

    config = write_study(tmp_path, study_text(methods="[fpdp]", epsilons="[0.8]", seeds="[1]", baselines="[]",
                                              settings="[federated]"))
    path = write_cell(tmp_path / "out", expand(load_study(config))[0])
    own = sorted(p.name for p in path.iterdir())
    assert not may_resume(path, "sha256:aaaa")  # nothing begun: start, and keep what it starts from
    assert (path / START).read_text().strip() == "sha256:aaaa"
    for name in ("checkpoint.pt", "ledger.sqlite", "rounds.jsonl"):
        (path / name).write_text("round 7")
    (path / "sites").mkdir()
    (path / "sites" / "site-0.sqlite").write_text("ledger")
    assert may_resume(path, "sha256:aaaa")  # the same start: continue
    assert (path / "checkpoint.pt").read_text() == "round 7"
    assert not may_resume(path, "sha256:bbbb")  # another start: the run is removed and begins again
    assert sorted(p.name for p in path.iterdir()) == sorted([*own, START])
    assert (path / START).read_text().strip() == "sha256:bbbb"
    (path / START).unlink()
    (path / "checkpoint.pt").write_text("round 3 of a run that kept no start")
    assert not may_resume(path, "sha256:bbbb") and not (path / "checkpoint.pt").exists()
