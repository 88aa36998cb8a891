"""The README's Python examples run as written (on the default CPU backend)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2        # the quick start and the engine loop
    ns: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), ns)
    step = ns["step"]
    assert step.steps == 9          # 8 eager steps and the captured one
    assert ns["graph"].stale is False
