"""The template library of a scenario: enumerate node multisets, optimize them in parallel, prune, store in DuckDB.

Per (model, phase, SLO): every multiset of at most `n_max` nodes from the scenario's configurations whose total
GPU memory lies in [weights, ρ × weights] gets its exact best placement (`sweep.sweep`). A template
is dropped only when another of the same (model, phase, SLO) uses no more nodes of every configuration and has
no less throughput (relative slack `DOMINANCE_REL_TOL` for float noise). Adding a node never lowers the optimum
(it can join any stage), so along any chain of sub-multisets the throughput is non-decreasing; hence a multiset
is dominated exactly when one of its one-node-smaller sub-multisets reaches its throughput, which is what is
checked. Such a sub-multiset is always enumerated: it has enough memory because the dominating one below it has.
Decode and aggregated put one node on every stage of a multi-stage pipeline (`best.one_path_only`), so there a node
can lower the optimum and every smaller sub-multiset is checked instead.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from concurrent.futures import as_completed
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import pandas as pd

from coral_dagster.catalog.gpus import node_spec
from coral_dagster.catalog.nodes import NodeConfig, NodeMultiset
from coral_dagster.errors import CoralError, UnknownNameError
from coral_dagster.lifetimes import worker_pool
from coral_dagster.templates.best import make_template, verify_template
from coral_dagster.templates.optimize import Placement
from coral_dagster.templates.sweep import sweep
from coral_dagster.templates.throughput import ThroughputTables, build_tables, workload_for
from coral_dagster.templates.types import Template, stages_doc, stages_from_doc
from coral_dagster.vocab import PHASES, T_HAT_RULE_NAMES, Phase

DOMINANCE_REL_TOL = 1e-9
TEMPLATES_TABLE = "templates"
TEMPLATE_NODES_TABLE = "template_nodes"
FRAME_COLUMNS = [
    "template_id", "scenario", "library_key", "model", "phase", "slo_ms", "nodes", "n_nodes", "n_stages",
    "tokens_per_s", "bound", "pp_partition", "stages_json", "counts_json",
]


def enumerate_multisets(configs: Sequence[NodeConfig], weight_bytes: float, n_max: int = 6,
                        rho: float = 12.0) -> list[tuple[int, ...]]:
    """Count vectors over `configs` with 1..n_max nodes and total GPU memory in [weights, ρ × weights]."""
    if n_max < 1 or rho < 1:
        raise CoralError(f"n_max={n_max}, rho={rho}.", "use n_max ≥ 1 and rho ≥ 1.")
    mem = [node_spec(c).mem_bytes for c in configs]
    out = []
    for n in range(1, n_max + 1):
        for combo in itertools.combinations_with_replacement(range(len(configs)), n):
            total = sum(mem[i] for i in combo)
            if weight_bytes <= total <= rho * weight_bytes:
                counts = [0] * len(configs)
                for i in combo:
                    counts[i] += 1
                out.append(tuple(counts))
    return sorted(out)


def key_templates(tables: ThroughputTables, multisets: Sequence[tuple[int, ...]],
                  prune: bool = True) -> tuple[list[Template], int]:
    """Templates of one (model, phase, SLO): optimize every count vector over `tables.configs`, drop the
    dominated ones; returns the templates and how many multisets were feasible."""
    one_path = tables.workload.phase != "prefill"  # `best.one_path_only`: one node per stage when S > 1
    placements = sweep(tables.tokens_per_s, tables.n_layers, multisets, one_path)  # one entry per count vector
    drop = dominated({c: p.tokens_per_s for c, p in placements.items()}, not one_path) if prune else set()
    out = []
    for counts, placement in sorted(placements.items()):
        if counts in drop:
            continue
        # Groups follow the multiset's own (sorted) configuration order, which `make_template` expects.
        present = sorted((i for i, k in enumerate(counts) if k), key=lambda i: tables.configs[i])
        nodes = NodeMultiset.of({tables.configs[i]: counts[i] for i in present})
        compact = Placement(placement.n_stages, tuple(tuple(g[i] for i in present) for g in placement.groups),
                            placement.layers, placement.tokens_per_s)
        out.append(make_template(tables, nodes, compact))
    return out, len(placements)


def _key_task(args):
    key, tables, multisets, prune = args
    return key, key_templates(tables, multisets, prune)


def _tables_task(args) -> ThroughputTables:
    workload, configs, max_stages = args
    return build_tables(workload, configs, max_stages)


def dominated(values: dict[tuple[int, ...], float], monotone: bool = True) -> set[tuple[int, ...]]:
    """Count vectors some smaller vector matches in throughput: with `monotone` (adding a node never lowers the
    optimum) a one-node-smaller one suffices, else every smaller one is checked (see the module docstring)."""
    out = set()
    for counts, value in values.items():
        if monotone:
            smaller = [counts[:i] + (k - 1,) + counts[i + 1:] for i, k in enumerate(counts) if k]
        else:
            smaller = [v for v in itertools.product(*(range(k + 1) for k in counts)) if v != counts]
        for sub in smaller:
            other = values.get(sub)
            if other is not None and other >= value * (1 - DOMINANCE_REL_TOL):
                out.add(counts)
                break
    return out


@dataclass(frozen=True)
class LibraryStats:
    """What a build did: multisets optimized, templates before and after pruning, and time per step."""

    scenario: str
    # (model, phase, slo_ms, multisets optimized, feasible, kept, computed_as: the model whose optimization it shares)
    per_key: tuple[tuple[str, str, float, int, int, int, str], ...]
    tables_s: float
    optimize_s: float
    total_s: float
    processes: int

    def as_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.per_key, columns=["model", "phase", "slo_ms", "multisets", "feasible", "kept",
                                                   "computed_as"])


def build_library(scenario, *, processes: int | None = None, progress: bool = False,
                  models: Sequence[str] | None = None, phases: Sequence[Phase] = PHASES,
                  prune: bool = True, n_max: int | None = None, rho: float | None = None,
                  tables: dict[tuple[str, str], ThroughputTables] | None = None) -> list[Template]:
    """All templates of a scenario (see `build_library_with_stats`)."""
    return build_library_with_stats(scenario, processes=processes, progress=progress, models=models,
                                    phases=phases, prune=prune, n_max=n_max, rho=rho, tables=tables)[0]


def build_library_with_stats(scenario, *, processes: int | None = None, progress: bool = False,
                             models: Sequence[str] | None = None, phases: Sequence[Phase] = PHASES,
                             prune: bool = True, n_max: int | None = None, rho: float | None = None,
                             tables: dict[tuple[str, str], ThroughputTables] | None = None,
                             ) -> tuple[list[Template], LibraryStats]:
    """Build the library of a scenario (a `Scenario` or its name) over `processes` worker processes, one
    (model, phase) per task, largest first. Models with the same `template_key` (served models of one base with
    the same SLOs and trace) are optimized once, as the first of them, and the others get copies under their names.

    `n_max` and `rho` override the scenario's (most nodes per template; memory at most ρ × the weights).
    `tables` may supply T̂ tables per (model, phase) (e.g. from a test's synthetic performance model); otherwise
    they come from the shipped performance model. Returns the templates sorted by id and the build's stats.
    """
    from coral_dagster.catalog.models import get_model
    from coral_dagster.catalog.scenarios import load_scenario

    scn = load_scenario(scenario) if isinstance(scenario, str) else scenario
    n_max = scn.n_max if n_max is None else int(n_max)
    rho = scn.rho if rho is None else float(rho)
    processes = processes or min(2, os.cpu_count() or 1)
    wanted = [m for m in scn.models if models is None or m.model in models]
    if models is not None and len(wanted) != len(set(models)):
        known = [m.model for m in scn.models]
        raise CoralError(f"models {sorted(set(models) - set(known))} are not in scenario {scn.name}.",
                         f"use some of: {', '.join(known)}.")
    computed_as: dict[str, str] = {}
    for m in wanted:
        computed_as[m.model] = next(o.model for o in wanted if o.template_key == m.template_key)
    computed = [m for m in wanted if computed_as[m.model] == m.model]
    rule = scn.t_hat_rule
    if rule not in T_HAT_RULE_NAMES:
        raise UnknownNameError("T̂ rule", rule, T_HAT_RULE_NAMES)
    workloads = {(m.model, p): workload_for(m, p, scn.link_gbps, rule=rule)
                 for m in computed for p in phases}
    start = time.perf_counter()
    with worker_pool(processes) if processes > 1 else nullcontext() as pool:
        given = dict(tables or {})
        todo = [(w, scn.node_configs, n_max) for k, w in workloads.items() if k not in given]
        built = list(pool.map(_tables_task, todo) if pool else map(_tables_task, todo))
        given.update({(t.workload.model, t.workload.phase): t for t in built})
        tables_s = time.perf_counter() - start
        by_base = {b: enumerate_multisets(scn.node_configs, get_model(b).total_weight_bytes, n_max, rho)
                   for b in sorted({m.base for m in computed})}
        multisets = {m.model: by_base[m.base] for m in computed}
        tasks = []
        for key in workloads:
            t = given[key]
            if t.configs != scn.node_configs or max(t.tokens_per_s) < n_max:
                raise CoralError(f"tables for {key} cover {t.configs} and S ≤ {max(t.tokens_per_s)}, not the "
                                 f"scenario's configurations and S ≤ {n_max}.",
                                 "build tables over scenario.node_configs with max_stages = n_max.")
            tasks.append((key, t, multisets[key[0]], prune))
        # Largest first, so the processes finish close together.
        tasks.sort(key=lambda task: (-len(task[2]), task[0]))
        results: dict[tuple[str, str], tuple[list[Template], int]] = {}
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=sum(len(task[2]) for task in tasks), desc=f"templates {scn.name}", unit="multiset")
        done = (f.result() for f in as_completed([pool.submit(_key_task, t) for t in tasks])) if pool \
            else map(_key_task, tasks)
        for key, found in done:
            results[key] = found
            if bar is not None:
                bar.update(len(multisets[key[0]]))
        if bar is not None:
            bar.close()
    optimize_s = time.perf_counter() - start - tables_s
    templates: list[Template] = []
    per_key = []
    for m in wanted:
        for phase in phases:
            key = (computed_as[m.model], phase)
            found, feasible = results[key]
            templates.extend(found if key[0] == m.model else (replace(t, model=m.model) for t in found))
            per_key.append((m.model, phase, given[key].workload.slo_ms,
                            len(multisets[key[0]]) if key[0] == m.model else 0, feasible, len(found), key[0]))
    templates.sort(key=lambda x: x.template_id)
    stats = LibraryStats(scn.name, tuple(per_key), tables_s, optimize_s, time.perf_counter() - start, processes)
    return templates, stats


def check_library(templates: Iterable[Template], tables: dict[tuple[str, str], ThroughputTables]) -> list[str]:
    """Re-verify every template against its tables (latency rule, partition, throughput); returns problems."""
    problems = []
    for t in templates:
        problems += [f"{t.template_id}: {p}" for p in verify_template(t, tables[(t.model, t.phase)])]
    return problems


def templates_to_frame(templates: Iterable[Template], scenario) -> pd.DataFrame:
    """One row per template (`FRAME_COLUMNS`) of a scenario (a `Scenario` or a bundled name), keyed by its
    `library_key`; `counts_json` maps configuration to node count."""
    scn = _scenario(scenario)
    rows = [{
        "template_id": t.template_id, "scenario": scn.name, "library_key": scn.library_key, "model": t.model,
        "phase": t.phase, "slo_ms": float(t.slo_ms), "nodes": str(t.nodes), "n_nodes": t.nodes.size,
        "n_stages": len(t.stages), "tokens_per_s": float(t.tokens_per_s), "bound": t.bound,
        "pp_partition": t.pp_partition, "stages_json": json.dumps(stages_doc(t.stages)),
        "counts_json": json.dumps({str(n): k for n, k in t.nodes.counts}),
    } for t in templates]
    return pd.DataFrame(rows, columns=FRAME_COLUMNS).astype(
        {"slo_ms": "float64", "n_nodes": "int64", "n_stages": "int64", "tokens_per_s": "float64"})


def _scenario(scenario):
    from coral_dagster.catalog.scenarios import load_scenario

    return load_scenario(scenario) if isinstance(scenario, str) else scenario


def templates_from_frame(df: pd.DataFrame) -> list[Template]:
    """Templates back from `templates_to_frame` rows (or the `templates` table)."""
    node_of: dict[str, NodeConfig] = {}
    out = []
    # Parsed names are memoized: a large library repeats a few dozen configurations in every row.
    for model, phase, slo_ms, nodes, tokens_per_s, bound, stages_json in zip(
            df["model"], df["phase"], df["slo_ms"], df["nodes"], df["tokens_per_s"], df["bound"], df["stages_json"]):
        stages = stages_from_doc(json.loads(stages_json),
                                 lambda n: node_of[n] if n in node_of else node_of.setdefault(n, NodeConfig.parse(n)))
        ms = NodeMultiset.of([n for st in stages for n in st.nodes])
        if str(ms) != nodes:
            raise CoralError(f"template row lists nodes {nodes} but its stages hold {ms}.",
                             "rebuild the library with `coral templates build`.")
        out.append(Template(model, phase, float(slo_ms), ms, tuple(stages), float(tokens_per_s), bound))
    return out


def node_count_frame(templates_frame: pd.DataFrame) -> pd.DataFrame:
    """`(scenario, library_key, template_id, node, count)` rows: how many nodes of each configuration a template
    uses."""
    cols = ["scenario", "library_key", "template_id", "node", "count"]
    rows = [{"scenario": r.scenario, "library_key": r.library_key, "template_id": r.template_id, "node": n,
             "count": int(k)}
            for r in templates_frame.itertuples(index=False) for n, k in json.loads(r.counts_json).items()]
    return pd.DataFrame(rows, columns=cols).astype({"count": "int64"})


def store_library(store, templates: Iterable[Template], scenario) -> int:
    """Replace the library stored under the scenario's `library_key` (rows of `templates` and `template_nodes`) in
    one transaction; libraries of other keys, a bundled scenario's among them, stay as they are."""
    from coral_dagster.store.duck import replace_rows

    scn = _scenario(scenario)
    frame = templates_to_frame(templates, scn)
    with store.transaction() as con:
        replace_rows(con, TEMPLATES_TABLE, frame, {"library_key": scn.library_key})
        replace_rows(con, TEMPLATE_NODES_TABLE, node_count_frame(frame), {"library_key": scn.library_key})
    return len(frame)


def load_library(store, scenario) -> list[Template]:
    """The templates stored under the scenario's `library_key`; empty when none were (a library of an older
    schema has no key, so it is rebuilt rather than trusted)."""
    if "library_key" not in store.columns(TEMPLATES_TABLE):
        return []
    df = store.query(f"SELECT * FROM {TEMPLATES_TABLE} WHERE library_key = ? ORDER BY template_id",
                     [_scenario(scenario).library_key])
    return templates_from_frame(df)
