"""Dagster assets: thin wrappers that read inputs, call one domain function and record data and metadata."""
