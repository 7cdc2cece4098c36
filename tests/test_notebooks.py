"""The tutorial notebooks 01-05 run top to bottom and reproduce their stored outputs.

Runs `pytest --nbval-lax` on them in a subprocess with this interpreter (the venv's), so
`make test` validates the notebooks too: every cell must execute without error, and the
cells marked `# NBVAL_CHECK_OUTPUT` (grids, bubbles, memory figures, "losses equal to the
reference: True") must print exactly what is stored. Plots and timings are not compared.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("0[1-5]*.ipynb"))


@pytest.mark.notebooks
@pytest.mark.timeout(900)
def test_notebooks_run_and_match_their_stored_outputs():
    pytest.importorskip("nbval")
    assert [p.name[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05"], NOTEBOOKS
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
           "--nbval-current-env", "--nbval-cell-timeout=300",
           *(str(p.relative_to(ROOT)) for p in NOTEBOOKS)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-20000:]}\n{proc.stderr[-5000:]}"
