"""Price catalog: the reduced table against a naive re-reading of the raw CSV rows, and malformed-input errors."""

from __future__ import annotations

import csv
import logging
import math
from collections import defaultdict
from pathlib import Path

import pytest

from coral_dagster import paths
from coral_dagster.catalog.gpus import gpu_catalog
from coral_dagster.catalog.prices import build_node_prices, load_node_prices
from coral_dagster.errors import CatalogError

AWS = paths.PRICES_DIR / "aws_gpu_vms.csv"
GCP = paths.PRICES_DIR / "gcp_gpu_vms.csv"

# GCP's host VM for each accelerator configuration, written out by hand from cloud.google.com/compute/docs/gpus;
# n1-standard hosts between 4 vCPUs per GPU and GCP's per-count maximum (T4: 48/48/96, V100: 12/24/48/96).
GCP_HOSTS = {
    **{("A100", n): [f"a2-highgpu-{n}g"] for n in (1, 2, 4, 8)},
    **{("A100-80GB", n): [f"a2-ultragpu-{n}g"] for n in (1, 2, 4, 8)},
    **{("H100", n): [f"a3-highgpu-{n}g"] for n in (1, 2, 4, 8)},
    ("L4", 1): ["g2-standard-4", "g2-standard-8", "g2-standard-12", "g2-standard-16", "g2-standard-32"],
    ("L4", 2): ["g2-standard-24"],
    ("L4", 4): ["g2-standard-48"],
    ("L4", 8): ["g2-standard-96"],
    ("T4", 1): ["n1-standard-4", "n1-standard-8", "n1-standard-16", "n1-standard-32"],
    ("T4", 2): ["n1-standard-8", "n1-standard-16", "n1-standard-32"],
    ("T4", 4): ["n1-standard-16", "n1-standard-32"],
    ("V100", 1): ["n1-standard-4", "n1-standard-8"],
    ("V100", 2): ["n1-standard-8", "n1-standard-16"],
    ("V100", 4): ["n1-standard-16", "n1-standard-32"],
    ("V100", 8): ["n1-standard-32"],
}


@pytest.fixture(scope="module")
def build():
    return build_node_prices()


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _num(text: str) -> float:
    return float(text) if text.strip() else math.nan


def _spot_or_nan(price: float, spot: float) -> float:
    return spot if 0 < spot < price else math.nan


def _naive_aws() -> dict[tuple[str, str], tuple[str, float, float, int]]:
    """(region, node) -> (instance type, on-demand, spot, zones), by plain filtering of the AWS rows."""
    by_type = defaultdict(list)
    for r in _rows(AWS):
        local_zone = r["AvailabilityZone"].count("-") > 1
        count = _num(r["AcceleratorCount"])
        price = _num(r["Price"])
        if r["AcceleratorName"] in gpu_catalog() and count in (1, 2, 4, 8) and not local_zone and price > 0:
            key = (f"aws:{r['Region']}", f"{r['AcceleratorName']}:{int(count)}", r["InstanceType"])
            by_type[key].append((price, _spot_or_nan(price, _num(r["SpotPrice"])), r["AvailabilityZone"]))
    best = {}
    for (region, node, itype), zs in sorted(by_type.items()):
        price = min(z[0] for z in zs)
        spots = [z[1] for z in zs if not math.isnan(z[1])]
        cand = (itype, price, min(spots) if spots else math.nan, len({z[2] for z in zs}))
        if (region, node) not in best or price < best[(region, node)][1]:
            best[(region, node)] = cand
    return best


def _naive_gcp() -> dict[tuple[str, str], tuple[str, float, float, int]]:
    """(region, node) -> (host, on-demand, spot, zones): host row + accelerator row in the same zone."""
    rows = _rows(GCP)
    hosts = {(r["InstanceType"], r["AvailabilityZone"]): r for r in rows if r["InstanceType"]}
    best = {}
    for a in rows:
        if a["InstanceType"] or _num(a["Price"]) == 700.0 or not _num(a["Price"]) > 0:
            continue
        gpu, count = a["AcceleratorName"], _num(a["AcceleratorCount"])
        for host in GCP_HOSTS.get((gpu, count), []):
            h = hosts.get((host, a["AvailabilityZone"]))
            if h is None:
                continue
            key = (f"gcp:{a['Region']}", f"{gpu}:{int(count)}", host)
            best.setdefault(key, []).append((
                _num(h["Price"]) + _num(a["Price"]),
                _spot_or_nan(_num(h["Price"]), _num(h["SpotPrice"]))
                + _spot_or_nan(_num(a["Price"]), _num(a["SpotPrice"])),
                a["AvailabilityZone"]))
    out = {}
    for (region, node, host), zs in sorted(best.items()):
        price = min(z[0] for z in zs)
        spots = [z[1] for z in zs if not math.isnan(z[1])]
        cand = (host, price, min(spots) if spots else math.nan, len({z[2] for z in zs}))
        if (region, node) not in out or price < out[(region, node)][1]:
            out[(region, node)] = cand
    return out


def _table(build) -> dict[tuple[str, str], tuple[str, float, float, int]]:
    return {(r.region, r.node): (r.instance_type, r.usd_per_hour, r.spot_usd_per_hour, r.zones)
            for r in build.prices.itertuples()}


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, abs=1e-9)


@pytest.mark.parametrize("cloud, naive", [("aws", _naive_aws), ("gcp", _naive_gcp)])
def test_every_price_matches_a_naive_reading_of_the_rows(build, cloud, naive):
    got = {k: v for k, v in _table(build).items() if k[0].startswith(cloud + ":")}
    want = naive()
    assert set(got) == set(want)
    for key, (itype, price, spot, zones) in want.items():
        g = got[key]
        assert g[0] == itype and g[1] == pytest.approx(price, abs=1e-9) and _same(g[2], spot) and g[3] == zones, key


def test_hand_checked_prices_from_the_published_rows(build):
    t = _table(build)
    # summary.md: a2-highgpu-1g host 0.73948 + A100 x1 2.93391 in us-central1; spot 0.36975 + 1.4341.
    assert t[("gcp:us-central1", "A100:1")][:3] == ("a2-highgpu-1g", pytest.approx(0.73948 + 2.93391),
                                                    pytest.approx(0.36975 + 1.4341))
    # The cheapest of g6e.xlarge .. g6e.16xlarge, all with 1 L40S.
    assert t[("aws:us-east-2", "L40S:1")][:3] == ("g6e.xlarge", 1.861, 0.5261)
    # p5e.48xlarge has no on-demand price, so H200 x8 is p5en.48xlarge.
    assert t[("aws:us-east-2", "H200:8")][:2] == ("p5en.48xlarge", 63.296)
    # Local Zone usw2-lax1 spot 0.0631 is not the region's; the ordinary zones' minimum is 0.2386.
    assert t[("aws:us-west-2", "T4:1")][2] == 0.2386


def test_core_regions_sell_one_four_and_eight_gpu_nodes_only(build):
    nodes = set(_table(build))
    for region in ("aws:us-east-2", "aws:ap-northeast-2"):
        for gpu in ("L40S", "L4", "A10G"):
            assert {(region, f"{gpu}:{n}") for n in (1, 4, 8)} <= nodes
            assert (region, f"{gpu}:2") not in nodes


def test_prices_are_positive_and_spot_below_on_demand(build):
    p = build.prices
    assert len(p) > 0 and (p.usd_per_hour > 0).all() and (p.usd_per_hour < 700).all()
    spot = p.spot_usd_per_hour.dropna()
    assert (spot > 0).all() and (spot < p.usd_per_hour[spot.index]).all()
    assert not p.duplicated(["region", "node"]).any()
    assert not p[p.region.str.startswith("gcp:")].gpu.eq("L40S").any()
    assert set(p.gpu) <= set(gpu_catalog())


def test_rejections_name_the_reason(build):
    rej = build.rejected
    reasons = " | ".join(rej.reason)
    assert "unknown GPU 'V100-32GB'" in reasons and "unknown GPU 'H100-MEGA'" in reasons
    assert rej[rej.instance_type == "p5e.48xlarge"].reason.eq("missing on-demand Price").all()
    assert rej.reason.str.contains("Local Zone usw2-lax1").any()
    assert rej.reason.str.contains("A100 x16").sum() == sum(
        1 for r in _rows(GCP) if r["AcceleratorName"] == "A100" and _num(r["AcceleratorCount"]) == 16)
    # GCP A100-80GB spot is above on-demand in us-central1: the spot goes, the on-demand stays.
    dropped = rej[(rej.dropped == "spot") & (rej.region == "us-central1")]
    assert dropped.instance_type.str.contains("A100-80GB").any()
    row = build.prices.set_index(["region", "node"]).loc[("gcp:us-central1", "A100-80GB:1")]
    assert math.isnan(row.spot_usd_per_hour) and row.usd_per_hour > 0
    assert not build.prices.gpu.isin(["V100-32GB", "H100-MEGA"]).any()


def test_not_offered_sentinel_is_rejected(tmp_path, caplog):
    rows = _rows(GCP)
    hit = [i for i, r in enumerate(rows) if r["AcceleratorName"] == "L4" and _num(r["AcceleratorCount"]) == 1
           and r["Region"] == "us-central1"]
    for i in hit:
        rows[i]["Price"] = "700.0"
    path = tmp_path / "gcp.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with caplog.at_level(logging.INFO, logger="coral_dagster.catalog.prices"):
        b = build_node_prices(gcp_csv=path)
    assert ("gcp:us-central1", "L4:1") not in _table(b)
    rej = b.rejected[b.rejected.reason.str.contains("not offered")]
    assert sorted(rej.row) == [i + 2 for i in hit]
    assert "not offered" in caplog.text


def _write_aws(tmp_path: Path, edit) -> Path:
    """The first rows of the AWS file, edited by `edit(lines)`."""
    lines = AWS.read_text().splitlines()[:6]
    edit(lines)
    path = tmp_path / "aws.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def _set_field(lines: list[str], line_no: int, column: str, value: str) -> None:
    header = next(csv.reader([lines[0]]))
    row = next(csv.reader([lines[line_no - 1]]))
    row[header.index(column)] = value
    lines[line_no - 1] = ",".join(f'"{v}"' if "," in v or "'" in v else v for v in row)


@pytest.mark.parametrize("edit, row, field, words", [
    (lambda ls: ls.__setitem__(0, ls[0].replace("Price,SpotPrice", "Cost,SpotPrice")), 1, "Price",
     ["InstanceType", "AvailabilityZone", "expected columns"]),
    (lambda ls: _set_field(ls, 4, "Price", "n/a"), 4, "Price", ["'n/a' is not a number"]),
    (lambda ls: _set_field(ls, 3, "SpotPrice", "-0.5"), 3, "SpotPrice", ["negative"]),
    (lambda ls: _set_field(ls, 5, "AcceleratorCount", "four"), 5, "AcceleratorCount", ["not a number"]),
    (lambda ls: ls.append(ls[2].replace("4.812", "4.9")), 7, "Price", ["duplicate of row 3"]),
], ids=["renamed-column", "non-numeric", "negative", "bad-count", "duplicate"])
def test_malformed_input_raises_catalog_error(tmp_path, edit, row, field, words):
    path = _write_aws(tmp_path, edit)
    with pytest.raises(CatalogError) as err:
        build_node_prices(aws_csv=path)
    assert err.value.row == row and err.value.field == field
    message = str(err.value)
    assert str(path) in message and f"row {row}" in message and "Fix:" in message
    for w in words:
        assert w in message


def test_identical_duplicate_and_zero_price_are_not_errors(tmp_path):
    def edit(ls):
        ls.append(ls[2])
        _set_field(ls, 4, "Price", "0")
    b = build_node_prices(aws_csv=_write_aws(tmp_path, edit))
    assert b.rejected[b.rejected.row == 4].reason.str.startswith("non-positive").all()
    assert 7 not in set(b.rejected.row)


def test_load_node_prices_returns_a_private_copy(build):
    first = load_node_prices()
    first.loc[:, "usd_per_hour"] = -1.0
    again = load_node_prices()
    assert (again.usd_per_hour > 0).all() and len(again) == len(build.prices)
