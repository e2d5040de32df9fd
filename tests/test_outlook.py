"""``fedpose site check``'s record-level outlook: the run's noise-to-signal figure from the site's own policy and
where it falls on the data-scale curve measured on the reference ward."""

from __future__ import annotations

import math

import pytest


def test_the_figure_is_the_noise_a_run_averages_over_the_mean_clipped_gradient():
    """sigma sqrt(p) / (B sqrt(T)) / 0.465: at 400 records per site pooled (sigma 6.44, B 64, 570 steps) the noise
    a run averages is about 4.1 C, 8.8 times the signal; 16 times the records at the same q and steps divide it
    by 16 (B grows with n, sigma and T stay)."""
    from fedpose.client.outlook import noise_to_signal

    small = noise_to_signal(sigma=6.44, expected_batch=64, steps=570)
    assert small * 0.465 == pytest.approx(4.08, abs=0.01)
    assert noise_to_signal(sigma=6.44, expected_batch=1024, steps=570) == pytest.approx(small / 16)
    with pytest.raises(ValueError, match="sigma"):
        noise_to_signal(sigma=0.0, expected_batch=64, steps=570)


def test_the_curve_is_read_between_measured_points_and_never_beyond_them():
    from fedpose.client.outlook import CurvePoint, records_for, share_kept

    curve = (CurvePoint(1_000, 8.0, 0.2, "a"), CurvePoint(4_000, 2.0, 0.4, "b"), CurvePoint(16_000, 0.5, 0.7, "c"))
    assert share_kept(8.0, curve) == pytest.approx(0.2)
    assert share_kept(4.0, curve) == pytest.approx(0.3)  # halfway in log between 8 and 2
    assert share_kept(100.0, curve) == pytest.approx(0.2) and share_kept(0.01, curve) == pytest.approx(0.7)
    # half the gain: between 2.0 (0.4) and 0.5 (0.7), a third of the way in log: figure 2 / 4^(1/3)
    target = 2.0 / 4 ** (1 / 3)
    assert records_for(0.5, records=1_000, figure=8.0, curve=curve) == math.ceil(1_000 * 8.0 / target)
    assert records_for(0.9, records=1_000, figure=8.0, curve=curve) is None


def test_site_check_prints_the_outlook_with_the_page_it_comes_from(tmp_path, capsys):
    from fedpose.cli.main import main
    from fedpose.client.outlook import PAGE, noise_to_signal
    from fedpose.client.policy import load_policy, min_sigma_for, write_policy
    from support.federation import prepare_world
    from support.site import site_policy

    cfg = prepare_world(tmp_path / "world")
    policy = site_policy(cfg, tmp_path / "site", prepare=False)
    path = write_policy(tmp_path / "site" / "policy.yaml", policy)
    assert main(["site", "check", "--policy", str(path)]) == 0
    out = capsys.readouterr().out
    line = next(row for row in out.splitlines() if row.startswith("record-level outlook"))
    policy = load_policy(path)
    figure = noise_to_signal(sigma=min_sigma_for(policy), expected_batch=policy.expected_batch,
                             steps=policy.lifetime_rounds * policy.steps_per_round)
    assert f"{figure:.2f} times the mean clipped gradient" in line
    assert PAGE in line and f"eps {policy.epsilon:g}" in line
    # the setting the site runs in: federated, each site accounting for its own records against the server
    import re

    from fedpose.client.outlook import federated_share

    units = int(re.search(r"checked: (\d+) records", out).group(1))
    federated = next(row for row in out.splitlines() if row.startswith("federated outlook"))
    assert f"at {units:,} records per site" in federated
    assert f"kept about {federated_share(units):.2f} of the gain" in federated and PAGE in federated


def test_the_federated_curve_is_read_in_records_per_site_between_measured_sizes_and_never_beyond_them():
    from fedpose.client.outlook import FederatedPoint, federated_share

    curve = (FederatedPoint(400, 0.3, 1), FederatedPoint(1_600, 0.2, 1), FederatedPoint(6_400, 0.1, 3))
    assert federated_share(400, curve) == pytest.approx(0.3)
    assert federated_share(800, curve) == pytest.approx(0.25)  # halfway in log between 400 and 1,600
    assert federated_share(100, curve) == pytest.approx(0.3) and federated_share(10**6, curve) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="record per site"):
        federated_share(0, curve)


def test_the_curve_is_what_the_data_scale_studys_records_say():
    """Each point of the outlook's curve is the data-scale study's best record-level row at that size, from its
    committed records: the share of the gain it kept and the noise-to-signal figure of the run that ran (its sigma,
    batch and steps), so the outlook cannot drift from the page it names."""
    import statistics

    from fedpose.client.outlook import CURVE, noise_to_signal

    render = _render()
    records = render.load_artefact("study-scale")
    points, rows = render._scale_points(records), render._scale_rows(records)
    sizes = sorted({n for (_, n) in points})
    best = render._best_record_level(points, rows, sizes)
    assert [p.records for p in CURVE] == [3 * n for n in sizes]
    for point, n in zip(CURVE, sizes):
        start = statistics.mean(points[("start", n)])
        top = statistics.mean(points[("non-private", n)])
        assert point.share == pytest.approx((statistics.mean(points[(best[n], n)]) - start) / (top - start), abs=0.005)
        ran = [r["metrics"] for r in records if render._per_site(r) == n and r["cell"]["method"] == "proj"
               and render._recipe_part(r) == render.RECIPE]
        assert ran, f"no record of the recipe at {n} per site"
        m = ran[0]
        figure = noise_to_signal(sigma=m["sigma"], expected_batch=m["sample_rate"] * 3 * n, steps=m["steps"])
        assert point.noise_to_signal == pytest.approx(figure, rel=0.01)


def test_the_federated_curve_is_what_the_data_scale_studys_federated_row_says():
    """Each point of the federated outlook is the data-scale study's federated row of the site kits' recipe at that
    size (three sites, each accounting for its own records against the server): its share of the gain and its
    number of seeds, from the committed records."""
    from fedpose.client.outlook import FEDERATED_CURVE

    render = _render()
    records = render.load_artefact("study-scale")
    points = render._scale_points(records)
    shares = render._row_shares(points, render.KITS_FEDERATED_ROW)
    assert [p.per_site for p in FEDERATED_CURVE] == sorted(shares)
    for point in FEDERATED_CURVE:
        assert point.share == pytest.approx(shares[point.per_site], abs=0.005)
        assert point.seeds == len(points[(render.KITS_FEDERATED_ROW, point.per_site)])


def _render():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "render_results.py"
    spec = importlib.util.spec_from_file_location("render_results_outlook", path)
    render = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = render
    spec.loader.exec_module(render)
    return render
