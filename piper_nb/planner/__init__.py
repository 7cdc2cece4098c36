"""Strategy search: `pn.search(model, batch, devices=..., hardware=...)` explores the plans
of a model on a cluster and returns them ranked by predicted step time, each checked and
runnable (`engine`). One concept a module: the knobs and their space (`knobs`), one
compile per TP class (`probe`), the closed-form estimate (`estimate`) over a stage-level
timing of the schedule's grid (`pipeline`), candidates as annotations and programs
(`build`), a candidate's row (`candidate`), the ranked table over them (`result`), and
their picture, step time against memory (`frontier`).
"""

from piper_nb.planner.engine import search
from piper_nb.planner.knobs import KNOBS, Knobs, Schedule
from piper_nb.planner.result import Candidate, SearchResult, Status

__all__ = ["search", "Knobs", "KNOBS", "Schedule", "Candidate", "SearchResult", "Status"]
