"""The Designer's *group replicas* box: identical data-parallel replicas share one timeline
row, and unticking it draws every device."""

from __future__ import annotations

import piper_nb as pn
from piper_nb.ui import Designer
from piper_nb.ui.views import TABS


def test_the_group_replicas_box_expands_the_timeline(gpt):
    program = [*pn.schedules.one_f_one_b(ranks=2, microbatches=4),
               pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
               pn.replicate({"PP": 0}, [0, 2]), pn.replicate({"PP": 1}, [1, 3])]
    d = Designer(*gpt, program=program, debounce=None)
    try:
        d.views.tabs.selected_index = TABS.index("Timeline")
        rows = list(d.views.timeline.layout.yaxis.categoryarray)
        assert rows[-1] == "devices 0,2 (x2) compute" and not d.problems
        d.views.group.value = False
        rows = list(d.views.timeline.layout.yaxis.categoryarray)
        assert rows[-1] == "dev0 compute" and any(r.startswith("dev3 ") for r in rows)
        assert not d.views.timeline.layout.updatemenus
    finally:
        d.close()
