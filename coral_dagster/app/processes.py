"""How a command's process ends: SIGTERM as a clean exit, so its worker processes end with it."""

from coral_dagster.lifetimes import stop_on_sigterm as stop_on_sigterm
