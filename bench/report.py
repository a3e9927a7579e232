"""BENCHMARKS.md's headline, rendered from the results: every row of a `headline` list in a `bench/results/*.json`
file written through `bench._results.write_result` (so stamped with `meta`: command, date, commit), with the
command and date that made it. Files without `meta` are not rendered: a figure nobody can re-make does not head
the document.

    python -m bench.report           # rewrite the block between the markers in BENCHMARKS.md
    python -m bench.report --check   # exit 1 when BENCHMARKS.md's block is not what the results render
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench._results import RESULTS

DOCUMENT = RESULTS.parent.parent / "BENCHMARKS.md"
START, END = "<!-- report:start -->", "<!-- report:end -->"
#: A headline row's fields (`bench._results.write_result`), then what `meta` adds to it.
FIELDS = ("figure", "paper", "ours", "rule", "availability", "section")
HEADER = ("figure", "paper", "ours", "rule", "availability", "section", "command", "date", "commit")


def _ours(row: dict) -> str:
    """What a row says of our figure: a bare number is a ratio (×); none, the note why, as the row gives it."""
    ours = row.get("ours")
    if isinstance(ours, (int, float)) and not isinstance(ours, bool):
        ours = f"{ours:.2f}×"
    if ours is None:
        return f"none: {row['note']}"
    return str(ours)


def headline_rows(results: Path = RESULTS) -> list[dict]:
    """The headline rows of every result file with `meta`, files in name order and rows in file order."""
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
                         "date": meta["date"], "commit": meta.get("commit")})
    return rows


def render(results: Path = RESULTS) -> str:
    """The headline block: a markdown table, one row per headline row, or a sentence when there is none."""
    rows = headline_rows(results)
    if not rows:
        return "No result file carries a headline yet (`bench._results.write_result` with `headline` rows).\n"
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(_cell(row[k], code=k == "command") for k in HEADER) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _cell(value, code: bool = False) -> str:
    if value is None or value == "":
        return "–"
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return f"`{text}`" if code else text


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
            print(f"{args.document}'s headline is not what {args.results} renders: run `python -m bench.report`.")
            return 1
        return 0
    args.document.write_text(wanted)
    print(f"wrote the headline of {args.document} ({len(headline_rows(args.results))} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
