"""HiGHS set-up and status decoding for every PuLP model Coral solves (placement ILP, allocation ILP, Helix).

Reproducible solves (issue 30): a MIP stops after `max_nodes` branch-and-bound nodes (`mip_max_nodes`: work, the
same count on an idle or a loaded machine) with HiGHS's random seed fixed, so the same inputs give the same plan,
bound and status; the wall-clock limit is only a safety net, and a solve it stops is reported as
`feasible-time-limit` (not reproducible) rather than `feasible-work-limit`.
"""

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


# HiGHS's seed for every solve (its default, written down so a change of default cannot change plans).
RANDOM_SEED = 0
# Branch-and-bound nodes one allocation MIP may explore (the work limit; see `bench/solve_times.py` for what it buys).
DEFAULT_MAX_NODES = 4000
# The wall-clock safety net of a plan's solves, seconds: the work limit ends a solve long before it on a 2-core
# machine; reaching it is reported as not reproducible.
SAFETY_NET_S = 600.0


def pulp_solver(time_limit_s: float, gap_rel: float, mip: bool = True, max_nodes: int | None = None,
                **highs_options):
    """HiGHS through its Python API with `highs_options`, at most `max_nodes` nodes per MIP and a fixed seed; CBC
    when highspy is missing. No `threads` option: HiGHS keeps one scheduler per process, and another thread count
    than the first solve's makes later solves fail; its MIP search is deterministic whatever the count (tested by
    `tests/test_allocation_reproducible.py` under CPU load)."""
    import pulp

    silence_banner()
    if max_nodes is not None:
        highs_options["mip_max_nodes"] = int(max_nodes)
    highs = _work_limited_highs()(msg=False, mip=mip, timeLimit=time_limit_s, gapRel=gap_rel, random_seed=RANDOM_SEED,
                       **highs_options)
    if highs.available():
        return highs
    return pulp.PULP_CBC_CMD(msg=False, mip=mip, timeLimit=max(1, int(math.ceil(time_limit_s))), gapRel=gap_rel)


# Branch-and-bound nodes every MIP of this process has explored: the work a plan took, read before and after it.
_NODES = [0]


def nodes_explored() -> int:
    """Branch-and-bound nodes explored by every HiGHS MIP solved in this process so far."""
    return _NODES[0]


@functools.lru_cache(maxsize=1)
def _work_limited_highs():
    """PuLP's HiGHS, reading a MIP stopped by a work limit (`kSolutionLimit`, which PuLP 3.3 does not map) as it
    reads one stopped by time: a plan when HiGHS has one, else none."""
    import pulp

    class WorkLimitedHighs(pulp.HiGHS):
        def findSolutionValues(self, lp):
            try:
                return super().findSolutionValues(lp)
            except KeyError:  # kSolutionLimit: the values are read before PuLP looks the status up
                if lp.solverModel.getInfo().primal_solution_status == 2:
                    return pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible
                return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound

    return WorkLimitedHighs


def solve_status(prob, integer: bool) -> tuple[str, float]:
    """(status: optimal | infeasible | feasible-work-limit | feasible-time-limit | no-solution, the proven bound)
    of a solved PuLP model; the bound is the MIP dual bound for an integer model, else the objective.
    `feasible-work-limit`: stopped by a work limit (nodes), reproducible; `feasible-time-limit`: by the wall clock."""
    import pulp

    model = getattr(prob, "solverModel", None)
    if model is not None and hasattr(model, "getModelStatus"):
        import highspy

        st = model.getModelStatus()
        info = model.getInfo()
        if integer:
            _NODES[0] += max(0, int(info.mip_node_count))
        if st == highspy.HighsModelStatus.kOptimal:
            status = "optimal"
        elif st in (highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kUnboundedOrInfeasible):
            status = "infeasible"
        elif info.primal_solution_status == 2:
            timed = st in (highspy.HighsModelStatus.kTimeLimit, highspy.HighsModelStatus.kInterrupt)
            status = "feasible-time-limit" if timed else "feasible-work-limit"
        else:
            status = "no-solution"
        bound = info.mip_dual_bound if integer and status != "infeasible" else info.objective_function_value
        if prob.sense == pulp.LpMaximize:  # PuLP hands HiGHS the negated objective of a maximisation
            bound = -bound
        return status, bound
    status = {1: "optimal", -1: "infeasible"}.get(prob.status, "no-solution")
    return status, (pulp.value(prob.objective) if status == "optimal" else math.nan)
