"""Shared YAML reading and field checks that report file, row, field and the fix."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from coral_dagster.errors import CatalogError


# Catalog and scenario files are tens of kilobytes; a bound far above them keeps a wrong path from being read whole.
MAX_YAML_BYTES = 64 << 20


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader without aliases: `*name` references would let a few lines stand for billions of values
    (a "billion laughs" document), and Coral's files never need them."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"alias *{event.anchor} (aliases are not allowed)",
                                              event.start_mark)
        return super().compose_node(parent, index)


def read_yaml(path: Path) -> Any:
    """Read a YAML file, turning a missing or unreadable file, text that is not UTF-8, syntax errors, aliases and
    nesting too deep to read into a `CatalogError` with the line."""
    try:
        size = path.stat().st_size
        if size > MAX_YAML_BYTES:
            raise CatalogError(path, "-", "-", f"file of {size} bytes exceeds {MAX_YAML_BYTES}",
                               "pass the scenario or catalog file itself")
        text = path.read_bytes().decode("utf-8")
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader without aliases
    except FileNotFoundError:
        raise CatalogError(path, "-", "-", "file not found", "restore it from the repository or pass another path")
    except IsADirectoryError:
        raise CatalogError(path, "-", "-", "is a directory, not a file", "pass the YAML file inside it")
    except PermissionError:
        raise CatalogError(path, "-", "-", "cannot be read (permission denied)", "make it readable or copy it")
    except UnicodeDecodeError as exc:
        raise CatalogError(path, "-", "-", f"is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                           f"{exc.start})", "save the file as UTF-8") from None
    except RecursionError:
        raise CatalogError(path, "-", "-", "nests too deep to read", "flatten the document") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        row = mark.line + 1 if mark else "?"
        raise CatalogError(path, row, "-", f"invalid YAML ({exc})", "fix the syntax on that line") from None


def rows_of(doc: Any, key: str, path: Path) -> list[dict]:
    """The list under `key`, checked to be a list of mappings."""
    rows = doc.get(key) if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise CatalogError(path, "-", key, f"expected a list of entries under {key!r}", f"add '{key}: [...]'")
    return rows


def field(row: dict, name: str, kind: type | tuple[type, ...], path: Path, idx: object, *, positive: bool = False,
          default: Any = ...) -> Any:
    """One typed field of one row; missing, mistyped, non-finite or non-positive values raise `CatalogError`."""
    if name not in row:
        if default is not ...:
            return default
        raise CatalogError(path, idx, name, "missing", f"add {name} to entry {idx}")
    value = row[name]
    if kind in (float, (int, float)) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value) if kind is float else value
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise CatalogError(path, idx, name, f"{value!r} is not a {getattr(kind, '__name__', kind)}",
                           f"give {name} a value of that type")
    if isinstance(value, float) and not math.isfinite(value):
        raise CatalogError(path, idx, name, f"{value!r} is not a finite number", f"give {name} a finite number")
    if positive and not (isinstance(value, (int, float)) and value > 0):
        raise CatalogError(path, idx, name, f"{value!r} must be positive", f"give {name} a value above 0")
    return value


def check_unique(keys: list[str], path: Path, name: str) -> None:
    """Raise on the first duplicate key, naming both rows."""
    seen: dict[str, int] = {}
    for i, k in enumerate(keys):
        if k in seen:
            raise CatalogError(path, i, name, f"duplicate {k!r} (first at entry {seen[k]})", "remove one of them")
        seen[k] = i
