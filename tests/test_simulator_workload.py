"""Request streams: the bundled traces against their published statistics, rates and burstiness of the generators."""

from __future__ import annotations

import numpy as np
import pytest

from coral_dagster.errors import UnknownNameError
from coral_dagster.simulator import ModelLoad, load_trace, make_workload, trace_means


@pytest.mark.parametrize("name, rows, prompt, output", [
    # shared/data/README.md, from the AzurePublicDataset notes: rows, mean input and output tokens.
    ("azure-conv", 19_366, 1155, 211),
    ("azure-code", 8_819, 2048, 28),
])
def test_traces_match_published_statistics(name, rows, prompt, output):
    df = load_trace(name)
    assert len(df) == rows
    assert list(df.columns) == ["arrival_s", "prompt_tokens", "output_tokens"]
    assert df.arrival_s.iloc[0] == 0 and df.arrival_s.is_monotonic_increasing
    assert 3000 < df.arrival_s.iloc[-1] < 3700  # about one hour
    mp, mo = trace_means(name)
    assert mp == pytest.approx(prompt, abs=0.5) and mo == pytest.approx(output, abs=0.5)


def test_unknown_trace_lists_valid_names():
    with pytest.raises(UnknownNameError, match="azure-conv"):
        load_trace("burstgpt")


@pytest.mark.parametrize("trace", ["azure-conv", "azure-code"])
def test_replay_hits_the_rate_and_keeps_the_trace_lengths(trace):
    rate, duration = 40.0, 3 * 3600.0
    w = make_workload([ModelLoad("m", trace, rate)], duration, seed=1)
    assert len(w) / duration == pytest.approx(rate, rel=0.03)
    df = load_trace(trace)
    assert w.prompt_tokens.mean() == pytest.approx(df.prompt_tokens.mean(), rel=0.02)
    assert w.output_tokens.mean() == pytest.approx(df.output_tokens.mean(), rel=0.02)
    # Replay keeps the trace's pairing of prompt and output lengths: every pair occurs in the trace.
    pairs = set(zip(df.prompt_tokens, df.output_tokens))
    assert all(p in pairs for p in zip(w.prompt_tokens[:2000].tolist(), w.output_tokens[:2000].tolist()))


@pytest.mark.parametrize("arrivals, cv", [("poisson", 1.0), ("gamma", 2.5), ("gamma", 0.5)])
def test_renewal_arrivals_have_the_asked_rate_and_burstiness(arrivals, cv):
    rate, duration = 20.0, 5000.0
    w = make_workload([ModelLoad("m", "azure-conv", rate)], duration, seed=3, arrivals=arrivals, gamma_cv=cv)
    gaps = np.diff(w.arrival_s)
    assert len(w) / duration == pytest.approx(rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_models_are_merged_in_time_order_and_seeded():
    loads = [ModelLoad("a", "azure-conv", 5.0), ModelLoad("b", "azure-code", 7.0)]
    w1 = make_workload(loads, 600, seed=9)
    w2 = make_workload(loads, 600, seed=9)
    w3 = make_workload(loads, 600, seed=10)
    assert np.all(np.diff(w1.arrival_s) >= 0) and w1.arrival_s.max() < 600
    assert set(np.unique(w1.model)) == {0, 1}
    np.testing.assert_array_equal(w1.arrival_s, w2.arrival_s)
    np.testing.assert_array_equal(w1.prompt_tokens, w2.prompt_tokens)
    assert not np.array_equal(w1.prompt_tokens[:100], w3.prompt_tokens[:100])
