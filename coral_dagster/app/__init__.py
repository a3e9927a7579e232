"""Use cases over the store — plan, find, simulate, deploy a plan — that the CLI, the Dagster assets, the sensor and
the benches call, so each step has one implementation."""
