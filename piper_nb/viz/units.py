"""Units every figure shares, so an axis, its hover and its title say the same thing.

Bytes are drawn in the binary unit their magnitude calls for (GiB from 1 GiB, MiB from
1 MiB, then KiB and B), chosen once per figure from its largest value so an axis and its
hover agree. Times in seconds are drawn in s, ms or µs by the step's length; a cost model's
abstract unit reads "unit" / "units".
"""

from __future__ import annotations

__all__ = ["bytes_scale", "bytes_text", "time_scale", "time_text"]

_BYTES = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def _digits(value: float, digits: int) -> str:
    """`value` to `digits` significant digits, whole numbers beyond them ("1010", never
    "1.01e+03")."""
    text = f"{value:.{digits}g}"
    return f"{value:.0f}" if "e+" in text else text


def bytes_scale(largest: float) -> tuple[float, str]:
    """(divisor, unit name) for drawing byte counts whose largest is `largest`."""
    return next(((div, name) for div, name in _BYTES if largest >= div), (1, "B"))


def bytes_text(n: float) -> str:
    """`n` bytes as a short string in its own unit: "17.9 GiB", "512 B"."""
    div, name = bytes_scale(n)
    return f"{_digits(n / div, 3)} {name}" if div > 1 else f"{n:.0f} B"


def time_scale(span: float, unit: str) -> tuple[float, str]:
    """(factor, unit name) for drawing times whose extent is `span` (in `unit`): seconds
    become ms or us below a second or a millisecond; other units are kept ("units")."""
    if unit != "s":
        return 1.0, "units" if unit == "unit" else unit
    if span >= 1 or span <= 0:
        return 1.0, "s"
    return (1e3, "ms") if span >= 1e-3 else (1e6, "µs")


def time_text(value: float, unit: str) -> str:
    """A time as English: "20.3 s", "12.5 ms", "1 unit", "15 units"."""
    if unit == "unit":
        return f"{_digits(value, 4)} unit" + ("" if value == 1 else "s")
    factor, name = time_scale(value, unit)
    return (f"{_digits(value * factor, 3)} {name}" if unit == "s"
            else f"{_digits(value, 4)} {name}")
