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


def test_the_headline_holds_top_rows_and_every_row_sits_in_its_section_with_its_command_once(tmp_path):
    results = _fixture(tmp_path)
    write_result("d", {"headline": [{"figure": "fig d", "ours": "3×", "section": "s", "top": True}]},
                 command="python -m bench.d", out=results / "d.json")
    (results / "b_plot.png").write_bytes(b"png")
    first = report.render(results)
    assert report.render(results) == first  # deterministic
    head = first.split("\n## ", 1)[0]
    assert head.splitlines()[:2] == ["## Headline", ""]
    assert [line.split(" | ")[0] for line in head.splitlines()[4:]] == ["| fig d"]  # only the row marked top
    assert [line for line in first.splitlines() if line.startswith("## ")] == ["## Headline", "## other", "## s"]
    section_s = first.split("\n## s\n", 1)[1].split("\n## ", 1)[0]
    assert [line.split(" | ")[0] for line in section_s.splitlines() if line.startswith("| fig ")] == [
        "| fig b1", "| fig d"]
    assert section_s.count("`python -m bench.b`") == 1 and section_s.count("`python -m bench.d`") == 1
    assert "b_plot.png" in section_s
    other = first.split("\n## other\n", 1)[1].split("\n## ", 1)[0]
    assert [line.split(" | ")[0] for line in other.splitlines() if line.startswith("| fig ")] == [
        "| fig a", "| fig b2 \\| piped"]
    assert "unstamped" not in first


def test_more_than_ten_headline_figures_is_an_error(tmp_path):
    rows = [{"figure": f"f{i}", "ours": "1", "top": True} for i in range(report.MAX_TOP + 1)]
    write_result("many", {"headline": rows}, out=tmp_path / "many.json")
    with pytest.raises(ValueError, match="at most 10"):
        report.render(tmp_path)


def test_the_checked_in_headline_is_at_most_ten_rows_and_links_its_sections():
    block = (report.DOCUMENT.read_text().split(report.START, 1)[1].split(report.END, 1)[0])
    headline = block.split("## Headline", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in headline.splitlines() if line.startswith("| ") and not line.startswith("| figure")]
    assert 1 <= len(rows) <= report.MAX_TOP
    for row in rows:
        target = row.rsplit("](#", 1)[1].split(")", 1)[0]
        assert any(report.anchor(line[3:]) == target for line in block.splitlines() if line.startswith("## "))


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
