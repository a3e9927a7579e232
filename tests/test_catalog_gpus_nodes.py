"""GPU catalog and node-configuration parsing against the published spec sheets and SkyPilot's own names."""

from __future__ import annotations

import csv
import ast

import pytest

from coral_dagster import paths
from coral_dagster.catalog.gpus import GIB, get_gpu, load_gpus, node_spec
from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
from coral_dagster.errors import CatalogError, CoralError, UnknownNameError


def test_required_gpus_present_with_datasheet_figures():
    gpus = load_gpus()
    for name in ["H100", "H200", "A100-80GB", "A100", "L40S", "L4", "A10G", "T4", "V100"]:
        assert name in gpus
    # The brief's GPU facts (coral.md §6): memory GB, HBM TB/s, bf16 TFLOP/s.
    for name, hbm_tb_s, tflops in [("H100", 3.35, 989), ("A100-80GB", 2.04, 312), ("L40S", 0.86, 362),
                                   ("L4", 0.30, 121), ("A10G", 0.60, 70)]:
        assert gpus[name].hbm_gb_s / 1000 == pytest.approx(hbm_tb_s, rel=0.01)
        assert gpus[name].bf16_tflops == pytest.approx(tflops, rel=0.01)
    assert gpus["T4"].dtype == "float16" and gpus["V100"].dtype == "float16"


def test_gpu_memory_matches_aws_instance_api():
    """mem_gib equals AWS's GpuInfo MiB (as copied in the SkyPilot catalog) within rounding."""
    reported = {}
    with open(paths.PRICES_DIR / "aws_gpu_vms.csv") as f:
        for row in csv.DictReader(f):
            info = ast.literal_eval(row["GpuInfo"])
            reported[row["AcceleratorName"]] = info["Gpus"][0]["MemoryInfo"]["SizeInMiB"] / 1024
    for name in ["L40S", "L4", "A10G", "T4", "V100", "A100", "A100-80GB", "H100"]:
        assert get_gpu(name).mem_gib == pytest.approx(reported[name], rel=0.01)


def test_node_and_multiset_round_trip():
    assert str(NodeConfig.parse("L40S:4")) == "L40S:4"
    ms = NodeMultiset.parse("3xL40S:1,2xH100:2,L40S:1")
    assert ms.as_dict() == {NodeConfig("L40S", 1): 4, NodeConfig("H100", 2): 2}
    assert ms == NodeMultiset.parse("2xH100:2,4xL40S:1") and ms.size == 6
    assert NodeMultiset.parse(str(ms)) == ms
    assert node_spec("L4:8").mem_bytes == pytest.approx(8 * get_gpu("L4").mem_gib * GIB)


@pytest.mark.parametrize("bad", ["L40S", "L40S:3", "3x", "", "2xL4:1,x y"])
def test_bad_node_text_is_rejected_with_the_format(bad):
    with pytest.raises(CoralError) as err:
        NodeMultiset.parse(bad)
    assert "Fix:" in str(err.value)


def test_unknown_gpu_lists_valid_names():
    with pytest.raises(UnknownNameError) as err:
        node_spec("B300:1")
    assert "H100" in str(err.value) and "B300" in str(err.value)


@pytest.mark.parametrize("edit,field", [
    ("  - {name: H100, mem_gib: -80.0", "mem_gib"),
    ("  - {name: H100, mem_gib: eighty", "mem_gib"),
    ("  - {name: H100, mem_gib: 80.0, dtype: int8", "dtype"),
])
def test_bad_gpu_rows_name_file_row_and_field(tmp_path, edit, field):
    text = (paths.CATALOG_DIR / "gpus.yaml").read_text()
    lines = text.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith("  - {name: H100,"))
    rest = lines[i].split("mem_gib: 80.0", 1)[1]
    if "dtype" in edit:
        rest = rest.replace("dtype: bfloat16", "dtype: int8")
        edit = "  - {name: H100, mem_gib: 80.0"
    lines[i] = edit + rest
    bad = tmp_path / "gpus.yaml"
    bad.write_text("\n".join(lines))
    with pytest.raises(CatalogError) as err:
        load_gpus(bad)
    assert err.value.field == field and err.value.row == 0 and str(bad) in str(err.value)


def test_duplicate_gpu_is_rejected(tmp_path):
    text = (paths.CATALOG_DIR / "gpus.yaml").read_text()
    line = next(x for x in text.splitlines() if x.startswith("  - {name: L4,"))
    bad = tmp_path / "gpus.yaml"
    bad.write_text(text + line + "\n")
    with pytest.raises(CatalogError, match="duplicate 'L4'"):
        load_gpus(bad)
