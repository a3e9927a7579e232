"""Template assets: the library of optimal mixed-GPU placements, one partition per model."""

import dagster as dg

from assets.config import ScenarioConfig
from coral_dagster.catalog.scenarios import load_scenario, scenario_names
from resources.store import CoralDuckDB

MODELS = sorted({m.model for name in scenario_names() for m in load_scenario(name).models})
model_partitions = dg.StaticPartitionsDefinition(MODELS)


@dg.asset(group_name="templates", partitions_def=model_partitions, kinds={"duckdb", "python"}, deps=["profiles"])
def template_library(context: dg.AssetExecutionContext, config: ScenarioConfig,
                     duckdb: CoralDuckDB) -> dg.MaterializeResult:
    """Every non-dominated template of one model in the scenario (prefill, decode, aggregated), in `templates`."""
    from coral_dagster.app.rounds import store_model_templates
    from coral_dagster.templates.library import build_library_with_stats

    model, scenario = context.partition_key, load_scenario(config.scenario)
    if model not in {m.model for m in scenario.models}:
        context.log.info("%s is not in scenario %s; nothing to build", model, scenario.name)
        return dg.MaterializeResult(metadata={"templates": dg.MetadataValue.int(0), "scenario": scenario.name})
    templates, stats = build_library_with_stats(scenario, models=[model])
    rows = store_model_templates(duckdb.store(), scenario, model, templates)
    return dg.MaterializeResult(metadata={
        "scenario": scenario.name,
        "templates": dg.MetadataValue.int(rows),
        "build_s": dg.MetadataValue.float(round(stats.total_s, 2)),
        "per_phase": dg.MetadataValue.md(stats.as_frame().to_markdown(index=False)),
    })


@dg.asset_check(asset=template_library, description="Every template's layer split sums to its model's layers.")
def layer_splits_sum_to_layers(duckdb: CoralDuckDB) -> dg.AssetCheckResult:
    from coral_dagster.templates.checks import layer_split_problems

    problems, checked = layer_split_problems(duckdb.store())
    return dg.AssetCheckResult(passed=not problems, metadata={"templates_checked": dg.MetadataValue.int(checked),
                                                              "problems": dg.MetadataValue.json(problems[:20])})
