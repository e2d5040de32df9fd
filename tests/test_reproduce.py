"""One command reproduces every measurement behind the results pages: benchmarks/reproduce.py."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _reproduce():
    spec = importlib.util.spec_from_file_location("reproduce", REPO / "benchmarks" / "reproduce.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["reproduce"] = module
    spec.loader.exec_module(module)
    return module


def _render():
    spec = importlib.util.spec_from_file_location("render_results", REPO / "tools" / "render_results.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["render_results"] = module
    spec.loader.exec_module(module)
    return module


def _study_record(method, pckh, start=30.0, variant="", epsilon=0.8, setting="centralized"):
    """One finished study cell as ``--record`` keeps it (seed 1; the private methods at ``epsilon``)."""
    private = method not in ("pretrained", "nonprivate")
    cell = {"id": f"{method}{setting}{pckh}", "method": method, "setting": setting, "strategy": "full",
            "epsilon": epsilon if private else None, "clip": 1.0, "seed": None if method == "pretrained" else 1,
            "variant": variant}
    metrics = {"pckh": {"mean": pckh}, "initial_pckh_mean": None if method == "pretrained" else start,
               "epsilon": epsilon if private else None, "seconds": 60.0, "steps": 570}
    return {"cell": cell, "metrics": metrics}


def test_every_rendered_table_comes_from_a_file_an_entry_writes_and_no_table_is_written_by_hand():
    """The results pages: every rendered block names a renderer, every renderer reads a file of
    benchmarks/results/ that one entry of reproduce.py writes, and every table and figure of the results pages
    (but the archive's and the benchmark list's) lies inside a rendered block."""
    render, reproduce = _render(), _reproduce()
    written = {name for e in reproduce.ENTRIES for name in (*e.results, *e.records)}
    for name, (sources, _) in [*render.RENDERERS.items(), *render.FIGURES.items()]:
        for source in sources if isinstance(sources, tuple) else (sources,):  # a block drawn from several files
            assert source in written, f"rendered block {name!r} reads {source}, which no reproduce.py entry writes"
            assert (REPO / "benchmarks" / "results" / source).exists(), source
    for figure in render.FIGURES:  # drawn from their artefact by the same tool, and shown on a page
        assert (REPO / figure).is_file(), figure
        assert any(Path(figure).name in page.read_text() for page in render.pages()), figure
    used = set()
    for page in render.pages():
        text = page.read_text()
        names = re.findall(r"<!-- rendered:([a-z0-9-]+) -->", text)
        assert set(names) <= set(render.RENDERERS), (page, names)
        used |= set(names)
        if page.parent.name != "results" or page.stem in ("archive", "benchmarks"):
            continue
        spans = [(m.start(), m.end()) for m in render.BLOCK.finditer(text)]
        for m in re.finditer(r"^\|---.*$|!\[", text, re.M):
            inside = any(a <= m.start() < b for a, b in spans)
            figure = text[m.start():m.start() + 2] == "!["
            assert inside or figure, f"{page.name}: a table outside any rendered block at {text[m.start():][:60]!r}"
    assert used == set(render.RENDERERS), f"renderers no page uses: {set(render.RENDERERS) - used}"


def test_every_command_parses_with_the_tools_it_names(tmp_path):
    """Each fedpose command parses with fedpose's own parser; each script knows every flag given to it."""
    from fedpose.cli.main import build_parser

    reproduce = _reproduce()
    helps: dict[str, str] = {}
    for entry in reproduce.ENTRIES:
        for part in entry.commands:
            argv = reproduce.command(part, tmp_path / entry.name)
            assert argv[0] == sys.executable
            if argv[1:3] == ["-m", "fedpose.cli.main"]:
                try:
                    build_parser().parse_args(argv[3:])
                except SystemExit as err:
                    pytest.fail(f"{entry.name}: fedpose does not parse {argv[3:]} ({err})")
            else:
                script = argv[1]
                assert (REPO / script).is_file(), script
                if script not in helps:
                    done = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True,
                                          timeout=120)
                    assert done.returncode == 0, done.stderr[-2000:]
                    helps[script] = done.stdout
                for flag in (a for a in argv[2:] if a.startswith("--")):
                    assert flag in helps[script], f"{entry.name}: {script} has no {flag}"
            for arg in argv:
                if arg.startswith("configs/"):
                    assert (REPO / arg).is_file(), arg


def test_an_entry_runs_its_commands_logs_them_and_is_not_rerun(tmp_path, capsys):
    reproduce = _reproduce()
    demo = reproduce.Entry("demo", "a real command", (
        ("{py}", "-m", "fedpose.cli.main", "edge", "demo-video", "--out", "{out}/demo.mp4", "--frames", "4"),))
    assert reproduce.run_entry(demo, tmp_path / "demo")
    done = json.loads((tmp_path / "demo" / "done.json").read_text())
    assert done["steps"][0]["exit_code"] == 0 and (tmp_path / "demo" / "demo.mp4").stat().st_size > 0
    assert (tmp_path / "demo" / "1.log").exists()
    broken = reproduce.Entry("broken", "a command that fails", (
        ("{py}", "-m", "fedpose.cli.main", "edge", "demo-video", "--out", "{out}/x.mp4", "--size", "not-a-size"),
        ("{py}", "-m", "fedpose.cli.main", "edge", "demo-video", "--out", "{out}/never.mp4", "--frames", "4"),))
    assert not reproduce.run_entry(broken, tmp_path / "broken")
    assert not (tmp_path / "broken" / "done.json").exists() and not (tmp_path / "broken" / "never.mp4").exists()
    assert "failed (exit" in capsys.readouterr().out
    # The command itself: an entry that is done is skipped; --list says which are.
    (tmp_path / "out" / "benchmarks").mkdir(parents=True)
    (tmp_path / "out" / "benchmarks" / "done.json").write_text("{}")
    assert reproduce.main(["--out", str(tmp_path / "out"), "--only", "benchmarks"]) == 0
    assert "benchmarks: done (rerun with --force)" in capsys.readouterr().out
    assert reproduce.main(["--out", str(tmp_path / "out"), "--list"]) == 0
    listed = capsys.readouterr().out
    assert re.search(r"benchmarks\s+done", listed) and re.search(r"study\s+to run", listed)


def test_a_record_level_study_shows_cells_of_a_stronger_start_apart_each_share_against_its_own_start():
    """A study whose cells come from two starts (the ward's, and one pretrained on more public images): the main
    table keeps the ward's own cells, and a second table the others, each share against that start and the
    non-private run from it (one table of both would compare starts, not methods)."""
    render = _render()
    stronger = "data.synth.public=2400, data.root=runs/data/w, pretrain.out=runs/p"

    record = _study_record

    records = [record("pretrained", 30.0, 30.0), record("nonprivate", 50.0, 30.0), record("proj", 35.0, 30.0),
               record("proj", 31.0, 30.0, epsilon=8.0),
               record("pretrained", 40.0, 40.0, stronger), record("nonprivate", 52.0, 40.0, stronger),
               record("proj", 46.0, 40.0, f"{stronger}, train.lr=0.003")]
    main = render.render_recordlevel(records)
    assert "| proj | record-level DP | 35.00 (1 seed) | 0.25 |" in main
    assert "| proj, eps 8 | record-level DP | 31.00 (1 seed) | 0.05 |" in main  # its own row, not averaged in
    assert "46.00" not in main
    other = render.render_recordlevel_start(records)
    assert "`data.synth.public=2400, data.root=runs/data/w, pretrain.out=runs/p`" in other
    assert "| pretrained start (public data only) | none needed | 40.00 | 0 |" in other
    assert "| proj, train.lr=0.003 | record-level DP | 46.00 (1 seed) | 0.50 |" in other
    # a third start (more public images again): its own table, its shares against its own start
    strongest = "data.synth.public=9600, data.root=runs/data/w9, pretrain.out=runs/p9"
    records += [record("pretrained", 44.0, 44.0, strongest), record("nonprivate", 54.0, 44.0, strongest),
                record("proj", 51.0, 44.0, f"{strongest}, train.lr=0.003")]
    both = render.render_recordlevel_start(records)
    first, second = both.split("Ward: ")[1:]
    assert first.startswith("`data.synth.public=2400") and "| proj, train.lr=0.003 | record-level DP | 46.00" in first
    assert second.startswith("`data.synth.public=9600") and "51.00 (1 seed) | 0.70 |" in second


def test_a_record_level_table_names_the_federation_and_its_reference_apart_from_the_pooled_run():
    """The same recipe pooled, as the federation's reachable reference (pooled records, the federation's noise) and
    federated: three rows, each labelled with its setting, in that order (an unlabelled reference row would read as
    a second pooled run of the recipe)."""
    render = _render()

    records = [_study_record("pretrained", 30.0), _study_record("nonprivate", 50.0),
               _study_record("proj", 34.0, variant="x=1", setting="federated"),
               _study_record("proj", 38.0, variant="x=1"),
               _study_record("proj", 36.0, variant="x=1", setting="reference")]
    table = render.render_recordlevel(records)
    rows = [line for line in table.splitlines() if line.startswith("| ") and "proj" in line]
    assert rows[0].startswith("| proj, x=1 | record-level DP | 38.00 (1 seed) | 0.40 |"), rows
    assert rows[1].startswith("| reference (pooled, the federation's noise), proj, x=1 | record-level DP | 36.00"), rows
    assert rows[2].startswith("| federated, proj, x=1 | record-level DP | 34.00 (1 seed) | 0.20 |"), rows


def test_a_record_level_table_gives_a_clipped_run_without_noise_no_guarantee():
    """A cell clipped without noise (privacy.noise_multiplier 0, a ceiling) carries no guarantee: its row says so
    and gives its epsilon as unbounded, where a row at a fixed sigma above 0 keeps the accountant's epsilon."""
    render = _render()
    ceiling = _study_record("proj", 39.0, variant="privacy.noise_multiplier=0.0")
    ceiling["metrics"]["epsilon"] = float("inf")
    probe = _study_record("dpsgd", 33.0, variant="privacy.noise_multiplier=0.4026")
    probe["metrics"]["epsilon"] = 90.9
    table = render.render_recordlevel([_study_record("pretrained", 30.0), _study_record("nonprivate", 50.0),
                                       ceiling, probe])
    assert "| proj, privacy.noise_multiplier=0.0 | none (diagnostic; clipped, no noise) | 39.00 (1 seed) | 0.45 | " \
           "unbounded |" in table, table
    assert "| dpsgd, privacy.noise_multiplier=0.4026 | record-level DP | 33.00 (1 seed) | 0.15 | 90.9000 |" in table


def test_a_record_level_table_orders_its_rows_the_same_in_every_process():
    """Rows that tie on method, variant and epsilon (two strategies, or two clips) come in one order whatever the
    process's string hashing: ``render_results --check`` compares the page with a fresh render in another process."""
    script = r"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("render_results", sys.argv[1])
render = importlib.util.module_from_spec(spec)
sys.modules["render_results"] = render
spec.loader.exec_module(render)
def record(method, pckh, strategy="full", clip=1.0):
    cell = {"id": f"{method}{strategy}{clip}", "method": method, "setting": "centralized", "strategy": strategy,
            "epsilon": None if method in ("pretrained", "nonprivate") else 0.8, "clip": clip,
            "seed": None if method == "pretrained" else 1, "variant": ""}
    metrics = {"pckh": {"mean": pckh}, "initial_pckh_mean": None if method == "pretrained" else 30.0,
               "epsilon": None if method in ("pretrained", "nonprivate") else 0.8, "seconds": 60.0, "steps": 570}
    return {"cell": cell, "metrics": metrics}
records = [record("pretrained", 30.0), record("nonprivate", 50.0), record("nonprivate", 33.0, "finetune"),
           record("nonprivate", 31.0, "bitfit"), record("nonprivate", 32.0, "bitfit-head"),
           record("dpsgd", 31.5, "bitfit", 0.3), record("dpsgd", 31.2, "bitfit", 1.0)]
print(render.render_recordlevel(records))
"""
    renders = {subprocess.run([sys.executable, "-c", script, str(REPO / "tools" / "render_results.py")],
                              capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in range(8)}
    assert len(renders) == 1, renders


def test_the_data_scale_table_shows_every_recorded_recipe_even_one_it_has_no_named_row_for():
    """A cell of the scale study whose recipe is none of the named rows (the recipe with its batch grown with the
    records) gets a row of its own, labelled with what it changes, at its size: a recorded cell never drops out of
    the page, and the named rows and the recipe's share of the gain stay as they were."""
    render = _render()

    def sized(method, pckh, size, variant=""):
        record = _study_record(method, pckh, variant=variant)
        ward = "" if size == 400 else f"data.synth.per_site={size}, data.root=runs/data/w{size}"
        record["cell"]["variant"] = ", ".join(p for p in (ward, variant) if p)
        record["metrics"]["data"] = {"records": {f"site-{i}": size for i in range(3)}}
        return record

    grown = f"{render.RECIPE}, train.batch_size=256"
    records = [sized("nonprivate", 50.0, 400), sized("proj", 36.0, 400, render.RECIPE),
               sized("nonprivate", 70.0, 1600), sized("proj", 38.0, 1600, render.RECIPE),
               sized("proj", 35.5, 1600, grown)]
    table = render.render_scale(records)
    rows = [line for line in table.splitlines() if line.startswith("| proj")]
    assert rows[0] == "| proj, 3e-3, V from clipped gradients | record-level DP | - | - |", rows
    assert rows[1].startswith("| proj, the site kits' recipe") and rows[1].endswith(" | - | - |"), rows
    assert rows[2].startswith("| proj, the site kits' recipe, federated") and rows[2].endswith(" | - | - |"), rows
    assert rows[3].startswith("| proj, the site kits' recipe, reference") and rows[3].endswith(" | - | - |"), rows
    assert rows[4] == "| proj, SGD momentum 0.9, 3e-3 | record-level DP | 36.00 (1 seed) | 38.00 (1 seed) |", rows
    assert rows[5] == f"| proj, {grown} | record-level DP | - | 35.50 (1 seed) |", rows
    assert "400: 0.30 (proj, SGD momentum 0.9, 3e-3); 1,600: 0.20 (proj, SGD momentum 0.9, 3e-3)." in table


def test_the_data_scale_table_has_the_kits_recipe_federated_as_its_own_row_placed_by_its_ward():
    """The kits' recipe federated (three sites, each accounting for its own records against the server) is a row of
    its own with the guarantee it carries, whatever rounds x local steps its schedule ran. A federated cell's
    metrics count no site's records (the server never learns them), so its size is its ward's: the one its variant
    names, or the study's own. It is not pooled, so it never stands as the best pooled row."""
    render = _render()
    kits = render.SCALE_KITS + ", federation.site_optimizer=keep"

    def federated(pckh, size):
        record = _sized("proj", pckh, size, f"{kits}, federation.rounds=20, federation.local_steps=150",
                        setting="federated")
        record["metrics"]["data"] = {"digest": f"server-{size}", "records": {"public": 600, "val": 240}}
        return record

    records = [_sized("nonprivate", 50.0, 400), _sized("proj", 36.0, 400, render.RECIPE),
               _sized("nonprivate", 70.0, 6400), _sized("proj", 40.0, 6400, render.SCALE_KITS),
               federated(34.0, 400), federated(45.0, 6400)]
    table = render.render_scale(records)
    row = [line for line in table.splitlines() if line.startswith("| proj, the site kits' recipe, federated")]
    assert row == ["| proj, the site kits' recipe, federated | record-level DP at each site, the server untrusted | "
                   "34.00 (1 seed) | 45.00 (1 seed) |"], table
    assert "400: 0.30 (proj, SGD momentum 0.9, 3e-3); 6,400: 0.25 (proj, the site kits' recipe (each" in table
    assert "Federated, the site kits' recipe keeps 0.20 of the gain at 400 and 0.38 at 6,400" in table, table


def test_the_data_scale_table_has_the_federations_reference_for_the_kits_recipe_beside_its_federated_row():
    """The federation's reachable reference (the pooled records with the noise the sites' own accounting puts into
    the federation's average) is a row of its own, placed by the records it pooled, named for what it is and for
    the curator it trusts, never the best pooled row; the notes split the federated row's distance to the pooled
    one at each size where all three ran."""
    render = _render()
    kits = render.SCALE_KITS + ", federation.site_optimizer=keep"
    schedule = "federation.rounds=20, federation.local_steps=150"
    federated = _sized("proj", 38.0, 6400, f"{kits}, {schedule}", setting="federated")
    federated["metrics"]["data"] = {"digest": "server", "records": {"public": 600, "val": 240}}
    records = [_sized("nonprivate", 70.0, 6400), _sized("proj", 40.0, 6400, render.SCALE_KITS), federated,
               _sized("proj", 45.0, 6400, f"{kits}, {schedule}", setting="reference")]
    table = render.render_scale(records)
    row = [line for line in table.splitlines() if line.startswith("| proj, the site kits' recipe, reference")]
    assert row == ["| proj, the site kits' recipe, reference (pooled, the federation's noise) | record-level DP, "
                   "pooled by a trusted curator: a diagnostic | 45.00 (1 seed) |"], table
    assert "6,400: 0.25 (proj, the site kits' recipe (each" in table, table  # not the reference's 0.38
    assert ("At 6,400 records per site the federated row ends 2.00 points below the pooled one: the price of not "
            "trusting the server (reference - pooled) +5.00, the federation's own (federated - reference) -7.00."
            in table), table


def test_a_scale_cell_recorded_before_the_data_counts_takes_its_size_from_a_cell_of_the_same_data():
    """Cells recorded before metrics.json counted the records per site (restored from another study's records)
    are placed by their data digest: a record of the same ward that has the counts gives them. A digest no
    counted record shares places nothing."""
    render = _render()
    counted = _study_record("nonprivate", 50.0)
    counted["metrics"]["data"] = {"digest": "ward-a", "records": {f"site-{i}": 400 for i in range(3)}}
    older = _study_record("dpsgd", 33.0, variant="train.lr=0.0001")  # a named row: "dpsgd, Adam 1e-4"
    older["metrics"]["data"] = {"digest": "ward-a"}
    stray = _study_record("dpsgd", 20.0, variant="train.lr=0.0001")
    stray["metrics"]["data"] = {"digest": "ward-b"}
    table = render.render_scale([counted, older, stray])
    assert "| dpsgd, Adam 1e-4 | record-level DP | 33.00 (1 seed) |" in table, table


def test_the_main_brief_says_when_its_runs_share_one_start_and_differ_only_in_their_noise():
    """main_seeds.py --pretrain-seed: every run starts from the main command's own pretraining, so the brief gives
    that one start and the spread of the end over the noise, not a spread of starts the main command never has."""
    render = _render()
    seeds = [{"seed": s, "start": 32.56, "final": end, "gain": end - 32.56, "best": end, "best_round": 10,
              "curve": [end], "sites": {"site-0": 0.8}, "seconds": 150.0} for s, end in ((1, 40.0), (2, 41.0))]
    summary = {key: {"mean": sum(r[key] for r in seeds) / 2, "std": 0.0 if key == "start" else 0.71}
               for key in ("start", "best", "final", "gain")}
    data = {"seeds": seeds, "summary": summary, "pretrain_seed": 0,
            "provenance": {"cpu": "AMD EPYC", "cpu_capability": "AVX512", "cpus": 2}}
    brief = render.render_main_brief(data)
    assert brief.startswith("On AMD EPYC (AVX512) the main command's public-pretrained start scores **32.6** ")
    assert "over 2 runs from it, each with its own privacy noise, the federated model ends at **40.5 ± 0.7**" in brief
    assert "| noise seed |" in render.render_main(data)
    assert render.render_main_brief({**data, "pretrain_seed": None}).startswith("Over 2 seeds on AMD EPYC")


def test_the_data_scale_share_is_the_best_record_level_row_at_each_size_and_names_it():
    """Where another record-level method beats the recipe at a size, the share of the gain is that method's,
    named, so the curve answers how many records record-level DP needs, not one recipe. The share is the page's
    one ratio, (PCKh - start) / (non-private - start), never PCKh / non-private."""
    render = _render()
    records = [_sized("nonprivate", 50.0, 400), _sized("proj", 36.0, 400, render.RECIPE),
               _sized("dpsgd", 33.0, 400, "train.lr=0.0001"), _sized("nonprivate", 80.0, 6400),
               _sized("proj", 36.0, 6400, render.RECIPE), _sized("dpsgd", 76.0, 6400, "train.lr=0.0001")]
    table = render.render_scale(records)
    assert "share of the gain at each size: 400: 0.30 (proj, SGD momentum 0.9, 3e-3); 6,400: 0.92 (dpsgd, Adam " \
           "1e-4)." in table, table
    assert "It keeps half of the gain from 6,400 records per site." in table
    assert "of non-private" not in table
    tied = render.render_scale([*records[:2], _sized("dpsgd", 36.0, 400, "train.lr=0.0001")])
    assert "400: 0.30 (proj, SGD momentum 0.9, 3e-3)." in tied  # on a tie, the recipe
    assert "It keeps half of the gain at none of the sizes where both ran (up to 400 per site)." in tied


def test_the_gpu_session_script_parses_and_runs_the_papers_setting_for_500_steps_each():
    """benchmarks/gpu_session.sh cannot run without a GPU here: its shell parses, it says how long each part
    takes, and the study it runs is the paper's setting (TinyViT-5M finetune at 256x192, C 0.1, batch 256, eps 0.8)
    with the record-level recipe, fpdp and non-private each at least 500 steps from the public start; its dry run
    (``--quick``) has the same runs at toy sizes."""
    from fedpose.shared.experiments.study import expand, load_study
    from fedpose.shared.training.schedule import steps_per_epoch

    script = REPO / "benchmarks" / "gpu_session.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    header = script.read_text().split("\nset -u", 1)[0]
    for part in ("batch assembly", "the public start", "record-level recipe", "fpdp", "non-private", "DP step"):
        assert part in header, part
    study_file = re.search(r"STUDY_CONFIG:-\$REPO/(configs/\S+\.yaml)", script.read_text()).group(1)
    runs = {}
    for quick in (False, True):
        cells = expand(load_study(REPO / study_file, quick=quick))
        runs[quick] = sorted((c.method, c.config.train.images) for c in cells)
        for cell in cells:
            cfg = cell.config
            if quick or cell.kind != "train":
                continue
            assert cfg.model.variant == "tinyvit-5m" and cfg.data.input_size == (256, 192)
            assert cfg.train.strategy == "finetune" and cfg.train.batch_size == 256
            assert cfg.privacy.clip_norm == 0.1 and cell.epsilon in (None, 0.8)
            n = len(cfg.data.train_splits) * cfg.data.synth.per_site
            assert cfg.train.epochs * steps_per_epoch(n, cfg.train.batch_size) >= 500
    assert runs[False] == runs[True] == sorted([("pretrained", "raw"), ("nonprivate", "raw"), ("fpdp", "raw"),
                                                ("proj", "raw+psi")])


def _sized(method, pckh, size, variant="", setting="centralized"):
    """A scale-study cell at ``size`` records per site (the ward's own at 400)."""
    record = _study_record(method, pckh, variant=variant, setting=setting)
    record["cell"]["variant"] = ", ".join(p for p in ("" if size == 400 else f"data.synth.per_site={size}",
                                                      variant) if p)
    record["metrics"]["data"] = {"records": {f"site-{i}": size for i in range(3)}}
    return record


def _summary_records(render, start=30.0):
    """(record-level study, five-method study, scale study), every cell from the same start unless ``start``."""
    kits = render.BEST + ", federation.site_optimizer=keep"
    recordlevel = [_study_record("pretrained", 30.0), _study_record("nonprivate", 50.0),
                   _study_record("proj", 36.0, variant=render.BEST),
                   _study_record("proj", 35.0, variant=kits, setting="federated"),
                   _study_record("proj", 39.0, variant="train.lr=0.1")]  # not the kits' recipe: not in the summary
    study30 = [_study_record("pretrained", start, start), _study_record("nonprivate", 50.0, start),
               _study_record("fpdp", 46.0, start), _study_record("fpdp", 40.0, start, setting="federated"),
               _study_record("dpsgd", 31.0, start)]
    scale = [_sized("nonprivate", 50.0, 400), _sized("fpdp", 46.0, 400), _sized("proj", 36.0, 400, render.RECIPE),
             _sized("nonprivate", 80.0, 6400), _sized("fpdp", 75.0, 6400), _sized("proj", 36.0, 6400, render.RECIPE)]
    return recordlevel, study30, scale


def test_the_summary_gives_each_guarantee_its_accuracy_its_share_of_the_gain_and_the_records_it_needs():
    """The page's first screen, for a hospital: the start, non-private, Feature-DP and the site kits' record-level
    recipe, pooled and federated, each with its share of the gain (defined there, the page's one ratio), and from
    the scale study how much each guarantee keeps at each size and from which size it keeps half of the gain."""
    render = _render()
    summary = render.render_summary(_summary_records(render))
    assert "| the public-pretrained start | none needed (public data only) | 30.00 (0) | |" in summary, summary
    assert "| non-private | none | 50.00 (1) | |" in summary, summary
    assert "| fpdp | Feature-DP | 46.00 (0.80) | 40.00 (0.50) |" in summary, summary
    assert "| proj, the site kits' record-level recipe | record-level DP | 36.00 (0.30) | 35.00 (0.25) |" in summary
    assert "39.00" not in summary  # another recipe, however high, is not what a kit ships
    assert "(PCKh - start) / (non-private - start)" in summary
    assert "Feature-DP keeps 0.80 of the gain at 400 records per site and 0.90 at 6,400" in summary, summary
    assert "the best record-level run of that study (which did not run the kits' recipe) 0.30 at 400 and 0.12 " \
           "at 6,400" in summary, summary
    assert "With Feature-DP 400 records per site keep half of the gain or more" in summary, summary
    assert "with record-level DP none of the sizes measured does (up to 6,400 per site)" in summary, summary
    assert "of non-private" not in summary
    with pytest.raises(ValueError, match="different pretrained weights"):  # two starts would compare starts
        render.render_summary(_summary_records(render, start=31.0))


def test_the_kits_record_level_recipe_is_the_one_the_operators_guide_provisions():
    """The results page's "site kits' recipe" is the record-level recipe docs/how-to/server.md provisions with."""
    render = _render()
    guide = (REPO / "docs" / "how-to" / "server.md").read_text()
    command = guide.split("fedpose provision", 1)[1].split("```", 1)[0]
    provisioned = set(re.findall(r"--set (\S+)", command))
    assert provisioned == {"train.method=proj", *render.BEST.split(", "), "federation.site_optimizer=keep"}, command


def test_the_methods_plot_shows_the_kits_record_level_recipe_where_its_records_are_and_says_where_not(tmp_path):
    """The methods-against-epsilon figure draws the kits' recipe from the record-level study's cells (pooled and
    federated, at the epsilon they ran at); its caption says so, and says so too when no cell of the recipe exists
    rather than drawing one."""
    render = _render()
    recordlevel, study30, _ = _summary_records(render)
    caption = render.render_study30_recipe(recordlevel)
    assert "record-level recipe the site kits ship" in caption
    assert "epsilon 0.8 only: 36.00 (1 seed) pooled and 35.00 (1 seed) federated" in caption, caption
    missing = render.render_study30_recipe(recordlevel[:2])
    assert "no cell of it has run" in missing and "36.00" not in missing, missing
    with_recipe, without = tmp_path / "with.png", tmp_path / "without.png"
    render.figure_study30((study30, recordlevel), with_recipe)
    render.figure_study30((study30, recordlevel[:2]), without)
    assert with_recipe.read_bytes() != without.read_bytes()


def test_the_results_page_opens_with_a_one_screen_summary_and_one_ratio_defined_once():
    """docs/results/index.md starts with its summary (about one screen, before any other section) and uses one
    ratio, the share of the gain, defined once: no "share of non-private" or "% of non-private" anywhere."""
    page = (REPO / "docs" / "results" / "index.md").read_text()
    sections = page.split("\n## ")
    first = sections[1]
    assert first.startswith("In short") and "<!-- rendered:summary -->" in first, first[:200]
    assert len(first.strip().splitlines()) <= 30, len(first.strip().splitlines())
    assert page.count("(PCKh - start) / (non-private - start)") == 1
    assert not re.search(r"of non-private\b(?! training| run)", page), re.findall(r".{60}of non-private.{20}", page)


def test_the_epsilon_curve_gives_each_runs_share_of_the_gain_and_where_it_keeps_two_thirds():
    """The recipe against epsilon: each cell's share of the gain against the data-scale study's non-private run at
    400 records per site from the same start, and the first epsilon at which it keeps two thirds (else "above" the
    largest one run)."""
    render = _render()
    start, top = render._nonprivate_400()
    below = [_study_record("proj", start + 0.5 * (top - start), start=start, epsilon=e) for e in (0.8, 4.0)]
    for r, sigma in zip(below, (6.44, 1.6)):
        r["metrics"]["sigma"] = sigma
    text = render.render_recordlevel_eps(below)
    assert "| 0.8 (0.800) | 6.440 |" in text and "| 0.50 |" in text
    assert "none of these: above epsilon 4" in text
    above = _study_record("proj", start + 0.7 * (top - start), start=start, epsilon=16.0)
    above["metrics"]["sigma"] = 0.5
    assert "two thirds of the gain from epsilon 16" in render.render_recordlevel_eps([*below, above])


def test_a_cells_table_gives_one_row_per_setting_with_its_seeds_mean_and_spread():
    """A study's cells table (the full-dimension dpsgd blocks): the seeds of one setting are one row, mean ± std
    (seeds), not rows that look like the same cell measured twice."""
    render = _render()
    rows = []
    for seed, value in ((1, 40.0), (2, 42.0), (3, 44.0)):
        r = _study_record("dpsgd", value, variant="train.lr=0.001")
        r["cell"]["seed"] = seed
        r["metrics"]["sigma"] = 0.1
        rows.append(r)
    single = _study_record("dpsgd", 37.0, variant="train.lr=0.03")
    single["metrics"]["sigma"] = 0.4
    text = render.render_cells([*rows, single], "fedpose study")
    assert text.count("train.lr=0.001") == 1
    assert "| 42.00 ± 2.00 (3) |" in text and "| 37.00 |" in text


def test_the_scale_table_and_summary_give_the_kits_recipe_where_the_scale_study_ran_it():
    """A hospital runs the site kits' recipe, so where the data-scale study ran it (today's defaults: the task
    weights public and V from clipped public gradients, put back over that study's older base) the table has a row
    of its own and the summary's "how many records" gives that recipe's share of the gain at each size it ran,
    beside the best record-level run at each size."""
    render = _render()
    recordlevel, study30, scale = _summary_records(render)
    kits = render.SCALE_KITS
    assert kits.endswith(render.BEST) and "train.task_weights=auto" in kits and "privacy.basis_rows=clipped" in kits
    scale += [_sized("proj", 38.0, 400, kits), _sized("proj", 39.0, 400, kits), _sized("proj", 40.0, 6400, kits)]
    table = render.render_scale(scale)
    row = next(line for line in table.splitlines() if line.startswith("| proj, the site kits' recipe"))
    assert row.endswith("| record-level DP | 38.50 ± 0.71 (2) | 40.00 (1 seed) |"), row
    assert "400: 0.42 (proj, the site kits' recipe" in table, table
    summary = render.render_summary((recordlevel, study30, scale))
    assert "the site kits' record-level recipe keeps 0.42 at 400 and 0.20 at 6,400" in summary, summary
    assert "the best record-level run at each size 0.42 at 400 and 0.20 at 6,400" in summary, summary
    assert "which did not run the kits' recipe" not in summary


def test_the_audits_time_is_every_audit_rows_own_after_a_partial_rerun():
    """``--audit-methods recipe`` reruns two audit rows and keeps the others: the audits' time in
    privacy_attacks.json is then the sum of every row's own run, not the time of the last partial rerun. The
    other parts (mia, reid) run whole: their time is the run's."""
    spec = importlib.util.spec_from_file_location("privacy_attacks", REPO / "benchmarks" / "privacy_attacks.py")
    attacks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(attacks)
    results = {"audit": [{"name": "kept", "seconds": 120.0}, {"name": "rerun", "seconds": 30.5}]}
    assert attacks.part_seconds("audit", results, elapsed=31.0) == 150.5
    assert attacks.part_seconds("mia", results, elapsed=384.5) == 384.5


def test_the_readmes_records_paragraph_is_rendered_from_the_scale_dp_and_epsilon_records():
    """The README's "how many records a site needs" is rendered, not typed: the site kits' recipe's share of the
    gain at each size the data-scale study ran it (with its seeds), the best record-level run at each size,
    full-dimension DP-SGD at the largest size, and the kits' recipe against epsilon with its clipped ceiling
    (what says whether the noise or the step holds it). No size keeping half of the gain reads "more than"."""
    render = _render()
    kits = render.SCALE_KITS
    scale = [_sized("nonprivate", 50.0, 400), _sized("nonprivate", 80.0, 1600), _sized("nonprivate", 90.0, 6400),
             *(_sized("proj", v, 400, kits) for v in (37.0, 38.0, 39.0)),
             *(_sized("proj", v, 1600, kits) for v in (44.0, 45.0, 46.0)),
             _sized("proj", 36.0, 6400, render.RECIPE)]
    dp = [_sized("dpsgd", 32.0, 6400, "train.batch_size=1024"),
          _sized("dpsgd", 33.0, 6400, "train.batch_size=1024, privacy.noise_multiplier=0.0")]  # a diagnostic
    eps = [_study_record("proj", 38.0, epsilon=0.8), _study_record("proj", 39.0, epsilon=16.0),
           _study_record("proj", 39.5, variant="privacy.noise_multiplier=0.0")]
    brief = render.render_records_brief((scale, dp, eps))
    assert brief.startswith("How many records a site needs before record-level DP pays off, measured on this ward "
                            "at epsilon 0.8: more than 6,400 per site."), brief
    assert "The site kits' record-level recipe keeps 0.40 of the non-private gain at 400 records per site and " \
           "0.30 at 1,600 (3 seeds each)" in brief, brief
    assert "the best record-level run of the data-scale study 0.40 at 400, 0.30 at 1,600 and 0.10 at 6,400" in brief
    assert "full-dimension DP-SGD on 6,400 records per site keeps 0.03" in brief, brief
    assert "0.40 of the gain at epsilon 0.8 and 0.45 at epsilon 16 (one seed each), and 0.47 clipped without " \
           "noise" in brief, brief
    seeds = render.render_records_brief((scale, dp, [*eps, _study_record("proj", 40.0, epsilon=0.8)]))
    assert "keeps 0.45 of the gain at epsilon 0.8 and 0.45 at epsilon 16 (2 seeds at epsilon 0.8, one at " \
           "epsilon 16)" in seeds, seeds  # a mean
    mixed = render.render_records_brief(([*scale, _sized("proj", 40.0, 6400, kits)], dp, eps))
    assert "recipe keeps 0.40 of the non-private gain at 400 records per site, 0.30 at 1,600 and 0.17 at 6,400 " \
           "(3 seeds at 400 and 1,600, one at 6,400)" in mixed, mixed
    half = render.render_records_brief(([*scale, _sized("proj", 70.0, 6400, kits)], dp, eps))
    assert "measured on this ward at epsilon 0.8: from 6,400 per site." in half, half
    assert "federated" not in brief
    federated = _sized("proj", 48.0, 6400, f"{kits}, federation.site_optimizer=keep, federation.rounds=20",
                       setting="federated")
    federated["metrics"]["data"] = {"records": {"public": 600, "val": 240}}  # the server counts no site's records
    sites = render.render_records_brief(([*scale, federated], dp, eps))
    assert "full-dimension DP-SGD on 6,400 records per site keeps 0.03; federated across the three sites, each " \
           "accounting for its own records against an untrusted server, the kits' recipe keeps 0.30 at 6,400 " \
           "(one seed)." in sites, sites
    assert "measured on this ward at epsilon 0.8: more than 6,400 per site." in sites, sites  # pooled decides
    # the kits' recipe clipped without noise at the larger sizes (study-recordlevel-dp): its ceiling at each
    ceiling = "train.images=raw+psi, train.lr=0.003, privacy.noise_multiplier=0.0"
    ceilings = [_sized("proj", 45.5, 1600, ceiling), _sized("proj", 40.0, 6400, ceiling)]
    larger = render.render_records_brief((scale, [*dp, *ceilings], eps))
    assert "and 0.47 clipped without noise (0.31 at 1,600 records per site and 0.17 at 6,400, one seed each): its " \
           "step, not the noise, is what holds it." in larger, larger
    noisy = render.render_records_brief((scale, [*dp, _sized("proj", 60.0, 1600, ceiling)], eps))
    assert "and 0.47 clipped without noise (0.60 at 1,600 records per site, one seed): the noise takes the " \
           "difference." in noisy, noisy
