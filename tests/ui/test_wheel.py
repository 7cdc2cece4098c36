"""The wheel ships the front-end assets of the custom views (widgets/ -> piper_nb/widgets)."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_wheel_contains_the_widget_assets(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                           str(tmp_path), str(ROOT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("piper_nb-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"piper_nb/widgets/dag_view.js", "piper_nb/widgets/dag_view.css"} <= names
