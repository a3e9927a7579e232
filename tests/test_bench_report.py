"""`python -m bench.report`: the headline is rendered from stamped result files only, deterministically, and the
checked-in BENCHMARKS.md block is exactly what the checked-in results render."""

from __future__ import annotations

import json

import pytest

from bench import report
from bench._results import write_result


def _fixture(tmp_path):
    """Three result files as benches write them, and two that must not reach the headline."""
    rows = {"b": [{"figure": "fig b1", "ours": "2×", "paper": "3×", "section": "s"},
                  {"figure": "fig b2 | piped", "ours": "0.5"}],
            "a": [{"figure": "fig a", "ours": "1.0", "rule": "slo", "availability": "×0.5"}]}
    for name, headline in rows.items():
        write_result(name, {"headline": headline, "rows": [1, 2]}, command=f"python -m bench.{name}",
                     out=tmp_path / f"{name}.json")
    (tmp_path / "old.json").write_text(json.dumps({"headline": [{"figure": "unstamped", "ours": "9"}]}))
    (tmp_path / "log.json").write_text('{"a": 1}\n{"a": 2}\n')
    write_result("c", {"rows": []}, out=tmp_path / "c.json")  # stamped, no headline
    return tmp_path


def test_the_headline_renders_stamped_rows_only_in_file_order_with_command_and_date(tmp_path):
    results = _fixture(tmp_path)
    first = report.render(results)
    assert report.render(results) == first  # deterministic
    lines = first.splitlines()
    assert lines[0] == "| " + " | ".join(report.HEADER) + " |"
    body = lines[2:]
    meta = json.loads((results / "a.json").read_text())["meta"]
    date, commit = meta["date"], meta["commit"]
    assert [line.split(" | ")[0] for line in body] == ["| fig a", "| fig b1", "| fig b2 \\| piped"]
    assert body[0] == f"| fig a | – | 1.0 | slo | ×0.5 | – | `python -m bench.a` | {date} | {commit} |"
    assert "unstamped" not in first


def test_the_block_is_replaced_between_its_markers_and_check_reports_staleness(tmp_path):
    (tmp_path / "r").mkdir()
    results = _fixture(tmp_path / "r")
    doc = tmp_path / "B.md"
    doc.write_text(f"# T\n\n{report.START}\nold\n{report.END}\n\nnotes\n")
    assert report.main(["--check", "--results", str(results), "--document", str(doc)]) == 1
    assert report.main(["--results", str(results), "--document", str(doc)]) == 0
    assert doc.read_text() == f"# T\n\n{report.START}\n{report.render(results)}{report.END}\n\nnotes\n"
    assert report.main(["--check", "--results", str(results), "--document", str(doc)]) == 0


def test_a_stamped_headline_row_without_its_figure_is_an_error(tmp_path):
    write_result("x", {"headline": [{"ours": "1"}]}, out=tmp_path / "x.json")
    with pytest.raises(ValueError, match="headline\\[0\\] needs at least a figure"):
        report.render(tmp_path)


def test_benchmarks_md_headline_is_what_the_checked_in_results_render():
    assert report.main(["--check"]) == 0, "run `python -m bench.report` and commit BENCHMARKS.md"
