"""What one Feature-DP reply gives a server that crafts the weights (P17 of docs/explanation/design.md),
measured on a real site.

    python benchmarks/feature_dp_reconstruction.py [--config configs/default.yaml] [--site site-0]
        [--public-batch-size B] [--png docs/img/feature-dp-reconstruction.png] [--out benchmarks/results]

A site that opted in to Feature-DP (``release_blurred_images_and_labels: true``) answers one fpdp request whose
weights are crafted (``fedpose.shared.experiments.reconstruction``) and whose basis V leaves the read tensors out,
twice: with the public batch the kit ships (the config's ``train.public_batch_size``, which the kit's policy pins;
``--public-batch-size`` for another), and with a public batch of one record. The script reads each reply as the
server would (``fedpose.shared.experiments.reconstruction_read``):

- the pinned batch (``read_batch``): the fraction of the drawn records with each joint visible and each joint's
  distribution of positions over them, scored against the drawn records (the scoring alone learns which were
  drawn), and the blended picture, scored against their mean and against the closest single record;
- one record: it finds which of the site's records the labels belong to and prints the PSNR of the rebuilt
  psi(x) (at the crafted trunk's block resolution) and the label error; the picture shows the record, psi(x),
  psi(x) at the trunk's resolution and what the server rebuilt.

It writes the picture and a JSON with the numbers and provenance. The site's data is the config's (the embedded
synthetic ward is generated on first use); its ledger lives in a temporary directory. About a minute on 2 CPU cores
once the ward exists. Run it as a file (Opacus installs a top-level ``benchmarks`` package).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


import numpy as np
import torch

SCALE = 4  # the picture's pixels per model-input pixel


def site_policy(cfg, data: Path, ledger: Path):
    """The site's own policy: Feature-DP opted in, the config's public batch, its q and normaliser."""
    from fedpose.client.policy import policy_from_dict
    from fedpose.client.data import load_split_dir

    n = len(load_split_dir(data, "site data"))
    return policy_from_dict({
        "policy_version": 3, "site": data.name, "epsilon": cfg.privacy.epsilon, "delta": cfg.privacy.delta,
        "lifetime_rounds": 1, "rounds_per_federation": 1, "steps_per_round": 1,
        "sample_rate": min(1.0, cfg.train.batch_size / n), "expected_batch": float(cfg.train.batch_size),
        "clip_norm": cfg.privacy.clip_norm, "psi": cfg.privacy.psi, "psi_min": cfg.privacy.psi_param,
        "augment": cfg.data.augment, "release_blurred_images_and_labels": True,
        "public_batch_size": cfg.train.public_batch_size,
        "data_path": str(data), "ledger_path": str(ledger),
    })


def _canvas(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """(h, w, 3) RGB in [0, 1] -> (H * SCALE, W * SCALE, 3) BGR uint8, nearest-neighbour (blocks stay blocks)."""
    import cv2

    rgb = (np.clip(image, 0.0, 1.0) * 255.0).round().astype(np.uint8)
    return cv2.resize(rgb[..., ::-1], (size[1] * SCALE, size[0] * SCALE), interpolation=cv2.INTER_NEAREST)


def _draw(canvas: np.ndarray, joints: np.ndarray, visible: np.ndarray, colour: tuple[int, int, int]) -> np.ndarray:
    import cv2

    from fedpose.shared.data.joints import SKELETON

    out = canvas.copy()
    pts = [tuple(int(round(v * SCALE)) for v in j) for j in joints]
    for a, b in SKELETON:
        if visible[a] > 0.5 and visible[b] > 0.5:
            cv2.line(out, pts[a], pts[b], colour, 1, cv2.LINE_AA)
    for p, v in zip(pts, visible):
        if v > 0.5:
            cv2.circle(out, p, 2, colour, -1, cv2.LINE_AA)
    return out


def picture(path: Path, size: tuple[int, int], raw: torch.Tensor, psi: torch.Tensor, truth: np.ndarray,
            rebuilt: np.ndarray, joints: torch.Tensor, visible: torch.Tensor, readout) -> None:
    """Four panels with captions: the record x, psi(x), psi(x) as the crafted trunk keeps it, the rebuild."""
    import cv2

    true_pts, true_vis = joints.numpy(), visible.numpy()
    got_pts = np.nan_to_num(readout.joints)
    panels = [
        ("record x", _draw(_canvas(raw.permute(1, 2, 0).numpy(), size), true_pts, true_vis, (0, 255, 0))),
        ("psi(x)", _draw(_canvas(psi.permute(1, 2, 0).numpy(), size), true_pts, true_vis, (0, 255, 0))),
        ("psi(x), blocks", _canvas(truth, size)),
        ("server's rebuild", _draw(_canvas(rebuilt, size), got_pts, readout.visible, (0, 0, 255))),
    ]
    tiles = []
    for caption, img in panels:
        band = np.full((18, img.shape[1], 3), 255, np.uint8)
        cv2.putText(band, caption, (3, 13), cv2.FONT_HERSHEY_SIMPLEX, 0.4, (0, 0, 0), 1, cv2.LINE_AA)
        tiles.append(np.vstack([band, img]))
    gap = np.full((tiles[0].shape[0], 6, 3), 255, np.uint8)
    row = np.hstack([x for t in tiles for x in (t, gap)][:-1])
    path.parent.mkdir(parents=True, exist_ok=True)
    if not cv2.imwrite(str(path), row):
        raise OSError(f"could not write {path}")


def main(argv: list[str] | None = None) -> dict:
    from fedpose.shared.configuration.schema import load_config, replace
    from fedpose.shared.experiments.reconstruction import attack_config
    from fedpose.shared.experiments.reconstruction_read import (
        find_record, planes_of, psnr, read_reply, render, score,
    )
    from fedpose.shared.training.provenance import provenance
    from fedpose.shared.training.runs import ensure_data
    from fedpose.shared.training.batches import make_dataset, make_psi_from, psi_on

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--site", default="site-0", help="the split the site trains on")
    ap.add_argument("--public-batch-size", type=int, default=None,
                    help="records the public term draws a step (default: the config's, which the kit's policy pins)")
    ap.add_argument("--png", default="docs/img/feature-dp-reconstruction.png")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    started = time.time()
    loaded = load_config(args.config)
    pinned = args.public_batch_size or loaded.train.public_batch_size
    cfg = attack_config(loaded)  # a public batch of one record
    data = ensure_data(cfg, progress=False) / args.site
    crafted, grads, _ = _reply(cfg, data)
    readout = read_reply(crafted, grads, cfg.model, public_batch_size=cfg.train.public_batch_size)

    # scoring only: the site's records, psi of each canonical crop as the public term sees it
    from fedpose.client.data import load_split_dir

    canonical = make_dataset(load_split_dir(data, "site data"), cfg, train=False)
    batch = canonical.batch(list(range(len(canonical))))
    site = psi_on(make_psi_from(cfg.privacy, torch.Generator().manual_seed(0)), batch, torch.device("cpu")).tensors
    index, _ = find_record(readout, site["joints"], site["visible"])
    measured = score(readout, site["image"][index], site["joints"][index], site["visible"][index])
    rebuilt = render(readout.planes)
    others = [psnr(rebuilt, render(planes_of(site["image"][i]))) for i in range(len(canonical)) if i != index]
    size = tuple(cfg.data.input_size)
    picture(Path(args.png), size, batch["image"][index], site["image"][index], render(planes_of(site["image"][index])),
            rebuilt, site["joints"][index], site["visible"][index], readout)
    result = {
        "config": args.config, "site": args.site, "records": len(canonical), "input_size": list(size),
        "method": cfg.train.method, "public_batch_size": cfg.train.public_batch_size, "psi": cfg.privacy.psi,
        "psi_param": cfg.privacy.psi_param, "luma_block_px": 4, "colour_block_px": 8,
        "record": index, "psnr_db": measured.psnr_db, "label_error_px": measured.label_error_px,
        "visible_joints": measured.visible_joints, "visibility_match": measured.visibility_match,
        "best_other_record_psnr_db": max(others), "picture": args.png,
    }
    if pinned > 1:  # the batch the kit ships
        many = replace(cfg, **{"train.public_batch_size": pinned})
        result["pinned"] = _batch_scores(many, data, *_reply(many, data))
    command = "python benchmarks/feature_dp_reconstruction.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result["provenance"] = provenance(command=command.strip(), seconds=time.time() - started)
    out = Path(args.out) / "feature_dp_reconstruction.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"site {args.site} ({len(canonical)} records, {size[0]}x{size[1]} input, {cfg.privacy.psi} "
          f"{cfg.privacy.psi_param}), {cfg.train.method}, public batch {cfg.train.public_batch_size}, one reply:")
    print(f"  record {index}: psi(x) rebuilt at {measured.psnr_db:.1f} dB PSNR (4-px luminance, 8-px colour blocks; "
          f"best other record {max(others):.1f} dB)")
    print(f"  labels: {measured.visible_joints} visible joints within {measured.label_error_px:.2g} px, visibility "
          f"{'exact' if measured.visibility_match else 'WRONG'}")
    if "pinned" in result:
        b = result["pinned"]
        print(f"  with the public batch the kit pins ({pinned}): the labels of the {b['distinct_drawn']} records drawn "
              f"as each joint's visible fraction (error {b['visible_fraction_error']:.2g}) and its distribution of "
              f"positions over them (largest error {b['position_distribution_error']:.2g}); the picture is a blend, "
              f"{b['psnr_vs_mean_of_drawn_db']:.1f} dB against their mean, closest single record "
              f"{b['best_single_record_psnr_db']:.1f} dB")
    print(f"  picture: {args.png}; numbers: {out}")
    return result


def _reply(cfg, data: Path):
    """One crafted fpdp request to a fresh site over ``data`` at ``cfg``'s public batch: (crafted, g_pub read from
    the reply, the records its public term drew: scoring only)."""
    import fedpose.shared.training.loop as loop
    from fedpose.client.data import prepare_site
    from fedpose.client.policy import min_sigma_for
    from fedpose.client.site import handle_train
    from fedpose.shared.experiments.reconstruction import attack_content, craft_weights, outside_basis
    from fedpose.shared.experiments.reconstruction_read import public_gradient_of
    from fedpose.shared.flower.messages import ARRAYS, record_tensors
    from fedpose.shared.model.posenet import build_model
    from fedpose.shared.model.strategy import apply_train_strategy

    drawn: list[int] = []
    real = loop.psi_on

    def watched(psi, batch, device):  # under fpdp only the public draw maps a batch by psi
        drawn.extend(int(i) for i in batch["index"])
        return real(psi, batch, device)

    loop.psi_on = watched
    try:
        with tempfile.TemporaryDirectory() as tmp:
            policy = site_policy(cfg, data, Path(tmp) / "ledger.sqlite")
            prepare_site(policy)
            model = build_model(cfg.model, cfg.data.input_size)
            crafted = craft_weights(model)
            trained = apply_train_strategy(model, cfg.train)
            basis = outside_basis(model, trained, crafted, cfg.privacy.k)
            content = attack_content(cfg, crafted, basis, federation="reconstruction", round=1, site=policy.site,
                                     sigma=min_sigma_for(policy), sample_rate=policy.sample_rate)
            reply = handle_train(content, policy)
    finally:
        loop.psi_on = real
    return crafted, public_gradient_of(crafted.state, record_tensors(reply[ARRAYS]), crafted.read,
                                       lr=cfg.train.lr), drawn


def _site_psi(cfg, data: Path):
    """Scoring only: the site's records as the public term sees them (psi of each canonical crop), and raw."""
    from fedpose.client.data import load_split_dir
    from fedpose.shared.training.batches import make_dataset, make_psi_from, psi_on

    canonical = make_dataset(load_split_dir(data, "site data"), cfg, train=False)
    batch = canonical.batch(list(range(len(canonical))))
    return batch, psi_on(make_psi_from(cfg.privacy, torch.Generator().manual_seed(0)), batch,
                         torch.device("cpu")).tensors


def _batch_scores(cfg, data: Path, crafted, grads, drawn: list[int]) -> dict:
    """A public batch of several records: what the mean of their gradients gives, scored against them."""
    from fedpose.shared.experiments.reconstruction_read import planes_of, psnr, read_batch, render
    from fedpose.shared.model.simcc import gaussian_targets

    readout = read_batch(crafted, grads, cfg.model)
    batch, site = _site_psi(cfg, data)
    idx = torch.tensor(drawn, dtype=torch.long)
    vis = site["visible"][idx].double()  # (B, K)
    errors = [float(np.abs(readout.visible - vis.mean(0).numpy()).max())]
    seen = vis.sum(0)
    for axis, bins in ((0, readout.targets[0].shape[1]), (1, readout.targets[1].shape[1])):
        t = gaussian_targets(site["joints"][idx][..., axis].double(), bins, split_ratio=cfg.model.split_ratio,
                             sigma=cfg.model.sigma[axis])  # (B, K, bins)
        truth = ((vis[..., None] * t).sum(0) / seen[:, None].clamp(min=1)).numpy()
        rows = seen.numpy() > 0
        errors.append(float(np.abs(readout.targets[axis][rows] - truth[rows]).max()))
    rebuilt = render(readout.planes)
    mean_truth = np.mean([render(planes_of(site["image"][i])) for i in drawn], axis=0)
    singles = [psnr(rebuilt, render(planes_of(site["image"][i]))) for i in range(len(batch["image"]))]
    return {"public_batch_size": cfg.train.public_batch_size, "distinct_drawn": len(set(drawn)),
            "visible_fraction_error": errors[0], "position_distribution_error": max(errors[1:]),
            "psnr_vs_mean_of_drawn_db": psnr(rebuilt, mean_truth), "best_single_record_psnr_db": max(singles)}


if __name__ == "__main__":
    main()
