"""The scenario's `day:` section: read as written, a documented default without it, and every bad value refused
with the file, the field and a fix; the day's demand shape against its closed form."""

from __future__ import annotations

import math

import pytest
import yaml

from support.scenario_docs import small

from coral_dagster.catalog.scenarios import DaySpec, load_scenario
from coral_dagster.day.shape import availability_window, diurnal, startup_s, window_count, window_rates
from coral_dagster.errors import CatalogError


def _load(tmp_path, **changes):
    path = tmp_path / "s.yml"
    path.write_text(yaml.safe_dump(small(**changes)))
    return load_scenario(path)


def test_without_a_day_section_the_default_day_applies_and_keys_do_not_move(tmp_path):
    plain = _load(tmp_path)
    assert plain.day is None
    with_day = _load(tmp_path, day={"peak_hour": 9, "peak_to_trough": 3})
    assert with_day.day == DaySpec(peak_hour=9.0, peak_to_trough=3.0)
    assert with_day.scenario_key == plain.scenario_key and with_day.library_key == plain.library_key


@pytest.mark.parametrize("day, field", [
    ({"hourly": [1.0] * 23}, "hourly"),
    ({"hourly": [0.5] * 24}, "hourly"),
    ({"hourly": [1.0] * 24, "peak_hour": 3}, "hourly"),
    ({"peak_to_trough": 0.5}, "peak_to_trough"),
    ({"peak_hour": 25}, "peak_hour"),
    ({"bursts": "yes"}, "bursts"),
    ({"weight_gbytes_per_s": 0}, "weight_gbytes_per_s"),
    ({"boot_min": -1}, "boot_min"),
    ({"boot_mins": 1}, "boot_mins"),
    ("every day", "day"),
])
def test_a_bad_day_value_names_file_field_and_fix(tmp_path, day, field):
    with pytest.raises(CatalogError) as info:
        _load(tmp_path, day=day)
    text = str(info.value)
    assert "s.yml" in text and field in text and info.value.fix


def test_diurnal_shape_is_the_cosine_between_trough_and_peak():
    spec = DaySpec(peak_hour=15, peak_to_trough=4)
    assert diurnal(spec, 15 * 60) == pytest.approx(1.0)
    assert diurnal(spec, 3 * 60) == pytest.approx(0.25)
    assert diurnal(spec, 9 * 60) == pytest.approx((1 + 0.25) / 2)
    explicit = DaySpec(hourly=tuple([0.5] * 12 + [1.0] * 12))
    assert diurnal(explicit, 11 * 60 + 59) == 0.5 and diurnal(explicit, 12 * 60) == 1.0


def test_window_rates_follow_the_shape_and_the_availability_series(tmp_path):
    scn = _load(tmp_path, day={"hourly": [0.25] * 12 + [1.0] * 12, "bursts": False},
                availability={"default_nodes": 8, "series": {"window_min": 60, "multipliers": [1, 0.5]}})
    assert window_count(scn, 24) == 240
    rate = scn.models[0].rate_req_s
    assert window_rates(scn, 0)["phi-4"] == pytest.approx(0.25 * rate)
    assert window_rates(scn, 120)["phi-4"] == pytest.approx(rate)
    assert [availability_window(scn, w) for w in (0, 9, 10, 19, 20)] == [0, 0, 1, 1, 0]


def test_startup_is_boot_setup_and_the_weights_share_at_the_bandwidth(tmp_path):
    from types import SimpleNamespace

    from coral_dagster.catalog.models import get_model
    from coral_dagster.catalog.nodes import NodeConfig

    scn = _load(tmp_path, day={"boot_min": 2, "setup_min": 1, "weight_gbytes_per_s": 2})
    # Only a template's model and nodes enter the start-up: two L4:1 and one L40S:1 load a third each.
    template = SimpleNamespace(model="phi-4", nodes=SimpleNamespace(counts=((NodeConfig("L4", 1), 2),
                                                                            (NodeConfig("L40S", 1), 1))))
    expected = 180.0 + get_model("phi-4").total_weight_bytes / 3 / 2e9
    assert math.isclose(startup_s(scn.day, scn, template), expected)
