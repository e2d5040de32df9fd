"""A hostile ServerApp that attacks a real site ClientApp in Flower's simulation (docs/explanation/design.md:
threat model).

Not a test module: ``tests/test_hostile_server.py`` runs it as a script,

    python tests/support/hostile_server.py CONFIG OUT RESULTS_JSON

which prepares the site (data, pretrained weights, its policy, pinned to fpdp only),
starts Flower's simulation with ONE real ``ClientApp`` (the site of ``data.train_splits[0]``)
and this ``ServerApp``, and writes one JSON record per message sent: the reply's error code
and reason (or its record keys and metrics), and the site ledger's rows before and after.
The attacks are the threat model's: a membership probe, a weaker psi, another psi kind,
another augmentation, less noise, a larger q, more local steps, more rounds, method
switches, another clip, malformed / non-orthonormal / NaN bases, NaN and oversized weights,
an unknown request field, another site's name, a replayed round, an oversized input, a request for
every per-sample gradient at once, finite weights that overflow the private gradients, a failed round
asked again with other settings, the Feature-DP read-out (crafted weights, a public batch of one record;
then again once the site's operator has withdrawn its Feature-DP opt-in), and the count-by-draws read-out: with
the site's operator pinning a public batch of one record, the server reads the labels of the record each fpdp
reply drew and counts the distinct records it has seen over several rounds, first with the draws reaching every
record, then with the policy pinning a fixed public set (``public_records``).
"""

from __future__ import annotations

import json
import sqlite3
import sys
import uuid
from pathlib import Path
from typing import Any

COUNT_ROUNDS = 6  # rounds of the count-by-draws read-out in each phase
POOL = 2  # public_records of its second phase
REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _ledger_rows(path: Path) -> list[dict[str, Any]]:
    """The site ledger's rows, read directly from the SQLite file (test only: a real server cannot)."""
    if not path.exists():
        return []
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        return [dict(r) for r in conn.execute("SELECT * FROM spend ORDER BY id")] if "spend" in tables else []
    finally:
        conn.close()


def hostile_app(cfg: Any, ledger: Path, private_hash: str, results: Path, policy_path: Path) -> Any:
    import numpy as np
    import torch
    from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
    from flwr.serverapp import Grid, ServerApp

    from fedpose.shared.configuration.schema import replace
    from fedpose.shared.flower.messages import (
        ARRAYS,
        BASIS,
        CONFIG,
        METRICS,
        SiteInfo,
        TrainRequest,
        basis_record,
        weights_record,
    )
    from fedpose.shared.model.strategy import apply_strategy
    from fedpose.shared.training.runs import initial_model

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        from fedpose.server.exchange import wait_for_nodes

        node = wait_for_nodes(grid, 1, 180)[0]
        log: list[dict[str, Any]] = []
        model = initial_model(cfg, progress=False)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        trainable = apply_strategy(model, cfg.train.strategy)
        named = dict(model.named_parameters())
        p = sum(named[n].numel() for n in trainable)

        def send(name: str, content: RecordDict, kind: str = MessageType.TRAIN,
                 read: Any = None) -> dict[str, Any]:
            """``read``: what the server reads from a reply's content (stored as the entry's ``read``)."""
            before = _ledger_rows(ledger)
            (reply,) = grid.send_and_receive([Message(content, dst_node_id=node, message_type=kind)], timeout=240)
            entry: dict[str, Any] = {"name": name, "rows_before": before, "rows_after": _ledger_rows(ledger)}
            if reply.has_error():
                entry.update(code=int(reply.error.code), reason=str(reply.error.reason))
            else:
                import hashlib

                digest = hashlib.sha256()
                finite = True
                if ARRAYS in reply.content.array_records:
                    for key, array in sorted(reply.content[ARRAYS].items()):
                        digest.update(key.encode() + np.ascontiguousarray(array.numpy()).tobytes())
                        finite = finite and bool(np.isfinite(array.numpy()).all())
                entry.update(code=None, keys=sorted(reply.content.keys()), weights_digest=digest.hexdigest(),
                             finite=finite,
                             metrics=dict(reply.content[METRICS]) if METRICS in reply.content.metric_records else {},
                             info=dict(reply.content["info"]) if "info" in reply.content.config_records else {})
                if read is not None:
                    entry["read"] = read(reply.content)
            log.append(entry)
            results.write_text(json.dumps(log, indent=1, default=str))
            return entry

        def query(fields: dict[str, Any]) -> dict[str, Any]:
            return RecordDict({CONFIG: ConfigRecord(fields)})

        info = SiteInfo.from_record(ConfigRecord(send("query", query({}), MessageType.QUERY)["info"]))
        federation = uuid.uuid4().hex[:12]

        def train(*, round: int, config: Any = cfg, sigma: float | None = None, q: float | None = None,
                  steps: int | None = None, weights: dict[str, torch.Tensor] | None = None,
                  basis_mode: str = "site", basis: Any = None, site: str | None = None,
                  extra: dict[str, Any] | None = None, fed: str | None = None) -> RecordDict:
            request = TrainRequest(
                federation=fed or federation, round=round, site=site or info.site,
                sigma=info.min_sigma if sigma is None else sigma, sample_rate=info.sample_rate if q is None else q,
                steps=info.steps_per_round if steps is None else steps, basis_version=1 if basis_mode else 0,
                basis_mode=basis_mode, config=config)
            record = request.to_record()
            for key, value in (extra or {}).items():
                record[key] = value
            content = RecordDict({ARRAYS: weights_record(state if weights is None else weights), CONFIG: record})
            if basis is not None:
                content[BASIS] = basis
            return content

        # The membership probe: the hash of a private image vs a random one (finding 8.1).
        send("probe-private-hash", query({"public-hashes": [private_hash]}), MessageType.QUERY)
        send("probe-random-hash", query({"public-hashes": [uuid.uuid4().hex * 2]}), MessageType.QUERY)

        send("honest-1", train(round=1))
        with_cfg = lambda **kv: replace(cfg, **kv)  # noqa: E731
        send("psi-weaker", train(round=2, config=with_cfg(**{"privacy.psi_param": 1e-4})))
        send("psi-kind", train(round=2, config=with_cfg(**{"privacy.psi": "pixelate", "privacy.psi_param": 1.0})))
        send("augment-switch", train(round=2, config=with_cfg(**{"data.augment": not cfg.data.augment})))
        send("lower-sigma", train(round=2, sigma=0.5 * info.min_sigma))
        send("larger-q", train(round=2, q=min(1.0, 2 * info.sample_rate)))
        send("more-steps", train(round=2, steps=info.steps_per_round + 1))
        send("method-nonprivate", train(round=2, config=with_cfg(**{"train.method": "nonprivate"})))
        send("method-dpsgd", train(round=2, config=with_cfg(**{"train.method": "dpsgd"}), basis_mode="site"))
        send("method-fdp", train(round=2, config=with_cfg(**{"train.method": "fdp"})))
        send("clip-double", train(round=2, config=with_cfg(**{"privacy.clip_norm": 2 * cfg.privacy.clip_norm})))
        k = cfg.privacy.k
        q_basis, _ = torch.linalg.qr(torch.randn(p, k, dtype=torch.float64))
        send("basis-shape", train(round=2, basis_mode="broadcast",
                                  basis=basis_record(q_basis[:-1].float(), version=1, dtype="float32")))
        send("basis-not-orthonormal", train(round=2, basis_mode="broadcast",
                                            basis=basis_record((2 * q_basis).float(), version=1, dtype="float32")))
        nan_basis = q_basis.float().clone()
        nan_basis[0, 0] = float("nan")
        send("basis-nan", train(round=2, basis_mode="broadcast", basis=basis_record(nan_basis, version=1,
                                                                                     dtype="float32")))
        nan_state = {k: v.clone() for k, v in state.items()}
        first = next(name for name, v in nan_state.items() if v.is_floating_point())
        nan_state[first].view(-1)[0] = float("nan")
        send("weights-nan", train(round=2, weights=nan_state))
        big = {k: v.clone() for k, v in state.items()}
        big[first] = torch.zeros(4096, 4096)
        send("weights-oversized", train(round=2, weights=big))
        send("weights-extra-tensor", train(round=2, weights={**state, "extra.weight": torch.zeros(1000, 1000)}))
        per_tensor = train(round=2)  # one array per tensor: not the weights format, refused before anything runs
        per_tensor[ARRAYS] = ArrayRecord({k: Array(v.numpy()) for k, v in state.items()})
        send("weights-per-tensor", per_tensor)
        send("unknown-field", train(round=2, extra={"seed": 7}))
        send("other-site", train(round=2, site="hospital-z"))
        send("input-oversized", train(round=2, config=with_cfg(**{"data.input_size": [512, 512]})))
        # Face tasks the site's policy does not list: their labels would be used (public under fpdp) unasked.
        send("face-tasks", train(round=2, config=with_cfg(**{"model.face_tasks": ["attribute"]})))
        send("replay-1", train(round=1))
        # The server asks for every per-sample gradient at once; the site keeps its own chunk size (P13).
        send("honest-2", train(round=2, config=with_cfg(**{"privacy.chunk_size": 100000})))
        # Finite weights that overflow the private per-sample gradients (the first convolution scaled by
        # 1e22): before P14 the reply was NaN whenever an affected record was sampled, a membership oracle.
        # Here it must come back finite and spent like any round. V is broadcast (any orthonormal V is
        # public), so the site's own V, which would see the same overflow on public data, is not needed.
        crafted = {k: v.clone() for k, v in state.items()}
        crafted["patch_embed.conv1.conv.weight"] = crafted["patch_embed.conv1.conv.weight"] * 1e22
        send("nan-trigger", train(round=3, weights=crafted, basis_mode="broadcast",
                                  basis=basis_record(q_basis.float(), version=1, dtype="float32")))
        # The replay of a failed round (P16): a request whose optimizer overflows fails after its charge; the same
        # round asked again with sane settings must get that failure back, never a run on the same noise.
        overflow = with_cfg(**{"train.optimizer": "sgd", "train.lr": 1.0, "train.momentum": 0.0,
                               "train.weight_decay": 1e38})
        send("overflow-fails", train(round=4, config=overflow))
        send("replay-after-failure", train(round=4, config=with_cfg(**{"train.lr": 1e-5})))
        send("round-beyond-policy", train(round=5))
        # The Feature-DP read-out (P17): crafted weights and a V that leaves the read tensors out give the server
        # psi(x) and the exact labels of the record drawn when the public batch is one record. This site opted in
        # to Feature-DP but pins its public batch: a request for one record is refused.
        from fedpose.shared.experiments.reconstruction import attack_config, craft_weights, outside_basis
        from fedpose.shared.model.posenet import build_model

        crafted_model = build_model(cfg.model, cfg.data.input_size)
        read_out = craft_weights(crafted_model)
        read_basis = basis_record(outside_basis(crafted_model, apply_strategy(crafted_model, cfg.train.strategy),
                                                read_out, cfg.privacy.k), version=1, dtype="float32")
        one_record = attack_config(cfg)
        send("read-out-one-record", train(round=5, config=one_record, weights=read_out.state, steps=1,
                                          basis_mode="broadcast", basis=read_basis))
        # The count-by-draws read-out (P17): the site's operator pins a public batch of one record (its choice),
        # and each crafted fpdp reply gives the labels of the record its one step drew. Counting the distinct
        # records read over rounds tells the server how many the site holds, unless its policy pins a fixed set
        # of records the draws come from (public_records): then it sees at most those.
        from fedpose.client.policy import load_policy, policy_from_dict, policy_to_dict, write_policy
        from fedpose.client.data import prepare_site
        from fedpose.shared.experiments.reconstruction_read import public_gradient_of, read_reply
        from fedpose.shared.flower.messages import record_tensors

        def labels_read(content: RecordDict) -> list[float]:
            grads = public_gradient_of(read_out.state, record_tensors(content[ARRAYS]), read_out.read,
                                       lr=one_record.train.lr)
            readout = read_reply(read_out, grads, cfg.model, public_batch_size=1)
            joints = np.where(readout.visible[:, None] > 0.5, readout.joints, -1.0)
            return [round(float(v), 3) for v in np.concatenate([joints.ravel(), readout.visible.ravel()])]

        done = len(_ledger_rows(ledger))
        for phase, pool in (("count-all", None), ("count-pool", POOL)):
            old = load_policy(policy_path)  # a budget of its own for the read-out's rounds: the operator's choice
            repinned = policy_from_dict({**policy_to_dict(old), "public_batch_size": 1, "public_records": pool,
                                         "lifetime_rounds": done + COUNT_ROUNDS, "epsilon": old.epsilon + 100.0,
                                         "rounds_per_federation": COUNT_ROUNDS})
            write_policy(policy_path, repinned)
            prepare_site(repinned)  # the site's operator checks the changed policy
            now = SiteInfo.from_record(ConfigRecord(send(f"{phase}-query", query({}), MessageType.QUERY)["info"]))
            fed = uuid.uuid4().hex[:12]
            for rnd in range(1, COUNT_ROUNDS + 1):
                send(f"{phase}-{rnd}", train(round=rnd, config=one_record, weights=read_out.state, steps=1,
                                             sigma=2 * now.min_sigma, basis_mode="broadcast", basis=read_basis,
                                             fed=fed), read=labels_read)
            done += COUNT_ROUNDS
        # The site's operator withdraws the opt-in: its policy pins the record-level methods again.

        withdrawn = policy_from_dict({**policy_to_dict(load_policy(policy_path)), "methods": ["dpsgd", "proj"],
                                      "release_blurred_images_and_labels": False})
        write_policy(policy_path, withdrawn)
        prepare_site(withdrawn)
        pinned_batch = replace(one_record, **{"train.public_batch_size": cfg.train.public_batch_size})
        send("read-out-record-level", train(round=5, config=pinned_batch, weights=read_out.state, steps=1,
                                            basis_mode="broadcast", basis=read_basis))

    return app


def main(argv: list[str]) -> int:
    config_path, out, results = Path(argv[0]), Path(argv[1]), Path(argv[2])
    from fedpose.cli.local_federation import prepare_simulation, simulation_apps
    from fedpose.shared.flower.simulation import flower_env
    from fedpose.client.policy import load_policy, policy_to_dict, write_policy
    from fedpose.shared.configuration.schema import load_config
    from fedpose.shared.data.mpii import load_split
    from fedpose.shared.data.records import content_hash

    cfg = load_config(config_path)
    out.mkdir(parents=True, exist_ok=True)
    flower_env(out / "flwr-home")
    prepare_simulation(cfg, out, progress=False)
    site = cfg.data.train_splits[0]
    policy_path = out / "sites" / site / "policy.yaml"
    from fedpose.client.policy import policy_from_dict

    pinned = policy_from_dict({**policy_to_dict(load_policy(policy_path)), "methods": ["fpdp"],
                               "lifetime_rounds": 4, "rounds_per_federation": 4})
    write_policy(policy_path, pinned)
    from fedpose.client.data import prepare_site

    prepare_site(pinned)  # the site's operator checks the changed policy
    private_hash = content_hash(load_split(Path(cfg.data.root), site)[0].image)

    from flwr.simulation import run_simulation

    run_config = {"config": str(config_path), "overrides": "", "out": str(out), "resume": False}
    _, client = simulation_apps(run_config)
    server = hostile_app(cfg, Path(pinned.ledger_path), private_hash, results, policy_path)
    run_simulation(server_app=server, client_app=client, num_supernodes=1,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": 1}})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
