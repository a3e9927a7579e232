"""`coral profile …`: per-layer latency, T̂, the profile table, the profiling job and the data behind them."""

from __future__ import annotations

import json
from dataclasses import asdict

import click

from coral_dagster.cli._out import POSITIVE, SCENARIO_HELP, db_option, emit, emit_json, emit_table, json_option
from coral_dagster.cli.templates import t_hat_rule_option
from coral_dagster.errors import CoralError
from coral_dagster.vocab import DEMAND_PHASES

_model = click.option("--model", required=True, help="Model alias or Hugging Face id (see `coral catalog models`).")
_node = click.option("--node", required=True, help="Node configuration GPU:count, e.g. L40S:2.")
_phase = click.option("--phase", type=click.Choice(DEMAND_PHASES), required=True, help="Phase.")


def _resolve(model: str, node: str):
    """Catalog entries for the names given; unknown names raise `UnknownNameError` listing the valid ones."""
    from coral_dagster.app.profiling import model_and_node

    return model_and_node(model, node)


def _counts(counts: dict[str, int], as_json: bool) -> None:
    if as_json:
        emit_json(counts)
        return
    for name, n in counts.items():
        click.echo(f"{name}: {n}")


@click.group()
def cli() -> None:
    """Performance profiles: per-layer latency and memory of each (model, node), measured or calibrated.

    Sources, most trusted first: Helix's measured vLLM tables, aiconfigurator's measured kernels, Vidur's
    operator tables, and a roofline whose per-GPU efficiencies are fitted to all of them.
    """


@cli.command()
@_model
@_node
@_phase
@click.option("--tokens", type=click.IntRange(min=1), help="Prefill: prompt tokens in the batch.")
@click.option("--seq-tokens", type=click.IntRange(min=1), help="Prefill: tokens per prompt (default 1024).")
@click.option("--batch", type=click.IntRange(min=1), help="Decode: sequences in the batch.")
@click.option("--context", "context_tokens", type=click.IntRange(min=1), help="Decode: context tokens per sequence.")
@json_option
def latency(model: str, node: str, phase: str, tokens: int | None, seq_tokens: int | None, batch: int | None,
            context_tokens: int | None, as_json: bool) -> None:
    """Milliseconds one layer takes: a prefill batch (--tokens) or one decode iteration (--batch, --context)."""
    from coral_dagster.app.profiling import perf_model

    m, n = _resolve(model, node)
    perf = perf_model()
    if phase == "prefill":
        if not tokens:
            raise CoralError("--phase prefill needs --tokens.", "add --tokens N (prompt tokens in the batch).")
        ms = perf.prefill_ms_per_layer(m, n.config, tokens, seq_tokens)
        out = {"model": m.alias, "node": str(n.config), "phase": phase, "tokens": tokens,
               "seq_tokens": min(tokens, seq_tokens or perf.prefill_seq_tokens)}
    else:
        if not batch or context_tokens is None:
            raise CoralError("--phase decode needs --batch and --context.", "add --batch B --context C.")
        ms = perf.decode_ms_per_layer(m, n.config, batch, context_tokens)
        out = {"model": m.alias, "node": str(n.config), "phase": phase, "batch": batch,
               "context_tokens": context_tokens}
    out |= {"ms_per_layer": ms, "source": perf.source(m, n.config, phase)}
    if as_json:
        emit_json(out)
    else:
        click.echo(f"{ms:.4g} ms per layer ({out['source']})")


@cli.command()
@_model
@_node
@_phase
@click.option("--layers", type=click.IntRange(min=1), required=True, help="Layers the node holds.")
@click.option("--budget-ms", type=POSITIVE, required=True, help="Per-stage latency budget (SLO / stages).")
@click.option("--context", "context_tokens", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Decode: context tokens per sequence.")
@click.option("--send-gbps", type=POSITIVE, default=None, help="Count the activation transfer at this rate.")
@t_hat_rule_option
@json_option
def throughput(model: str, node: str, phase: str, layers: int, budget_ms: float, context_tokens: int,
               send_gbps: float | None, t_hat_rule: str | None, as_json: bool) -> None:
    """T̂: the most tokens/s the node reaches holding --layers layers within --budget-ms, and what bounds it.

    This is the per-node T̂ both rules start from, KV room for one batch: the paper's rule is exactly it (with no
    activation transfer); the slo rule plans templates below it (a scenario's margin and queueing, `coral
    templates best --explain` shows its tables)."""
    from coral_dagster.app.profiling import perf_model

    if t_hat_rule == "paper" and send_gbps is not None:
        raise CoralError("--send-gbps under --t-hat-rule paper: the paper's rule charges no activation transfer.",
                         "drop --send-gbps, or use --t-hat-rule slo.")
    m, n = _resolve(model, node)
    perf = perf_model()
    point = perf.t_hat(m, n.config, phase, layers, budget_ms, context_tokens, send_gbps)
    out = {"model": m.alias, "node": str(n.config), "phase": phase, "layers": layers, "budget_ms": budget_ms,
           "t_hat_rule": t_hat_rule or "slo",
           "max_layers": perf.max_layers(m, n.config), "kv_capacity_tokens": perf.kv_capacity_tokens(
               m, n.config, layers), **asdict(point), "source": perf.source(m, n.config, phase)}
    if as_json:
        emit_json(out)
    else:
        click.echo(f"{point.tokens_per_s:,.1f} tokens/s at batch {point.batch} ({point.stage_ms:.1f} ms per stage, "
                   f"bound: {point.bound}; {out['source']})")


@cli.command()
@_model
@click.option("--node", "nodes", multiple=True, help="Node configuration(s); default: every GPU type x 1, 2, 4, 8.")
@click.option("--phase", type=click.Choice(DEMAND_PHASES), default=None, help="Only this phase.")
@json_option
def show(model: str, nodes: tuple[str, ...], phase: str | None, as_json: bool) -> None:
    """The profile table of a model: per-layer latency by batch, memory sizes and source, per node."""
    from coral_dagster.app.profiling import profile_frame

    alias, df = profile_frame(model, nodes)
    if phase:
        df = df[df["phase"] == phase]
    emit(df, as_json, title=f"{alias}: ms per layer")


@cli.command()
@_model
@_node
@click.option("--layers", type=click.IntRange(min=1), default=2, show_default=True,
              help="Decoder layers to build and time.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Local device to time on.")
@click.option("--engine", type=click.Choice(["torch", "vllm"]), default="torch", show_default=True,
              envvar="CORAL_ENGINE", help="torch layers built from the catalog, or vLLM itself (CUDA only).")
@click.option("--hidden-scale", type=POSITIVE, default=None,
              help="Shrink hidden/heads/MLP widths by this factor (default: 1 on CUDA, ~0.1 on CPU).")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default=None, help="Also write the table as CSV.")
@click.option("--store", is_flag=True, help="Append the table to the DuckDB table `profiles_measured`.")
@db_option
@json_option
def run(model: str, node: str, layers: int, device: str, engine: str, hidden_scale: float | None,
        out_path: str | None, store: bool, db_path: str | None, as_json: bool) -> None:
    """Measure per-layer prefill and decode latency on the local device (random weights, few layers)."""
    from coral_dagster.app.profiling import measure, store_measured, write_csv

    df, notes = measure(model, node, device, layers=layers, engine=engine, hidden_scale=hidden_scale)
    if out_path:
        write_csv(df, out_path)
    if store:
        store_measured(db_path, df, notes)
    if as_json:
        emit_json({"table": json.loads(df.to_json(orient="records")), "notes": notes})
    else:
        emit_table(df.drop(columns=["weight_bytes_per_layer", "kv_bytes_per_token_per_layer",
                                    "engine_reserve_bytes"]), title=f"{model} on {node} ({notes['note']})")


@cli.command()
@click.option("--record", is_flag=True, help="Also record the fit's error as the new regression baseline.")
@json_option
def fit(record: bool, as_json: bool) -> None:
    """Refit the roofline's efficiencies to the shipped measured tables (writes data/profiles/roofline_fit.json)."""
    from coral_dagster.app.profiling import refit

    path, result, errors = refit(record)
    if as_json:
        emit_json({"path": str(path), "meta": result.meta, "errors": errors})
    else:
        click.echo(f"wrote {path} ({result.meta['rows']} rows, {result.meta['tables']} tables)")
        for key, e in errors.items():
            click.echo(f"  {key:>28}: median {100 * e['median_ape']:.1f}%, p90 {100 * e['p90_ape']:.1f}%")


@cli.command("import")
@click.option("--from", "shared_dir", required=True, type=click.Path(file_okay=False, exists=True),
              help="Folder holding profiles/helix-llama1-30b and profiles/vidur.")
@json_option
def import_(shared_dir: str, as_json: bool) -> None:
    """Convert the public Helix and Vidur tables into data/profiles/."""
    from coral_dagster.app.profiling import import_profiles

    _counts(import_profiles(shared_dir), as_json)


@cli.command("aic-tables")
@json_option
def aic_tables(as_json: bool) -> None:
    """Regenerate data/profiles/aiconfigurator_layers.csv from aiconfigurator-core's measured kernels."""
    from coral_dagster.app.profiling import aic_tables as build

    _counts(build(progress=not as_json), as_json)


@cli.command()
@click.option("--scenario", "scenarios", multiple=True, default=("core", "extended", "helix"), show_default=True,
              help=f"Scenario(s), each {SCENARIO_HELP}.")
@click.option("--store", is_flag=True, help="Also replace these scenarios' rows of the DuckDB table `profiles`.")
@db_option
@json_option
def tables(scenarios: tuple[str, ...], store: bool, db_path: str | None, as_json: bool) -> None:
    """Write the bundled scenarios' profile tables to data/profiles/profiles_<scenario>.csv."""
    from coral_dagster.app.profiling import scenario_tables

    _counts(scenario_tables(scenarios, store, db_path), as_json)
