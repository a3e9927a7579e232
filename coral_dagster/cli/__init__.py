"""The `coral` command line."""
