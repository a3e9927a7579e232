"""HiGHS set-up and status decoding for every PuLP model Coral solves (placement ILP, allocation ILP, Helix)."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys


@contextlib.contextmanager
def quiet_stdout():
    """File descriptor 1 sent to /dev/null: HiGHS's C++ code prints to it (its banner, and notes such as
    `HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();` even with output off), which would
    corrupt `--json` output."""
    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


@functools.lru_cache(maxsize=1)
def silence_banner() -> None:
    """HiGHS prints a banner to stdout on its first instance per process; make that instance here, quietly."""
    try:
        import highspy
    except ImportError:
        return
    with quiet_stdout():
        highspy.Highs()


def pulp_solver(time_limit_s: float, gap_rel: float, mip: bool = True, **highs_options):
    """HiGHS through its Python API with `highs_options`; CBC when highspy is missing. No `threads` option: HiGHS
    keeps one scheduler per process, and another thread count than the first solve's makes later solves fail."""
    import pulp

    silence_banner()
    highs = pulp.HiGHS(msg=False, mip=mip, timeLimit=time_limit_s, gapRel=gap_rel, **highs_options)
    if highs.available():
        return highs
    return pulp.PULP_CBC_CMD(msg=False, mip=mip, timeLimit=max(1, int(math.ceil(time_limit_s))), gapRel=gap_rel)


def solve_status(prob, integer: bool) -> tuple[str, float]:
    """(status: optimal | infeasible | feasible-time-limit | no-solution, the proven bound) of a solved PuLP
    model; the bound is the MIP dual bound for an integer model, else the objective."""
    import pulp

    model = getattr(prob, "solverModel", None)
    if model is not None and hasattr(model, "getModelStatus"):
        import highspy

        st = model.getModelStatus()
        info = model.getInfo()
        if st == highspy.HighsModelStatus.kOptimal:
            status = "optimal"
        elif st in (highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kUnboundedOrInfeasible):
            status = "infeasible"
        elif info.primal_solution_status == 2:
            status = "feasible-time-limit"
        else:
            status = "no-solution"
        bound = info.mip_dual_bound if integer and status != "infeasible" else info.objective_function_value
        if prob.sense == pulp.LpMaximize:  # PuLP hands HiGHS the negated objective of a maximisation
            bound = -bound
        return status, bound
    status = {1: "optimal", -1: "infeasible"}.get(prob.status, "no-solution")
    return status, (pulp.value(prob.objective) if status == "optimal" else math.nan)
