"""Option types of the `coral` commands (click only, so the runtime's `coral serve` needs nothing more)."""

from __future__ import annotations

import math
from typing import Any

import click


class FiniteFloat(click.ParamType):
    """A float option that must be finite and within bounds: NaN, inf and out-of-range values are usage errors
    naming the option, the value and the range, never a traceback or a silent change of result."""

    name = "number"

    def __init__(self, low: float | None = None, high: float | None = None, *, low_open: bool = False) -> None:
        self.low, self.high, self.low_open = low, high, low_open

    def _range(self) -> str:
        low = "-inf" if self.low is None else f"{self.low:g}"
        high = "inf" if self.high is None else f"{self.high:g}"
        return f"{'(' if self.low_open or self.low is None else '['}{low}, {high}{')' if self.high is None else ']'}"

    def convert(self, value: Any, param, ctx) -> float:
        try:
            x = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number; give a finite number in {self._range()}.", param, ctx)
        if not math.isfinite(x):
            self.fail(f"{value!r} is not a finite number; give a finite number in {self._range()}.", param, ctx)
        below = self.low is not None and (x <= self.low if self.low_open else x < self.low)
        if below or (self.high is not None and x > self.high):
            self.fail(f"{value!r} is outside {self._range()}; give a number in that range.", param, ctx)
        return x


POSITIVE = FiniteFloat(0.0, low_open=True)
NON_NEGATIVE = FiniteFloat(0.0)


def _price_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """The price file --prices (else `$CORAL_PRICES`, read here and nowhere deeper) names, checked now; None: the
    bundled rows."""
    from coral_dagster.app.prices import checked_price_file
    from coral_dagster.errors import CoralError

    try:
        return checked_price_file(value) if value else None
    except CoralError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


#: --prices as an argument of the command (`prices_path`), passed on to what it plans and deploys with.
prices_path_option = click.option(
    "--prices", "prices_path", type=click.Path(dir_okay=False), default=None, envvar="CORAL_PRICES",
    callback=_price_file,
    help="Price CSV (region,node,instance_type,usd_per_hour[,spot_usd_per_hour]) to plan and deploy with instead "
         "of the bundled SkyPilot rows (default: $CORAL_PRICES, else $CORAL_DATA_DIR/prices).")
