"""BENCHMARKS.md's generated part, rendered from the results: a headline of at most ten figures, then one section
per bench section with its plots, its rows and each command that made them, once.

Rows come from the `headline` lists of `bench/results/*.json` files written through `bench._results.write_result`
(so stamped with `meta`: command, date, commit). Files without `meta` are not rendered: a figure nobody can re-make
does not appear. A row reaches the headline when `TOP` names its figure or its file marks it `"top": true`.

    python -m bench.report           # rewrite the block between the markers in BENCHMARKS.md
    python -m bench.report --check   # exit 1 when BENCHMARKS.md's block is not what the results render
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from bench._results import RESULTS

DOCUMENT = RESULTS.parent.parent / "BENCHMARKS.md"
START, END = "<!-- report:start -->", "<!-- report:end -->"
#: A headline row's fields (`bench._results.write_result`), then what `meta` adds to it.
FIELDS = ("figure", "paper", "ours", "rule", "availability", "section")
SECTION_COLUMNS = ("figure", "paper", "ours", "rule", "availability")
MAX_TOP = 10
#: The figures a reader sees first, in this order (a bench may also mark a row `"top": true`).
TOP = (
    "core, equal attainment: homo-ilp ÷ Coral",
    "core, equal attainment: cauchy ÷ Coral",
    "extended: homo-ilp ÷ Coral (capacity rule, held-out attainment beside)",
    "extended: cauchy ÷ Coral (capacity rule, held-out attainment beside)",
    "extended: homo ÷ Coral (fixed demand)",
    "core default: gap to the proven bound, CPU time",
    "large, 24 h day: best baseline (homo-ilp) ÷ Coral, $ per million SLO-met tokens",
    "large, 24 h day, spot: best baseline (static-peak) ÷ Coral, $ per million SLO-met tokens",
    "extended x1 scale: Coral ÷ cauchy simulated goodput",
    "extended x1 scale: Coral's delivered ÷ promised share (worst model)",
)


def _ours(row: dict) -> str:
    """What a row says of our figure: a bare number is a ratio (×); none, the note why, as the row gives it."""
    ours = row.get("ours")
    if isinstance(ours, (int, float)) and not isinstance(ours, bool):
        ours = f"{ours:.2f}×"
    if ours is None:
        return f"none: {row['note']}"
    return str(ours)


def headline_rows(results: Path = RESULTS) -> list[dict]:
    """Every stamped row of every result file with `meta`, files in name order and rows in file order; each
    carries its file's stem (`file`) and whether the file marks it `top`."""
    rows = []
    for path in sorted(results.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except ValueError:
            continue  # not one JSON document (e.g. a log of JSON lines): not a result file
        if not isinstance(doc, dict) or "meta" not in doc or not doc.get("headline"):
            continue
        meta = doc["meta"]
        if not all(isinstance(meta.get(k), str) and meta[k] for k in ("command", "date")):
            raise ValueError(f"{path}: meta needs a command and a date (write it through bench._results.write_result)")
        for i, row in enumerate(doc["headline"]):
            if not isinstance(row, dict) or not row.get("figure") or (row.get("ours") is None and not row.get("note")):
                raise ValueError(f"{path}: headline[{i}] needs at least a figure and ours, or a note saying why there "
                                 f"is no figure ({', '.join(FIELDS)})")
            rows.append({**{k: row.get(k) for k in FIELDS}, "ours": _ours(row), "command": meta["command"],
                         "date": meta["date"], "commit": meta.get("commit"), "file": path.stem,
                         "top": bool(row.get("top"))})
    return rows


def section_title(row: dict) -> str:
    """The section a row belongs to ("other" when its bench names none)."""
    return str(row.get("section") or "other")


def anchor(title: str) -> str:
    """GitHub's anchor for a `## title` heading."""
    return re.sub(r"[^\w\- ]", "", title.lower()).strip().replace(" ", "-")


def top_rows(rows: list[dict]) -> list[dict]:
    """The headline: rows `TOP` names (in its order, the first row of each figure), then rows marked `top`."""
    picked: list[dict] = []
    for figure in TOP:
        found = next((r for r in rows if r["figure"] == figure), None)
        if found is not None:
            picked.append(found)
    picked += [r for r in rows if r["top"] and r not in picked]
    if len(picked) > MAX_TOP:
        raise ValueError(f"{len(picked)} headline figures: at most {MAX_TOP} (trim TOP or a bench's `top` rows)")
    return picked


def _table(rows: list[dict], columns: tuple[str, ...]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(_cell(row[k]) for k in columns) + " |" for row in rows]


def _plots(results: Path, stems: list[str]) -> list[str]:
    """Markdown images of the PNG files that belong to the section's result files (same stem, or stem_…)."""
    out = []
    for png in sorted(results.glob("*.png")):
        if any(png.stem == s or png.stem.startswith(f"{s}_") for s in stems):
            out.append(f"![{png.stem}]({_rel(results)}/{png.name})")
    return out


def _rel(results: Path) -> str:
    try:
        return results.resolve().relative_to(DOCUMENT.parent.resolve()).as_posix()
    except ValueError:
        return results.as_posix()


def render(results: Path = RESULTS) -> str:
    """The generated block: the headline, then every section with its plots, rows and commands."""
    rows = headline_rows(results)
    if not rows:
        return "No result file carries a headline yet (`bench._results.write_result` with `headline` rows).\n"
    top = top_rows(rows)
    out = ["## Headline", "", "| figure | paper | ours | section |", "|---|---|---|---|"]
    out += [f"| {_cell(r['figure'])} | {_cell(r['paper'])} | {_cell(r['ours'])} | "
            f"[{_cell(section_title(r))}](#{anchor(section_title(r))}) |" for r in top]
    sections: dict[str, list[dict]] = {}
    for row in rows:
        sections.setdefault(section_title(row), []).append(row)
    for title, members in sections.items():
        stems = list(dict.fromkeys(r["file"] for r in members))
        out += ["", f"## {title}", ""]
        plots = _plots(results, stems)
        if plots:
            out += [*plots, ""]
        out += _table(members, SECTION_COLUMNS)
        out += ["", "Made by:", ""]
        made = dict.fromkeys((r["command"], r["date"], r["commit"]) for r in members)
        out += [f"- `{cmd}` ({date}, {commit or 'commit unknown'})" for cmd, date, commit in made]
    shown = {r["file"] for r in rows}
    rest = [png for png in sorted(results.glob("*.png")) if not any(
        png.stem == s or png.stem.startswith(f"{s}_") for s in shown)]
    if rest:
        out += ["", "## Other plots", ""]
        for png in rest:
            out += [f"![{png.stem}]({_rel(results)}/{png.name})", "", f"{_made_by(results, png)}", ""]
        out.pop()
    return "\n".join(out) + "\n"


def _made_by(results: Path, png: Path) -> str:
    """The command stamped in the result file a plot belongs to (same stem, or the stem before its last `_…`)."""
    for stem in (png.stem, png.stem.rsplit("_", 1)[0]):
        path = results / f"{stem}.json"
        try:
            meta = json.loads(path.read_text()).get("meta") if path.exists() else None
        except ValueError:
            meta = None
        if isinstance(meta, dict) and meta.get("command"):
            return f"Made by `{meta['command']}` ({meta.get('date')}, {meta.get('commit') or 'commit unknown'})."
    return f"From `{png.stem}`'s bench; its result file carries no command stamp."


def _cell(value) -> str:
    if value is None or value == "":
        return "–"
    return str(value).replace("|", "\\|").replace("\n", " ")


def with_block(document: str, block: str) -> str:
    """`document` with the text between the report markers replaced by `block`."""
    head, found, rest = document.partition(START)
    _, found_end, tail = rest.partition(END)
    if not found or not found_end:
        raise ValueError(f"the document has no {START} … {END} block to fill")
    return f"{head}{START}\n{block}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the document's block is stale")
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of result files")
    ap.add_argument("--document", type=Path, default=DOCUMENT, help="markdown file holding the block")
    args = ap.parse_args(argv)
    current = args.document.read_text()
    wanted = with_block(current, render(args.results))
    if args.check:
        if wanted != current:
            print(f"{args.document}'s generated block is not what {args.results} renders: "
                  "run `python -m bench.report`.")
            return 1
        return 0
    args.document.write_text(wanted)
    print(f"wrote {args.document}'s generated block ({len(headline_rows(args.results))} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
