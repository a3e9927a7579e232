"""`coral templates …`: the best placement of one node multiset, and the template library of a scenario."""

from __future__ import annotations

import click

from coral_dagster.app.template_library import MAX_N_MAX, MAX_RHO
from coral_dagster.cli._out import (POSITIVE, SCENARIO_HELP, FiniteFloat, db_option, emit, emit_json, emit_table,
                                   json_option)
from coral_dagster.vocab import PHASES, T_HAT_RULE_NAMES

t_hat_rule_option = click.option(
    "--t-hat-rule", "t_hat_rule", type=click.Choice(T_HAT_RULE_NAMES), default=None,
    help="Rule T̂ is computed by (default: the scenario's `templates: {t_hat_rule}`, else slo): paper, the paper's "
         "per-stage rule (ℓ/S, no margin or queueing, no activation charge, KV for one batch); slo, ours.")


def _template_dict(t) -> dict:
    return {
        "template_id": t.template_id, "model": t.model, "phase": t.phase, "slo_ms": t.slo_ms, "nodes": str(t.nodes),
        "n_stages": len(t.stages), "tokens_per_s": t.tokens_per_s, "bound": t.bound,
        "pp_partition": t.pp_partition, "vllm_env": {"VLLM_PP_LAYER_PARTITION": t.pp_partition},
        "stages": [{"start": s.start, "end": s.end, "layers": s.layers, "nodes": [str(n) for n in s.nodes],
                    "shares": list(s.shares)} for s in t.stages],
    }


@click.group()
def cli() -> None:
    """Serving templates: throughput-optimal pipeline placements of node multisets per (model, phase, SLO).

    `best` places one multiset (our exact fast method or the paper's ILP); `build` computes and stores a
    scenario's whole library; `list` reads a stored library.
    """


@cli.command()
@click.option("--model", required=True, help="Model alias or Hugging Face id (see `coral catalog models`).")
@click.option("--phase", type=click.Choice(PHASES), required=True, help="prefill, decode or aggregated.")
@click.option("--nodes", required=True, help="Node multiset, e.g. 3xL40S:1,3xH100:2.")
@click.option("--slo-ms", type=POSITIVE, default=None,
              help="Latency SLO in ms (prefill: TTFT; decode and aggregated: per output token). "
                   "Default: the scenario's.")
@click.option("--prefill-slo-ms", type=POSITIVE, default=None,
              help="Aggregated only: the first-token bound (default: the scenario's prefill SLO).")
@click.option("--method", type=click.Choice(["fast", "ilp"]), default="fast", show_default=True,
              help="fast: our exact method; ilp: the paper's ILP with HiGHS (slow, the reference).")
@click.option("--scenario", default=None,
              help=f"Scenario giving the trace, SLOs and network: {SCENARIO_HELP} (default: the first bundled one "
                   "with the model).")
@click.option("--time-limit-s", type=POSITIVE, default=60.0, show_default=True, help="ILP time limit per stage count.")
@click.option("--explain", is_flag=True, help="Also print the T̂ table optimized over, to re-check the optimum.")
@t_hat_rule_option
@json_option
def best(model: str, phase: str, nodes: str, slo_ms: float | None, prefill_slo_ms: float | None, method: str,
         scenario: str | None, time_limit_s: float, explain: bool, t_hat_rule: str | None, as_json: bool) -> None:
    """The best placement and throughput of one node multiset."""
    from coral_dagster.app.template_library import best_template

    t, tables, solve_s = best_template(model, phase, nodes, slo_ms=slo_ms, prefill_slo_ms=prefill_slo_ms,
                                       scenario=scenario, method=method, time_limit_s=time_limit_s,
                                       t_hat_rule=t_hat_rule)
    out = _template_dict(t) | {"method": method, "solve_s": solve_s, "t_hat_rule": tables.workload.rule,
                               "stage_budget_ms": tables.budget_ms(len(t.stages)),
                               "prompt_tokens": tables.workload.prompt_tokens,
                               "output_tokens": tables.workload.output_tokens,
                               "link_gbps": tables.workload.link_gbps}
    idle = sorted({str(n) for s in t.stages for n, x in zip(s.nodes, s.shares) if x == 0})
    if idle:
        out["notes"] = [f"{', '.join(idle)} carry no load: they cannot hold their stage's layers within its budget "
                        "and memory; a smaller multiset reaches the same throughput."]
    table = tables.to_frame() if explain else None
    if as_json:
        if table is not None:
            out["table"] = table.to_dict(orient="records")
        emit_json(out)
        return
    click.echo(f"{t.model} {t.phase} at {t.slo_ms:g} ms on {t.nodes}: {t.tokens_per_s:,.1f} tokens/s "
               f"({t.bound}-bound), {len(t.stages)} stage(s), VLLM_PP_LAYER_PARTITION={t.pp_partition}, "
               f"{method} in {solve_s * 1e3:.2f} ms, T̂ rule {tables.workload.rule}")
    for note in out.get("notes", []):
        click.echo(f"note: {note}")
    import pandas as pd

    emit_table(pd.DataFrame([{"stage": i, "layers": f"[{s.start},{s.end})", "nodes": " ".join(map(str, s.nodes)),
                              "shares": " ".join(f"{x:.3f}" for x in s.shares)}
                             for i, s in enumerate(t.stages)]), "stages")
    if table is not None:
        emit_table(table, "T̂ table (tokens/s per node holding `layers` layers at the per-stage budget of `stages`)")


@cli.command()
@click.option("--scenario", required=True, help=f"Scenario: {SCENARIO_HELP}.")
@click.option("--models", default=None, help="Comma-separated model aliases (default: all of the scenario's).")
@click.option("--processes", type=click.IntRange(min=1), default=None, help="Worker processes (default: min(2, CPUs)).")
@click.option("--no-prune", is_flag=True, help="Keep templates another one dominates.")
@click.option("--n-max", type=click.IntRange(1, MAX_N_MAX), default=None,
              help="Most nodes per template (default: the scenario's, 6).")
@click.option("--rho", type=FiniteFloat(1.0, MAX_RHO), default=None,
              help="Most GPU memory per template as a multiple of the weights (default: the scenario's, 12).")
@t_hat_rule_option
@db_option
@json_option
def build(scenario: str, models: str | None, processes: int | None, no_prune: bool, n_max: int | None,
          rho: float | None, t_hat_rule: str | None, db_path: str | None, as_json: bool) -> None:
    """Build a scenario's template library and store it in DuckDB under its library key (the digest of what the
    templates depend on: another scenario, or the same one with other --n-max / --rho / --t-hat-rule, keeps its own
    library)."""
    from coral_dagster.app.template_library import build_and_store, library_scenario

    scn = library_scenario(scenario, t_hat_rule, n_max, rho)
    rows, stats, db = build_and_store(scn, db_path, processes=processes, progress=not as_json, prune=not no_prune,
                                      models=[m.strip() for m in models.split(",")] if models else None)
    per_key = stats.as_frame()
    if as_json:
        emit_json({"scenario": stats.scenario, "library_key": scn.library_key, "t_hat_rule": scn.t_hat_rule,
                   "templates": rows, "db": str(db),
                   "tables_s": stats.tables_s, "optimize_s": stats.optimize_s, "total_s": stats.total_s,
                   "processes": stats.processes, "per_model_phase": per_key.to_dict(orient="records")})
        return
    emit_table(per_key, f"templates of {stats.scenario} (library {scn.library_key}, T̂ rule {scn.t_hat_rule})")
    click.echo(f"{rows} templates stored in {db} in {stats.total_s:.1f} s on {stats.processes} process(es)")


@cli.command(name="list")
@click.option("--scenario", required=True, help=f"Scenario whose stored library to read: {SCENARIO_HELP}.")
@click.option("--model", default=None, help="Only this model.")
@click.option("--phase", type=click.Choice(PHASES), default=None, help="Only this phase.")
@click.option("--limit", type=click.IntRange(min=0), default=20, show_default=True,
              help="Rows to print, highest throughput first.")
@t_hat_rule_option
@db_option
@json_option
def list_(scenario: str, model: str | None, phase: str | None, limit: int, t_hat_rule: str | None,
          db_path: str | None, as_json: bool) -> None:
    """Stored templates of a scenario, highest throughput first."""
    from coral_dagster.app.template_library import stored_templates

    df = stored_templates(scenario, t_hat_rule, db_path, model, phase, limit)
    emit(df, as_json, f"templates of {scenario}")
