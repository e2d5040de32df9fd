"""End to end through the CLI on a tiny synthetic ward: synth, pretrain, all five methods, eval."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from fedpose.cli.main import main

METRIC_KEYS = {
    "method", "strategy", "epsilon", "target_epsilon", "delta", "sigma", "sample_rate", "steps", "clip",
    "accountant", "claim", "pckh", "pckh@0.1", "seconds",
}
PCKH_KEYS = {"head", "shoulder", "elbow", "wrist", "hip", "knee", "ankle", "mean"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    cfg = {
        "data": {
            "source": "synthetic",
            "root": str(root / "ward"),
            "synth": {"sites": 2, "per_site": 24, "public": 40, "val": 12, "seed": 3, "image_size": 64},
            "train_splits": ["site-0", "site-1"],
            "input_size": [32, 32],
        },
        "model": {"joint_channels": 4, "hidden": 32},
        "pretrain": {"out": str(root / "pre"), "epochs": 1, "batch_size": 16},
        "privacy": {"k": 4, "m": 12, "basis_every": 2, "chunk_size": 8, "delta": 1.0e-3},
        "train": {"epochs": 1, "batch_size": 16, "public_batch_size": 8},
    }
    (root / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return root


def test_data_synth_command_writes_mpii_layout(tmp_path, capsys):
    out = tmp_path / "w"
    assert main(["data", "synth", "--out", str(out), "--sites", "2", "--per-site", "3", "--public", "4",
                 "--val", "2", "--image-size", "64", "--quiet"]) == 0
    for split in ("public", "val", "site-0", "site-1"):
        ann = json.loads((out / split / "annotations.json").read_text())
        heads = json.loads((out / split / "headboxes.json").read_text())
        assert len(ann) == len(heads) > 0
        assert {"image", "center", "scale", "joints", "joints_vis"} <= set(ann[0])
        assert (out / split / "images" / ann[0]["image"]).is_file()
    assert "synthetic ward written" in capsys.readouterr().out


@pytest.mark.parametrize("method", ["nonprivate", "dpsgd", "proj", "fdp", "fpdp"])
def test_train_every_method_from_a_fresh_directory(tiny, method, capsys):
    out = tiny / f"run-{method}"
    code = main(["train", "--config", str(tiny / "cfg.yaml"), "--method", method, "--epsilon", "2.0",
                 "--seed", "5", "--out", str(out), "--quiet"])
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert METRIC_KEYS <= set(metrics)
    assert set(metrics["pckh"]) == PCKH_KEYS and "mean" in metrics["pckh@0.1"]
    assert (out / "model.pt").is_file()
    printed = capsys.readouterr().out
    assert "claim:" in printed and "Mean" in printed
    if method == "nonprivate":
        assert metrics["epsilon"] is None and "no privacy guarantee" in metrics["claim"]
    else:
        assert 0 < metrics["epsilon"] <= 2.0 and metrics["sigma"] > 0
        assert "not for production" in metrics["claim"]  # seeded run (P7)
    if method in ("fdp", "fpdp"):
        assert "Feature-DP" in metrics["claim"] and "not record-level" in metrics["claim"]
    if method in ("dpsgd", "proj"):
        assert "record-level" in metrics["claim"] and "Feature-DP" not in metrics["claim"]
    assert metrics["images"] == "raw"


def test_a_run_that_clips_each_image_with_its_blurred_copy_names_both_and_claims_record_level(tiny):
    from fedpose.shared.configuration.schema import load_config
    from fedpose.shared.privacy.step.psi import psi_label_of

    out = tiny / "run-raw-psi"
    code = main(["train", "--config", str(tiny / "cfg.yaml"), "--method", "proj", "--epsilon", "2.0", "--seed", "5",
                 "--set", "train.images=raw+psi", "--out", str(out), "--quiet"])
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["images"] == "raw+" + psi_label_of(load_config(tiny / "cfg.yaml").privacy)
    assert "record-level" in metrics["claim"] and "Feature-DP" not in metrics["claim"]


def test_eval_prints_json_and_writes_predictions_in_order(tiny, capsys):
    if not (tiny / "run-fpdp" / "model.pt").exists():
        main(["train", "--config", str(tiny / "cfg.yaml"), "--method", "fpdp", "--seed", "5",
              "--out", str(tiny / "run-fpdp"), "--quiet"])
    capsys.readouterr()
    preds = tiny / "preds.json"
    code = main(["eval", "--checkpoint", str(tiny / "run-fpdp" / "model.pt"), "--data", str(tiny / "ward" / "val"),
                 "--predictions", str(preds), "--json", "--quiet"])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["pckh"]) == PCKH_KEYS
    ann = json.loads((tiny / "ward" / "val" / "annotations.json").read_text())
    rows = json.loads(preds.read_text())
    assert [r["image"] for r in rows] == [a["image"] for a in ann]
    assert all(len(r["joints"]) == 16 and len(r["joints"][0]) == 2 and len(r["scores"]) == 16 for r in rows)
    assert all(math.isfinite(v) for r in rows for j in r["joints"] for v in j)


def test_bad_input_is_refused_with_a_message(tiny, capsys):
    assert main(["train", "--config", str(tiny / "cfg.yaml"), "--epsilon", "-1", "--out", str(tiny / "x")]) == 3
    assert "privacy.epsilon" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(tiny / "missing.pt"), "--data", str(tiny / "ward" / "val")]) == 3
    assert "missing.pt" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(tiny / "missing.pt"), "--data", str(tiny)]) == 3
    assert "annotations.json" in capsys.readouterr().err


def test_every_command_follows_the_cli_conventions(capsys):
    """--version; -v/-q and help text on every option of every command; the exit-code scheme is the documented one."""
    import argparse

    from fedpose.cli.main import _leaves, build_parser, main
    from fedpose.shared.errors import ExitCode

    parser = build_parser()
    with pytest.raises(SystemExit) as done:
        parser.parse_args(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("fedpose ")
    missing = []
    for leaf in _leaves(parser):
        options = leaf._option_string_actions
        assert {"-v", "--verbose", "-q", "--quiet"} <= set(options), leaf.prog
        for action in leaf._actions:
            if not isinstance(action, argparse._HelpAction) and not action.help:
                missing.append(f"{leaf.prog} {action.option_strings or action.dest}")
    assert not missing, missing
    assert [c.value for c in ExitCode] == [0, 1, 2, 3, 4, 5, 130]
    with pytest.raises(SystemExit) as done:
        main(["train", "--no-such-option"])
    assert done.value.code == ExitCode.USAGE
    assert main(["train", "--config", "no-such-config", "--out", "x"]) == ExitCode.BAD_INPUT


@pytest.mark.parametrize("argv, typo, suggestion", [
    (["simulate", "--conifg", "default"], "--conifg", "--config"),  # with a required option missing, too
    (["server", "status", "--out", "x", "--jsn"], "--jsn", "--json"),
    (["edge", "run", "--model", "m.onnx", "--souce", "0"], "--souce", "--source"),
])
def test_a_mistyped_option_gets_a_suggestion(argv, typo, suggestion, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2
    assert f"{typo}: did you mean {suggestion}?" in err


def test_server_run_says_the_exit_codes_it_returns(capsys):
    """Its help and the operator's guide said 1 (failed or stopped) and 3 (not submitted); it returns 5 for both."""
    from fedpose.server.submit import NOT_SUBMITTED, RUN_FAILED
    from support.federation import REPO

    with pytest.raises(SystemExit):
        main(["server", "run", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    said = f"{int(RUN_FAILED)}: failed, stopped or not submitted"
    assert RUN_FAILED == NOT_SUBMITTED and said in shown
    guide = " ".join((REPO / "docs" / "how-to" / "server.md").read_text().split())
    assert f"{int(RUN_FAILED)} when it failed, was stopped or could not be submitted" in guide


def test_simulate_prints_flowers_log_plain_through_a_pipe_and_coloured_on_a_terminal():
    from fedpose.shared.flower.simulation import clean_log_line

    ray = ("\x1b[36m(ClientAppActor pid=7)\x1b[0m 10:06:17 INFO client.site: trained\x1b[32m [repeated 3x across "
           "cluster] (Ray deduplicates logs by default. Set RAY_DEDUP_LOGS=0 to disable log deduplication.)\x1b[0m")
    assert clean_log_line(ray, terminal=False) == "(ClientAppActor pid=7) 10:06:17 INFO client.site: trained"
    assert clean_log_line("\x1b[92mINFO \x1b[0m:      Starting", terminal=False) == "INFO :      Starting"
    assert clean_log_line("\x1b[92mINFO \x1b[0m:      Starting", terminal=True) == "\x1b[92mINFO \x1b[0m:      Starting"
    assert clean_log_line("\x1b[92mINFO \x1b[0m:      ", terminal=False) is None
