"""What a search hands back: `Candidate` rows and the `SearchResult` table over them.

A row is one candidate: its knobs, its stage cut and directive program, and its figures,
either the simulator's (`Status.SIMULATED`: compiled, checked, simulated with the memory
model) or the closed-form estimate's (`Status.ESTIMATED`: explored, not compiled), or why
it was refused (`Status.REFUSED`: a compile error or check, or memory over the capacity).
Only simulated rows are ranked; `best` is the first of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from piper_nb.planner.candidate import GIB, Candidate, Status
from piper_nb.viz.units import bytes_text, time_text

__all__ = ["Status", "Candidate", "SearchResult", "COLUMNS", "html_table"]

# the table's columns (a row's dict has its status and reason besides)
COLUMNS = ("PP", "TP", "CP", "DP", "EP", "ZeRO", "schedule", "micro", "mb size", "recompute", "SP",
           "Float8", "step s", "tok/s/dev", "bubble", "peak GiB")
SORTS = {"step": lambda c: c.step, "tokens": lambda c: -c.tokens_per_s,
         "memory": lambda c: c.peak, "bubble": lambda c: c.bubble}


# how the text table shows a row's value (None: "-"), in the figures' units
_SHOW = {"step s": lambda x: time_text(x, "s"), "tok/s/dev": lambda x: f"{x:,.0f}",
         "bubble": lambda x: f"{100 * x:.0f}%", "peak GiB": lambda x: bytes_text(x * GIB)}
_HEAD = {"step s": "step", "peak GiB": "peak"}


def _cell(col: str, value) -> str:
    if value is None:
        return "-"
    return _SHOW[col](value) if col in _SHOW else str(value)


def html_table(rows: list[dict], columns=COLUMNS) -> str:
    """`rows` (as `Candidate.row` gives them) as an HTML table of `columns`, in the text
    table's units."""
    import html
    head = "".join(f"<th>{html.escape(_HEAD.get(c, c))}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(c, r[c]))}</td>"
                                    for c in columns) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


@dataclass
class SearchResult:
    """The ranked candidates (`ranked`: simulated, fastest first), the 50 fastest of the
    rest explored by estimate (`estimated`), and the refused with their reasons;
    `explored` counts every candidate bounded or estimated."""

    ranked: list[Candidate]
    estimated: list[Candidate]
    refused: list[Candidate]
    batch: int
    explored: int
    seconds: dict
    capacity: float
    interrupted: bool = False
    shortfall: str = ""

    @property
    def best(self) -> Candidate | None:
        """The fastest simulated candidate (or, interrupted before any, estimated)."""
        if self.ranked:
            return self.ranked[0]
        return self.estimated[0] if self.interrupted and self.estimated else None

    @property
    def fits(self) -> bool:
        """Whether some candidate fits: simulated, or (interrupted) estimated."""
        return bool(self.ranked) or (self.interrupted and bool(self.estimated))

    def rows(self, n: int | None = 10, sort: str = "step") -> list[dict]:
        """The top `n` ranked rows by `sort` (step, tokens, memory, bubble), as dicts."""
        if sort not in SORTS:
            from piper_nb.errors import PlanError
            raise PlanError(f"SearchResult: sort by one of {', '.join(SORTS)}, not {sort!r}")
        return [c.row(self.batch) for c in sorted(self.ranked, key=SORTS[sort])[:n]]

    def table(self, n: int | None = 10, sort: str = "step") -> str:
        """A text table of the top `n` ranked candidates, then a summary line."""
        rows = self.rows(n, sort)
        lines = [self.summary()]
        if rows:
            heads = [_HEAD.get(c, c) for c in COLUMNS]
            cells = [[_cell(c, r[c]) for c in COLUMNS] for r in rows]
            widths = [max(len(h), *(len(x[i]) for x in cells)) for i, h in enumerate(heads)]
            lines.append("  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True)))
            lines += ["  ".join(x.rjust(w) for x, w in zip(row, widths, strict=True))
                      for row in cells]
        return "\n".join(lines)

    def summary(self) -> str:
        secs = self.seconds.get("total", 0.0)
        text = (f"{self.explored} candidates explored in {secs:.1f} s: {len(self.ranked)} "
                f"simulated, {len(self.estimated)} estimated, {len(self.refused)} refused")
        if self.interrupted:
            text += " (interrupted: the best so far)"
        if not self.fits:
            text += f"\nnothing fits: {self.shortfall}"
        return text

    def __str__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        import html
        return f"<p>{html.escape(self.summary())}</p>" + html_table(self.rows(10))

    def figure(self, **kwargs):
        """Step time against peak memory of every candidate with a time (a plotly
        figure; `planner.frontier.figure` says what it draws)."""
        from piper_nb.planner.frontier import figure
        return figure(self, **kwargs)

    def reasons(self) -> dict[str, int]:
        """How many candidates each refusal reason (its first clause) turned away."""
        out: dict[str, int] = {}
        for c in self.refused:
            key = c.reason.split(":")[0]
            out[key] = out.get(key, 0) + 1
        return out

    def save_best(self, path) -> dict:
        """Write the best candidate's program (Piper JSON) to `path` and its stage cut next
        to it (`.annotations.json`); returns both paths."""
        from pathlib import Path
        best = self.best
        if best is None:
            from piper_nb.errors import PlanError
            raise PlanError(f"SearchResult.save_best: no candidate fits; {self.shortfall}")
        path = Path(path)
        path.write_text(best.program.to_json() + "\n")
        ann = path.with_suffix(".annotations.json")
        ann.write_text(json.dumps(best.annotation, indent=1) + "\n")
        return {"program": str(path), "annotations": str(ann)}
