"""The README's fifteen-line example runs as written (in a fresh interpreter)."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_readme_example_runs_and_matches_the_reference(tmp_path):
    text = (ROOT / "README.md").read_text()
    code = re.search(r"## Fifteen lines\s+```python\n(.*?)```", text, re.S).group(1)
    assert len(code.strip().splitlines()) <= 16
    check = "\nimport torch\nassert torch.allclose(torch.tensor(result.losses), torch.tensor(ref.losses), " \
            "rtol=1e-5, atol=4e-5)\n"
    # workers are spawned, which re-imports the main module: guard it as a script must
    script = "if __name__ == '__main__':\n" + textwrap.indent(code + check, "    ")
    path = tmp_path / "readme_example.py"
    path.write_text(script)
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "dev0" in proc.stdout and "dev1" in proc.stdout
