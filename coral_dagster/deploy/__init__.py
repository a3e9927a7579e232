"""Deployment: a plan becomes SkyPilot clusters (one per node), reconciled against the state kept in DuckDB."""
