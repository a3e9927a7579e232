"""Domain errors that name the problem and the fix."""

from __future__ import annotations


class CoralError(Exception):
    """Base of every error Coral raises on purpose; the message says what is wrong and how to fix it."""

    def __init__(self, problem: str, fix: str = "") -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem} Fix: {fix}" if fix else problem)


class CatalogError(CoralError):
    """A catalog file is malformed: names the file, row, field and the fix."""

    def __init__(self, path: object, row: object, field: str, problem: str, fix: str) -> None:
        self.path, self.row, self.field = str(path), row, field
        super().__init__(f"{path}, row {row}, field {field!r}: {problem}.", fix)


class UnknownNameError(CoralError):
    """A GPU, node, model, region or scenario name that the catalogs do not know."""

    def __init__(self, kind: str, name: str, valid: list[str] | tuple[str, ...]) -> None:
        self.kind, self.name, self.valid = kind, name, list(valid)
        super().__init__(
            f"unknown {kind} {name!r}.", f"use one of: {', '.join(sorted(self.valid))}."
        )


class InfeasibleError(CoralError):
    """No plan or placement satisfies the constraints; the message names what binds."""


class SolverTimeoutError(CoralError):
    """The solver hit its time limit without any feasible solution."""


class StoreLockedError(CoralError):
    """The DuckDB file is held by another process."""


class StoreFileError(CoralError):
    """The DuckDB file cannot be opened, read or written: truncated, corrupted, read-only or of an older schema."""
