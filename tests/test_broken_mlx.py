"""An ``mlx`` that is installed but cannot load (Linux ``pip install '.[metal]'`` without
``libmlx.so``): the MLX test modules skip with the reason, and the registry reports both
MLX backends unavailable with it. Simulated in a subprocess by an import hook."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HOOK = '''
import importlib.abc
import sys


class Broken(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "mlx.core":
            raise {exc}("libmlx.so: cannot open shared object file: No such file or directory")
        return None


sys.meta_path.insert(0, Broken())
'''


@pytest.mark.parametrize("exc", ["ImportError", "OSError"])
def test_unloadable_mlx_skips_and_is_reported(tmp_path, exc):
    (tmp_path / "broken_mlx.py").write_text(HOOK.format(exc=exc))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "broken_mlx", "-p", "no:cacheprovider",
         "tests/test_mlx.py", "tests/test_mlx_kernels.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    # both modules skip at import, so pytest collects no test (no collection error)
    assert run.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, run.stdout + run.stderr
    assert " error" not in run.stdout and "2 skipped" in run.stdout, run.stdout
    assert f"mlx.core cannot be imported ({exc}: libmlx.so" in run.stdout, run.stdout
    probe = ("import broken_mlx\nfrom paged_decode.backends import availability\n"
             "for n in ('mlx', 'metal'):\n    s = availability(n)\n"
             "    print(n, s.ok, s.reason)\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in ("mlx", "metal"):
        assert (f"{name} False MLX is installed but cannot be imported ({exc}: libmlx.so"
                in out.stdout), out.stdout
