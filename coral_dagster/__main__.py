"""`python -m coral_dagster`: the `coral` command."""

from coral_dagster.cli.main import main

if __name__ == "__main__":
    main()
