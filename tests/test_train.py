"""The local-training loop's learning-rate schedule, centralized and across federated rounds."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

from support.federation import prepare_world, world_root
from fedpose.shared.configuration.schema import replace
from fedpose.shared.training.runs import initial_model, load_records
from fedpose.shared.training.batches import make_dataset
from fedpose.shared.training.schedule import lr_factor, round_span
from fedpose.shared.training.loop import LocalData, LocalRun, local_train, step_spec


def test_cosine_decays_from_one_towards_zero_and_constant_stays():
    values = [lr_factor("cosine", s, 10) for s in range(10)]
    assert values[0] == 1.0
    assert all(a > b for a, b in zip(values, values[1:]))
    assert values[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.9)))
    assert all(lr_factor("constant", s, 10) == 1.0 for s in range(10))
    with pytest.raises(ValueError, match="outside the run"):
        lr_factor("cosine", 10, 10)


def test_round_spans_tile_the_federated_run():
    spans = [round_span(r, 5, 3) for r in (1, 2, 3)]
    assert spans == [(0, 15), (5, 15), (10, 15)]
    assert round_span(4, 5, 3) == (15, 20)  # a resumed server running past its plan
    with pytest.raises(ValueError):
        round_span(0, 5, 3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = prepare_world(world_root(tmp_path_factory))
    records = load_records(cfg.data.root, "site-0")
    return cfg, make_dataset(records, cfg, train=True, seed=0)


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_local_train_follows_the_schedule_within_its_span(tiny, schedule):
    cfg, dataset = tiny
    train = replace(cfg, **{"train.schedule": schedule, "train.lr": 0.01}).train
    model = initial_model(cfg, progress=False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=train.lr)
    local_data = LocalData(dataset)
    local_run = LocalRun(step_spec("nonprivate", train, cfg.privacy, sigma=0.0, data=local_data), 3, train,
                         cfg.privacy, schedule_span=(5, 8))
    local_train(model, local_data, local_run, generator=torch.Generator().manual_seed(0), optimizer=opt, bar=None)
    # the last of the 3 steps is global step 7 of 8
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * lr_factor(schedule, 7, 8))
    with pytest.raises(ValueError, match="do not fit"):
        local_data = LocalData(dataset)
        local_run = LocalRun(step_spec("nonprivate", train, cfg.privacy, sigma=0.0, data=local_data), 3, train,
                             cfg.privacy, schedule_span=(6, 8))
        local_train(model, local_data, local_run, generator=torch.Generator().manual_seed(0), bar=None)


def test_psi_only_images_are_refused_for_private_methods():
    from fedpose.shared.errors import ConfigError
    from fedpose.shared.configuration.schema import Config, config_from_dict

    assert Config().train.images == "raw"
    with pytest.raises(ConfigError, match="train.images"):
        config_from_dict({"train": {"method": "fpdp", "images": "psi"}})
    assert config_from_dict({"train": {"method": "nonprivate", "images": "psi"}}).train.images == "psi"


def test_psi_only_training_sees_psi_of_the_canonical_crops_only(tiny, monkeypatch):
    """The psi(x)-only baseline: every training image is psi(canonical crop), never a raw or augmented one."""
    import fedpose.shared.training.loop as step_module
    import fedpose.shared.training.batches as batches
    from fedpose.shared.privacy.step.psi import apply_psi

    cfg, dataset = tiny
    cfg = replace(cfg, **{"train.method": "nonprivate", "train.images": "psi"})
    seen = []
    real = step_module.dp_gradient

    def spy(loss_fn, params, *, private_batch, **kwargs):
        seen.append(private_batch["image"].clone())
        return real(loss_fn, params, private_batch=private_batch, **kwargs)

    monkeypatch.setattr(step_module, "dp_gradient", spy)
    model = initial_model(cfg, progress=False)
    local_data = LocalData(dataset)
    local_run = LocalRun(step_spec("nonprivate", cfg.train, cfg.privacy, sigma=0.0, data=local_data), 2, cfg.train,
                         cfg.privacy)
    local_train(model, local_data, local_run, generator=torch.Generator().manual_seed(0), bar=None)
    canonical = dataset.canonical()
    everything = apply_psi(batches.make_psi_from(cfg.privacy, torch.Generator().manual_seed(0)),
                           canonical.batch(list(range(len(canonical))))).tensors["image"]
    assert len(seen) == 2
    for batch in seen:
        for image in batch:
            assert (everything - image).abs().flatten(1).amax(1).min() < 1e-6



_STEPS_FAULTS = """
import resource, torch
{setup}
from fedpose.shared.configuration.schema import ModelConfig
from fedpose.shared.model.posenet import build_model
from fedpose.shared.model.pose_loss import make_loss_fn
from fedpose.shared.model.strategy import apply_strategy
from fedpose.shared.privacy.step.fpdp import DPSpec, dp_gradient

torch.manual_seed(0)
model = build_model(ModelConfig(variant="tinyvit-small"), (128, 96))
names = apply_strategy(model, "finetune")
loss_fn = make_loss_fn(model, names)
batch = {{"image": torch.rand(16, 3, 128, 96), "joints": torch.rand(16, 16, 2) * 90, "visible": torch.ones(16, 16)}}
spec = DPSpec(method="dpsgd", clip_norm=1.0, sigma=1.0, sample_rate=0.01, expected_batch=16.0, chunk_size=16)
gen = torch.Generator().manual_seed(0)
named = dict(model.named_parameters())

def step():
    dp_gradient(loss_fn, {{n: named[n].detach() for n in names}}, spec=spec, private_batch=batch, psi_batch=None,
                generator=gen, basis=None)

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

for _ in range(3):  # the first steps take their memory from the OS; the later ones can reuse it
    step()
before = faults()
for _ in range(5):
    step()
print(faults() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator: Linux only")
def test_a_training_process_reuses_its_freed_memory_instead_of_taking_it_from_the_os_again():
    """A DP step frees tensors of tens of MB and allocates them again in the next step. With glibc's defaults
    much of that memory goes back to the OS when it is freed and is zero-filled again page by page (tens of
    thousands of page faults a step here); local_train and the basis keep it in the process instead."""
    import subprocess

    def faults_of_five_steps(setup: str) -> int:
        code = _STEPS_FAULTS.format(setup=setup)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                             cwd=str(Path(__file__).resolve().parents[1]), env={**os.environ, "OMP_NUM_THREADS": "2"})
        assert out.returncode == 0, out.stderr
        return int(out.stdout.strip().splitlines()[-1])

    default = faults_of_five_steps("")
    kept = faults_of_five_steps("from fedpose.shared.training.allocator import keep_freed_memory\nassert "
                                "keep_freed_memory()")
    assert default > 5 * 1000, default  # the default takes memory from the OS again on every step
    assert kept < default / 10, (kept, default)  # kept: the steps reuse what the first ones took


@pytest.mark.parametrize("method, images", [("dpsgd", "raw+psi"), ("fpdp", "raw")])
def test_a_step_on_a_gpu_reads_batches_assembled_there(tiny, monkeypatch, method, images):
    """Where a training process assembles (``assembly_device``) is a device, as on a GPU: the private batch, the
    psi crops beside it and fdp/fpdp's public psi batch are all assembled there (each image's region cut into the
    dataset's cache, shared with the view), from the private set's own generator, and the steps run. Here the
    device is the CPU: the same code as CUDA."""
    import fedpose.shared.training.loop as step_module

    cfg, _ = tiny
    cfg = replace(cfg, **{"train.method": method, "train.images": images})
    dataset = make_dataset(load_records(cfg.data.root, "site-0"), cfg, train=True, seed=3)
    public = make_dataset(load_records(cfg.data.root, cfg.data.public_split), cfg, train=False)
    monkeypatch.setattr(step_module, "assembly_device", lambda device: device)
    seen = []
    real = step_module.dp_gradient

    def spy(loss_fn, params, *, private_batch, psi_batch, **kwargs):
        seen.append((private_batch["image"].shape, None if psi_batch is None else psi_batch.tensors["image"].shape))
        return real(loss_fn, params, private_batch=private_batch, psi_batch=psi_batch, **kwargs)

    monkeypatch.setattr(step_module, "dp_gradient", spy)
    model = initial_model(cfg, progress=False)
    local_data = LocalData(dataset, public=public)
    local_run = LocalRun(step_spec(method, cfg.train, cfg.privacy, sigma=1.0, data=local_data), 2, cfg.train,
                         cfg.privacy)
    before = dataset.rng.bit_generator.state
    local_train(model, local_data, local_run, generator=torch.Generator().manual_seed(0), bar=None)
    assert len(seen) == 2 and dataset._regions, "the batches were not assembled on the device"
    assert dataset.rng.bit_generator.state != before  # the view drew from the dataset's own generator
    if method == "fpdp":
        assert all(psi is not None and psi[0] == cfg.train.public_batch_size for _, psi in seen)
