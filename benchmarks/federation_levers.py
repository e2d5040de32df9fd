"""Which levers make a DP federation learn: an in-process federation on the real training code (not a test).

No Flower processes: each round, every site runs ``fedpose.shared.training.loop.local_train`` on its own private
split with its own Poisson sampling and its own sigma (calibrated for rounds x local_steps at
q = B / n exactly as server/plan.py does), the site-side basis exactly as client/basis.py
``obtain_basis`` does for ``basis_mode: site`` (``public_basis_at`` at the received global weights,
a new version every ``privacy.basis_every`` rounds as server/basis.py decides), then
``fedpose.server.aggregate.aggregate`` (the mean, + the server optimizer of server/aggregate.py) and
``fedpose.shared.training.loop.evaluate`` on the val split. Site optimizer state is kept through client/optim_state.py
(real files).

Levers (CLI flags): --site-optimizer keep|fresh, --server-optimizer none|momentum|adam, --server-lr,
--server-momentum, --rounds, --local-steps, --lr, --optimizer, --schedule, --basis-every, --method.

Run: python benchmarks/federation_levers.py --rounds 19 --seeds 1 2 3 --site-optimizer keep --tag keep
Prints a table (lever, seed, PCKh@0.5 per round, final) and writes --out/<tag>.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path
from fedpose.shared.configuration.methods import PRIVATE, PROJECTED


import torch
from tqdm.auto import tqdm

from fedpose.server.aggregate import ServerOptimizer, aggregate, bound_updates
from fedpose.server.plan import _calibrated
from fedpose.shared.configuration.schema import load_config, replace
from fedpose.shared.data.mpii import load_split
from fedpose.shared.model.pose_loss import make_loss_fn
from fedpose.shared.model.strategy import apply_train_strategy
from fedpose.client.optim_state import keep_site_optimizer, site_optimizer
from fedpose.shared.training.runs import ensure_data, initial_model
from fedpose.shared.training.batches import make_dataset
from fedpose.shared.privacy.step.subspace import public_basis_at
from fedpose.shared.metrics.evaluation import evaluate
from fedpose.shared.training.schedule import round_span
from fedpose.shared.training.loop import LocalData, LocalRun, local_train, step_spec


def run_one(cfg, seed: int, *, eval_every: int, progress: bool, ema_decays: tuple[float, ...] = ()) -> dict:
    torch.manual_seed(seed)
    fed = cfg.federation
    method = cfg.train.method
    root = ensure_data(cfg, progress=False)
    sites = {name: load_split(root, name) for name in cfg.data.train_splits}
    public = make_dataset(load_split(root, cfg.data.public_split), cfg, train=False)
    val = load_split(root, cfg.data.val_split)
    model = initial_model(cfg, progress=False)
    trainable = apply_train_strategy(model, cfg.train)
    named = dict(model.named_parameters())
    plans = {}
    for i, (name, records) in enumerate(sites.items()):
        n = len(records)
        q = min(1.0, cfg.train.batch_size / n)
        sigma = _calibrated(cfg.privacy.epsilon, cfg.privacy.delta, q, fed.rounds * fed.local_steps,
                            cfg.privacy.accountant)
        data = make_dataset(records, cfg, train=True, seed=seed * 1000 + i)
        plans[name] = (n, q, sigma, data)
    server_opt = ServerOptimizer(fed.server_optimizer, lr=fed.server_lr, momentum=fed.server_momentum)
    initial = float(evaluate(model, val)[0]["pckh"]["mean"])
    curve: list[float | None] = []
    emas: dict[float, dict] = {}
    ema_curves: dict[float, list[float | None]] = {}
    version, basis = 0, None
    t0 = time.perf_counter()
    ledger_dir = Path(tempfile.mkdtemp(prefix="levers-"))
    bar = tqdm(range(1, fed.rounds + 1), desc=f"seed {seed}", disable=not progress, dynamic_ncols=True)
    for rnd in bar:
        if method in PROJECTED and (version == 0 or rnd - version >= cfg.privacy.basis_every):
            # basis_mode site: every site computes the same V from the same public set at the same
            # received global weights, so computing it once here is what each site would get.
            version = rnd
            basis = public_basis_at(model, make_loss_fn(model, trainable), trainable, public, cfg.privacy,
                                    torch.device("cpu"))
        updates = []
        for i, (name, (n, q, sigma, data)) in enumerate(plans.items()):
            local = copy.deepcopy(model)
            local_trainable = apply_train_strategy(local, cfg.train)
            ledger = ledger_dir / name / "ledger.sqlite"
            opt = site_optimizer(cfg, local, local_trainable, ledger, "levers")
            gen = torch.Generator().manual_seed(seed * 1_000_003 + i * 10_007 + rnd)
            local_data = LocalData(data)
            local_run = LocalRun(step_spec(method, cfg.train, cfg.privacy, sigma=sigma, data=local_data),
                                 fed.local_steps, cfg.train, cfg.privacy, schedule_span=round_span(rnd,
                                 fed.local_steps, fed.rounds))
            local_train(local, local_data, local_run, generator=gen, basis=basis, optimizer=opt, bar=None)
            keep_site_optimizer(cfg, opt, local, local_trainable, ledger, "levers")
            lnamed = dict(local.named_parameters())
            updates.append({k: lnamed[k].detach().clone() for k in local_trainable})  # uniform, as the server
        current = {k: named[k].detach().clone() for k in trainable}
        bounded, _, _ = bound_updates(updates, current, fed.update_bound)  # as server/run.py combines them
        with torch.no_grad():
            for k, v in server_opt.apply(current, aggregate(bounded, fed.aggregator)).items():
                named[k].copy_(v)
        for decay in ema_decays:  # the released model as an average of the global iterates: post-processing
            state = emas.setdefault(decay, {k: v.detach().clone() for k, v in model.state_dict().items()})
            for k, v in model.state_dict().items():
                if v.is_floating_point():
                    state[k].mul_(decay).add_(v.detach(), alpha=1 - decay)
        if rnd % eval_every == 0 or rnd == fed.rounds:
            curve.append(float(evaluate(model, val)[0]["pckh"]["mean"]))
            for decay, state in emas.items():
                shadow = copy.deepcopy(model)
                shadow.load_state_dict(state)
                ema_curves.setdefault(decay, []).append(float(evaluate(shadow, val)[0]["pckh"]["mean"]))
            bar.set_postfix(pckh=f"{curve[-1]:.2f}")
        else:
            curve.append(None)
            for decay in emas:
                ema_curves.setdefault(decay, []).append(None)
    final = curve[-1]
    return {"seed": seed, "initial": initial, "curve": curve, "final": final,
            "ema": {str(d): c for d, c in ema_curves.items()},
            "sigma": {s: p[2] for s, p in plans.items()}, "q": {s: p[1] for s, p in plans.items()},
            "seconds": time.perf_counter() - t0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--tag", default=None, help="name of this lever setting (default: built from the flags)")
    parser.add_argument("--out", default="runs/levers")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--local-steps", type=int)
    parser.add_argument("--method", choices=PRIVATE)
    parser.add_argument("--site-optimizer", choices=["keep", "fresh"])
    parser.add_argument("--server-optimizer", choices=["none", "momentum", "adam"])
    parser.add_argument("--server-lr", type=float)
    parser.add_argument("--server-momentum", type=float)
    parser.add_argument("--optimizer", choices=["adam", "sgd"], help="local optimizer")
    parser.add_argument("--lr", type=float, help="local lr")
    parser.add_argument("--schedule", choices=["constant", "cosine"])
    parser.add_argument("--basis-every", type=int, help="rounds between basis versions")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--eval-every", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ema", type=float, nargs="*", default=[],
                        help="also evaluate averages of the global iterates with these per-round decays")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keys = {"rounds": "federation.rounds", "local_steps": "federation.local_steps", "method": "train.method",
            "site_optimizer": "federation.site_optimizer", "server_optimizer": "federation.server_optimizer",
            "server_lr": "federation.server_lr", "server_momentum": "federation.server_momentum",
            "optimizer": "train.optimizer", "lr": "train.lr", "schedule": "train.schedule",
            "basis_every": "privacy.basis_every", "batch_size": "train.batch_size"}
    over = {dotted: getattr(args, a) for a, dotted in keys.items() if getattr(args, a) is not None}
    cfg = replace(load_config(args.config), **over) if over else load_config(args.config)
    tag = args.tag or (",".join(f"{k.split('.')[-1]}={v}" for k, v in over.items()) or "default")
    runs = []
    for seed in args.seeds:
        r = run_one(cfg, seed, eval_every=args.eval_every, progress=not args.no_progress, ema_decays=tuple(args.ema))
        runs.append(r)
        print(f"{tag} seed {seed}: final {r['final']:.2f} (from {r['initial']:.2f}) in {r['seconds']:.0f} s; "
              f"sigma {next(iter(r['sigma'].values())):.3f}", flush=True)
    finals = [r["final"] for r in runs]
    mean = statistics.mean(finals)
    sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
    print()
    print("| lever | seed | PCKh@0.5 per round | final |")
    print("|---|---|---|---|")
    for r in runs:
        c = " ".join("-" if v is None else f"{v:.1f}" for v in r["curve"])
        print(f"| {tag} | {r['seed']} | {c} | {r['final']:.2f} |")
        for decay, values in r["ema"].items():
            c = " ".join("-" if v is None else f"{v:.1f}" for v in values)
            print(f"| {tag}, average of iterates ({decay}) | {r['seed']} | {c} | {values[-1]:.2f} |")
    print(f"| {tag} | mean ± std | | {mean:.2f} ± {sd:.2f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    safe = "".join(ch if ch.isalnum() or ch in "-_.=," else "_" for ch in tag)
    (out / f"{safe}.json").write_text(json.dumps({"tag": tag, "overrides": over, "mean": mean, "std": sd,
                                                  "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
