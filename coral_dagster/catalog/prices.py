"""Node prices per (region, node configuration), reduced from the bundled SkyPilot catalog rows of AWS and GCP."""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from coral_dagster import paths
from coral_dagster.catalog.gpus import gpu_catalog
from coral_dagster.catalog.nodes import GPUS_PER_NODE
from coral_dagster.errors import CatalogError

log = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("InstanceType", "AcceleratorName", "AcceleratorCount", "Price", "SpotPrice", "Region",
                    "AvailabilityZone")
PRICE_COLUMNS = ("region", "node", "gpu", "gpus", "instance_type", "usd_per_hour", "spot_usd_per_hour", "zones")
REJECTED_COLUMNS = ("file", "row", "instance_type", "region", "reason", "dropped")

# GCP's price for an accelerator it does not sell in that place.
GCP_NOT_OFFERED_USD = 700.0
# An AWS zone ID is `<region code>-az<n>` (use2-az1); Local Zones add a metro segment (usw2-lax1-az1).
_AWS_REGION_AZ = re.compile(r"^[a-z]+\d+-az\d+$")
_GCP_FIXED_HOSTS = (
    (re.compile(r"^a2-highgpu-(\d+)g$"), "A100"),
    (re.compile(r"^a2-ultragpu-(\d+)g$"), "A100-80GB"),
    (re.compile(r"^a3-highgpu-(\d+)g$"), "H100"),
)
_G2_STANDARD = re.compile(r"^g2-standard-(\d+)$")
_G2_L4_BY_VCPUS = {4: 1, 8: 1, 12: 1, 16: 1, 32: 1, 24: 2, 48: 4, 96: 8}
_N1_STANDARD = re.compile(r"^n1-standard-(\d+)$")
# GCP's most vCPUs an n1 host may have per number of attached GPUs (cloud.google.com/compute/docs/gpus).
_N1_MAX_VCPUS = {"T4": {1: 48, 2: 48, 4: 96}, "V100": {1: 12, 2: 24, 4: 48, 8: 96}}
# Coral's floor, so every GPU has a core for its engine worker and one for tokenising and scheduling, as on
# AWS g4dn.xlarge; the cheapest n1-standard host meeting both limits is the one priced.
_N1_MIN_VCPUS_PER_GPU = 4


@dataclass(frozen=True, eq=False)
class PriceBuild:
    """The reduced price table and every source row (or spot value) left out, with the reason.

    `prices` has the columns of `PRICE_COLUMNS`, one row per (region, node configuration). `rejected` has
    `REJECTED_COLUMNS`: the source file name, its line (`row`, header = 1), the instance type (for a GCP
    accelerator row `accelerator <GPU> x<count>`), the cloud's region name, the reason, and `dropped`: "row"
    when the whole row was left out, "spot" when only its spot price was (the on-demand price is kept).
    """

    prices: pd.DataFrame
    rejected: pd.DataFrame


class _Rejects:
    """Collects left-out rows and logs each one at INFO (shown by `coral -v`); counts those worth a WARNING."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.notable = 0

    def add(self, path: Path, row: int, instance_type: str, region: str, reason: str, *,
            dropped: str = "row", level: int = logging.INFO) -> None:
        self.rows.append({"file": path.name, "row": row, "instance_type": instance_type, "region": region,
                          "reason": reason, "dropped": dropped})
        self.notable += level >= logging.WARNING
        log.info("%s row %d (%s %s): %s", path.name, row, instance_type or "-", region, reason)

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=list(REJECTED_COLUMNS))


def _read_rows(path: Path) -> pd.DataFrame:
    """Read a catalog CSV as text, check its structure and parse the numbers; `row` is the file's line."""
    if not path.is_file():
        raise CatalogError(path, "-", "-", "file not found", "restore it from the repository or pass another path")
    try:
        df = pd.read_csv(path, dtype=str, keep_default_na=False, skip_blank_lines=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise CatalogError(path, "?", "-", f"not a readable CSV ({exc})",
                           "restore the file from the SkyPilot catalog (see data/prices/SOURCES.md)")
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise CatalogError(path, 1, missing[0], f"column(s) {', '.join(missing)} missing from the header; "
                           f"expected columns {', '.join(REQUIRED_COLUMNS)}",
                           "restore the header line with the SkyPilot catalog's column names")
    df = df[list(REQUIRED_COLUMNS)].apply(lambda s: s.str.strip())
    # The header is line 1 and no field spans lines, so data row i sits on line i + 2.
    df.insert(0, "row", df.index + 2)
    df = df[(df[list(REQUIRED_COLUMNS)] != "").any(axis=1)]
    empty = df[df["Region"] == ""]
    if len(empty):
        raise CatalogError(path, int(empty["row"].iloc[0]), "Region", "empty", "fill in the region of that row")
    for col, fix in (("AcceleratorCount", "write the number of GPUs, e.g. 4, or leave it empty for a CPU row"),
                     ("Price", "write US dollars per hour, e.g. 1.006, or leave it empty when there is none"),
                     ("SpotPrice", "write US dollars per hour, e.g. 0.377, or leave it empty when there is none")):
        df[col] = _parse_numbers(df, col, path, fix)
    return _drop_duplicates(df, path)


def _parse_numbers(df: pd.DataFrame, col: str, path: Path, fix: str) -> pd.Series:
    """Empty text becomes NaN; anything else must be a finite number of at least 0."""
    text = df[col]
    values = pd.to_numeric(text.where(text != ""), errors="coerce")
    bad = (text != "") & ~np.isfinite(values.astype(float))
    if bad.any():
        i = bad.idxmax()
        raise CatalogError(path, int(df.at[i, "row"]), col, f"{text[i]!r} is not a number", fix)
    negative = values < 0
    if negative.any():
        i = negative.idxmax()
        raise CatalogError(path, int(df.at[i, "row"]), col, f"{text[i]} is negative", fix)
    return values.astype(float)


def _drop_duplicates(df: pd.DataFrame, path: Path) -> pd.DataFrame:
    """Identical repeats of an (instance type, accelerator, zone) row go; repeats with other prices are errors."""
    key = ["InstanceType", "AcceleratorName", "AcceleratorCount", "AvailabilityZone"]
    first_of: dict[tuple, pd.Series] = {}
    keep = []
    for i, r in df.iterrows():
        k = tuple("" if isinstance(v, float) and math.isnan(v) else v for v in r[key])
        if k not in first_of:
            first_of[k] = r
            keep.append(i)
            continue
        first = first_of[k]
        for col in ("Price", "SpotPrice"):
            if not _same(first[col], r[col]):
                raise CatalogError(
                    path, int(r["row"]), col,
                    f"duplicate of row {int(first['row'])} for instance type {r['InstanceType'] or '-'}"
                    f"{' / ' + r['AcceleratorName'] if r['AcceleratorName'] else ''} in zone "
                    f"{r['AvailabilityZone'] or '-'} with a different {col} ({first[col]} vs {r[col]})",
                    "keep one row per instance type and zone")
        log.info("%s row %d repeats row %d; ignored", path.name, r["row"], first["row"])
    return df.loc[keep]


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def _gpu_reason(name: str, count: float) -> str | None:
    """Why an accelerator is not a Coral node configuration, or None when it is."""
    if not name:
        return "not a GPU row (no AcceleratorName)"
    if name not in gpu_catalog():
        return f"unknown GPU {name!r} (not in data/catalog/gpus.yaml)"
    if math.isnan(count):
        return f"{name} has no AcceleratorCount"
    if count not in GPUS_PER_NODE:
        return f"{name} x{count:g}: Coral nodes have {', '.join(map(str, GPUS_PER_NODE))} GPUs"
    return None


def _price_reason(price: float) -> str | None:
    if math.isnan(price):
        return "missing on-demand Price"
    if price <= 0:
        return f"non-positive on-demand Price {price}"
    return None


def _checked_spot(price: float, spot: float) -> tuple[float, str | None, int]:
    """The spot price to use (NaN = no spot market), and why the row's spot value was dropped."""
    if math.isnan(spot):
        return spot, None, logging.INFO
    if spot == 0:
        return math.nan, "spot dropped: SpotPrice 0 means no spot market", logging.INFO
    if spot > price:
        return math.nan, f"spot dropped: SpotPrice {spot} above on-demand {price}", logging.WARNING
    if spot == price:
        return math.nan, f"spot dropped: SpotPrice equals on-demand {price} (no spot market)", logging.INFO
    return spot, None, logging.INFO


def _usable_row(r, path: Path, rejects: _Rejects, reason: str | None) -> float | None:
    """Record a rejected row, or return the row's checked spot price (NaN = none)."""
    # A GCP accelerator row has no instance type; name its accelerator instead.
    label = r.InstanceType or (f"accelerator {r.AcceleratorName} x{r.AcceleratorCount:g}" if r.AcceleratorName
                               else "-")
    level = logging.INFO
    if reason is None:
        reason = _price_reason(r.Price)
        level = logging.WARNING
    if reason is not None:
        rejects.add(path, r.row, label, r.Region, reason, level=level)
        return None
    spot, why, level = _checked_spot(r.Price, r.SpotPrice)
    if why:
        rejects.add(path, r.row, label, r.Region, why, dropped="spot", level=level)
    return spot


def _aws_zone_rows(path: Path, rejects: _Rejects) -> pd.DataFrame:
    """One usable row per AWS instance type and ordinary availability zone."""
    out = []
    for r in _read_rows(path).itertuples(index=False):
        reason = _gpu_reason(r.AcceleratorName, r.AcceleratorCount)
        if reason is None and r.AvailabilityZone and not _AWS_REGION_AZ.match(r.AvailabilityZone):
            reason = f"AWS Local Zone {r.AvailabilityZone}: its prices are not those of {r.Region}"
        spot = _usable_row(r, path, rejects, reason)
        if spot is None:
            continue
        out.append({"region": f"aws:{r.Region}", "instance_type": r.InstanceType, "gpu": r.AcceleratorName,
                    "gpus": int(r.AcceleratorCount), "zone": r.AvailabilityZone or r.Region,
                    "usd_per_hour": r.Price, "spot_usd_per_hour": spot})
    return pd.DataFrame(out, columns=["region", "instance_type", "gpu", "gpus", "zone", "usd_per_hour",
                                      "spot_usd_per_hour"])


def _gcp_host_carries(instance_type: str) -> list[tuple[str, int]]:
    """The (GPU, count) configurations GCP lets this host VM carry, as Coral prices them; [] when none."""
    for pattern, gpu in _GCP_FIXED_HOSTS:
        m = pattern.match(instance_type)
        if m:
            return [(gpu, int(m[1]))]
    m = _G2_STANDARD.match(instance_type)
    if m:
        n = _G2_L4_BY_VCPUS.get(int(m[1]))
        return [("L4", n)] if n else []
    m = _N1_STANDARD.match(instance_type)
    if m:
        vcpus = int(m[1])
        return [(gpu, n) for gpu, limits in _N1_MAX_VCPUS.items() for n, most in limits.items()
                if _N1_MIN_VCPUS_PER_GPU * n <= vcpus <= most]
    return []


def _gcp_zone_rows(path: Path, rejects: _Rejects) -> pd.DataFrame:
    """One usable row per GCP (host VM + accelerator) pair in one zone, priced as their sum."""
    hosts: list[dict[str, Any]] = []
    accels: list[dict[str, Any]] = []
    for r in _read_rows(path).itertuples(index=False):
        carries: list[tuple[str, int]] = []
        reason: str | None
        if r.InstanceType and r.AcceleratorName:
            reason = "host row with an accelerator attached: GCP rows list hosts and accelerators apart"
        elif r.AcceleratorName:
            reason = _gpu_reason(r.AcceleratorName, r.AcceleratorCount)
        elif r.InstanceType:
            carries = _gcp_host_carries(r.InstanceType)
            reason = None if carries else ("not a GPU host VM Coral prices (a2-highgpu, a2-ultragpu, a3-highgpu, "
                                           "g2-standard, n1-standard)")
        else:
            reason = "not a GPU row (no InstanceType, no AcceleratorName)"
        if reason is None and r.Price == GCP_NOT_OFFERED_USD:
            reason = f"Price {GCP_NOT_OFFERED_USD:g} means not offered"
        spot = _usable_row(r, path, rejects, reason)
        if spot is None:
            continue
        base = {"region": f"gcp:{r.Region}", "zone": r.AvailabilityZone, "row": r.row,
                "usd_per_hour": r.Price, "spot_usd_per_hour": spot}
        if r.AcceleratorName:
            accels.append({**base, "gpu": r.AcceleratorName, "gpus": int(r.AcceleratorCount)})
        else:
            hosts.extend({**base, "gpu": g, "gpus": n, "instance_type": r.InstanceType} for g, n in carries)
    acc = pd.DataFrame(accels, columns=["region", "zone", "row", "usd_per_hour", "spot_usd_per_hour", "gpu", "gpus"])
    host = pd.DataFrame(hosts, columns=[*acc.columns, "instance_type"])
    pairs = acc.merge(host, on=["region", "gpu", "gpus"], suffixes=("_acc", "_host"))
    # An empty zone means the row holds for the whole region.
    pairs = pairs[(pairs.zone_acc == pairs.zone_host) | (pairs.zone_acc == "") | (pairs.zone_host == "")]
    for a in acc[~acc.row.isin(pairs.row_acc)].itertuples(index=False):
        rejects.add(path, a.row, f"accelerator {a.gpu} x{a.gpus}", a.region.removeprefix("gcp:"),
                    f"no host VM row for {a.gpu}:{a.gpus} in zone {a.zone or a.region}")
    zone = pairs.zone_acc.where(pairs.zone_acc != "", pairs.zone_host)
    return pd.DataFrame({
        "region": pairs.region, "instance_type": pairs.instance_type, "gpu": pairs.gpu, "gpus": pairs.gpus,
        "zone": zone.where(zone != "", pairs.region),
        "usd_per_hour": pairs.usd_per_hour_acc + pairs.usd_per_hour_host,
        # NaN when either part has no spot price: a spot VM needs both at spot rates.
        "spot_usd_per_hour": pairs.spot_usd_per_hour_acc + pairs.spot_usd_per_hour_host,
    })


def _cheapest_per_node(zone_rows: pd.DataFrame) -> pd.DataFrame:
    """Per instance type: zone-minimum prices and zone count; per (region, node): the cheapest instance type."""
    if zone_rows.empty:
        return pd.DataFrame(columns=list(PRICE_COLUMNS))
    per_type = (zone_rows.groupby(["region", "gpu", "gpus", "instance_type"], as_index=False)
                .agg(usd_per_hour=("usd_per_hour", "min"), spot_usd_per_hour=("spot_usd_per_hour", "min"),
                     zones=("zone", "nunique")))
    best = (per_type.sort_values(["region", "gpu", "gpus", "usd_per_hour", "instance_type"], kind="stable")
            .drop_duplicates(["region", "gpu", "gpus"]))
    best["node"] = best.gpu + ":" + best.gpus.astype(str)
    return best[list(PRICE_COLUMNS)]


def build_node_prices(aws_csv: Path | None = None, gcp_csv: Path | None = None) -> PriceBuild:
    """Reduce the AWS and GCP catalog rows to one price per (region, node configuration).

    A row of `prices` is the cheapest on-demand instance type carrying exactly that node configuration: its
    on-demand price is the minimum over the region's zones, its spot price the minimum spot over the same
    zones (NaN when none has a spot market). GCP instances are priced as host VM + accelerator in one zone.
    Malformed files raise `CatalogError`; rows that are well-formed but unusable land in `rejected`.
    """
    aws_path = Path(aws_csv or paths.PRICES_DIR / "aws_gpu_vms.csv")
    gcp_path = Path(gcp_csv or paths.PRICES_DIR / "gcp_gpu_vms.csv")
    rejects = _Rejects()
    zone_rows = pd.concat([_aws_zone_rows(aws_path, rejects), _gcp_zone_rows(gcp_path, rejects)],
                          ignore_index=True)
    prices = _cheapest_per_node(zone_rows).sort_values(["region", "gpu", "gpus"]).reset_index(drop=True)
    prices = prices.astype({"gpus": int, "zones": int, "usd_per_hour": float, "spot_usd_per_hour": float})
    rejected = rejects.frame()
    log.log(logging.WARNING if len(rejected) else logging.INFO,
            "prices: %d (region, node) rows from %s and %s; %d rows or spot values left out (%d with a missing or "
            "inconsistent price); `coral -v` lists each", len(prices), aws_path.name, gcp_path.name, len(rejected),
            rejects.notable)
    return PriceBuild(prices=prices, rejected=rejected)


@lru_cache(maxsize=1)
def _bundled() -> PriceBuild:
    return build_node_prices()


def load_node_prices() -> pd.DataFrame:
    """The price table in use, built once per process; callers get their own copy. It is the user's price file
    when `$CORAL_PRICES` names one (`paths.prices_file`), else the bundled snapshot; a command's `--prices` file
    reaches its code as an argument instead (`read_price_file`)."""
    user = paths.prices_file()
    return _bundled().prices.copy() if user is None else read_price_file(user)


def read_price_file(path: Path) -> pd.DataFrame:
    """A price file in the user format (USER_PRICE_COLUMNS; e.g. data/prices/paper_normalised.csv), checked and
    cached per file version; callers get their own copy."""
    if not path.is_file():
        raise CatalogError(path, "-", "-", "price file not found (named by --prices or $CORAL_PRICES)",
                           "give the path of a CSV with columns " + ", ".join(USER_PRICE_COLUMNS))
    stat = path.stat()
    return _user_prices(path.resolve(), stat.st_mtime_ns, stat.st_size).copy()


#: The paper's normalised per-GPU prices as a price file (data/prices/SOURCES.md).
PAPER_PRICES = paths.DATA_DIR / "prices" / "paper_normalised.csv"

USER_PRICE_COLUMNS = ("region", "node", "instance_type", "usd_per_hour")
_USER_OPTIONAL = ("spot_usd_per_hour", "zones")


@lru_cache(maxsize=4)
def _user_prices(path: Path, _mtime_ns: int, _size: int) -> pd.DataFrame:
    """A user price table: one row per (region, node configuration) with its instance type, on-demand and
    optional spot $/node-hour (the columns `coral catalog prices --json` prints); every cell is checked."""
    from coral_dagster.catalog.market import REGION_RE
    from coral_dagster.catalog.nodes import NodeConfig
    from coral_dagster.errors import CoralError

    try:
        df = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise CatalogError(path, "?", "-", f"not a readable CSV ({exc})",
                           "write a CSV with the header " + ",".join(USER_PRICE_COLUMNS)) from None
    missing = [c for c in USER_PRICE_COLUMNS if c not in df.columns]
    if missing:
        raise CatalogError(path, 1, missing[0], f"column(s) {', '.join(missing)} missing from the header",
                           "write the header " + ",".join(USER_PRICE_COLUMNS) + "[,spot_usd_per_hour]")
    rows: list[dict[str, Any]] = []
    seen: dict[tuple[str, str], int] = {}
    for i, r in enumerate(df.to_dict("records")):
        line = i + 2
        r = {k: str(v).strip() for k, v in r.items()}
        if not REGION_RE.match(r["region"]):
            raise CatalogError(path, line, "region", f"{r['region']!r} is not cloud:region on aws or gcp",
                               "write regions like aws:us-east-2 or gcp:us-central1")
        try:
            node = NodeConfig.parse(r["node"])
        except CoralError as exc:
            raise CatalogError(path, line, "node", exc.problem.rstrip("."), exc.fix) from None
        reason = _gpu_reason(node.gpu, float(node.count))
        if reason:
            raise CatalogError(path, line, "node", reason, "use a GPU of data/catalog/gpus.yaml with 1, 2, 4 or 8")
        if not r["instance_type"]:
            raise CatalogError(path, line, "instance_type", "empty", "name the cloud's instance type, e.g. g6.xlarge")
        price = _user_number(r["usd_per_hour"], path, line, "usd_per_hour", required=True)
        spot = _user_number(r.get("spot_usd_per_hour", ""), path, line, "spot_usd_per_hour", required=False)
        if spot > price:
            raise CatalogError(path, line, "spot_usd_per_hour", f"{spot:g} is above the on-demand {price:g}",
                               "give a spot price at most the on-demand one, or leave it empty")
        zones = r.get("zones") or "1"
        if not zones.isdigit() or int(zones) < 1:
            raise CatalogError(path, line, "zones", f"{zones!r} is not a positive integer", "give a count such as 1")
        key = (r["region"], str(node))
        if key in seen:
            raise CatalogError(path, line, "node", f"{key[1]} in {key[0]} repeats line {seen[key]}",
                               "keep one row per region and node configuration")
        seen[key] = line
        rows.append({"region": r["region"], "node": str(node), "gpu": node.gpu, "gpus": node.count,
                     "instance_type": r["instance_type"], "usd_per_hour": price, "spot_usd_per_hour": spot,
                     "zones": int(zones)})
    if not rows:
        raise CatalogError(path, 2, "-", "no price rows", "add one row per region and node configuration")
    out = pd.DataFrame(rows, columns=list(PRICE_COLUMNS)).sort_values(["region", "gpu", "gpus"])
    return out.reset_index(drop=True).astype({"gpus": int, "zones": int, "usd_per_hour": float,
                                              "spot_usd_per_hour": float})


def _user_number(text: str, path: Path, line: int, col: str, *, required: bool) -> float:
    """A positive finite $/hour; empty is NaN (no spot market) where the column is optional."""
    if text == "" and not required:
        return math.nan
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise CatalogError(path, line, col, f"{text!r} is not a positive number of US dollars per hour",
                           "write e.g. 1.006" + ("" if required else ", or leave it empty when there is none"))
    return value
