"""Template assets: the library of optimal mixed-GPU placements, one partition per (scenario, model) it serves."""

import dagster as dg

from assets.metadata import row_count
from coral_dagster.catalog.scenarios import load_scenario, scenario_names
from coral_dagster.errors import CoralError
from resources.store import CoralDuckDB


def partition_key(scenario: str, model: str) -> str:
    """The `template_library` partition of one model of one scenario: `scenario/model`."""
    return f"{scenario}/{model}"


template_partitions = dg.StaticPartitionsDefinition(
    [partition_key(name, m.model) for name in scenario_names() for m in load_scenario(name).models])


def scenario_partitions(scenario: str) -> list[str]:
    """The partitions of a bundled scenario, one per model; a clear error for a scenario without any."""
    keys = [k for k in template_partitions.get_partition_keys() if k.split("/", 1)[0] == scenario]
    if not keys:
        raise CoralError(f"scenario {scenario!r} has no template_library partition (the partitions are the bundled "
                         f"scenarios' models: {', '.join(scenario_names())}).",
                         f"run a bundled scenario, or build its library with `coral templates build --scenario "
                         f"{scenario}` and plan with `coral plan`.")
    return keys


class TemplateLibraryConfig(dg.Config):
    """Whether a partition whose model's templates are already stored under its scenario's library key (built from
    the same models, nodes, data files and T̂ rule) keeps them instead of building them again."""

    reuse_stored: bool = False


@dg.asset(group_name="templates", partitions_def=template_partitions, kinds={"duckdb", "python"}, deps=["profiles"])
def template_library(context: dg.AssetExecutionContext, duckdb: CoralDuckDB,
                     config: TemplateLibraryConfig) -> dg.MaterializeResult:
    """Every non-dominated template of each model of a run's partitions (one per scenario and model; `coral run`
    builds a scenario's models in one run), prefill, decode and aggregated, in `templates`. Materialized from the
    UI it builds them; `coral run` keeps a library already stored for the same inputs (`reuse_stored`)."""
    import pandas as pd

    from coral_dagster.app.rounds import store_model_templates, stored_model_templates
    from coral_dagster.templates.library import build_library_with_stats

    rows, build_s, per_phase, reused = 0, 0.0, [], []
    for key in context.partition_keys:
        name, model = key.split("/", 1)
        scenario = load_scenario(name)
        if config.reuse_stored and (kept := stored_model_templates(duckdb.store(), scenario, model)):
            rows += kept
            reused.append(key)
            continue
        templates, stats = build_library_with_stats(scenario, models=[model])
        rows += store_model_templates(duckdb.store(), scenario, model, templates)
        build_s += stats.total_s
        per_phase.append(stats.as_frame().assign(partition=key))
    return dg.MaterializeResult(metadata={
        "partitions": dg.MetadataValue.json(list(context.partition_keys)),
        "templates": dg.MetadataValue.int(rows),
        **row_count(rows),
        "build_s": dg.MetadataValue.float(round(build_s, 2)),
        "reused": dg.MetadataValue.json(reused),
        "per_phase": dg.MetadataValue.md(pd.concat(per_phase).to_markdown(index=False) if per_phase else
                                         "every partition kept its stored templates"),
    })


@dg.asset_check(asset=template_library, description="Every template's layer split sums to its model's layers.")
def layer_splits_sum_to_layers(duckdb: CoralDuckDB) -> dg.AssetCheckResult:
    from coral_dagster.templates.checks import layer_split_problems

    problems, checked = layer_split_problems(duckdb.store())
    description = (f"all {checked:,} stored templates split their model's layers exactly." if not problems else
                   f"{len(problems)} of {checked:,} stored templates split layers wrongly, first: {problems[0]}.")
    return dg.AssetCheckResult(passed=not problems, description=description, metadata={
        "templates_checked": dg.MetadataValue.int(checked), "problems": dg.MetadataValue.json(problems[:20])})
