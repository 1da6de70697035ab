"""The ops on 8 virtual CPU devices: each file of tests/multidevice in a subprocess.

Multi-device tests need ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before jax initialises;
this process (one pytest worker of the suite) may already run jax on one device, so each test here runs
one file of tests/multidevice (``md_*.py``, not collected by the suite itself) in a fresh
``python -m pytest`` with that flag, and fails with its report. Run them by hand:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python -m pytest -q -o python_files='md_*.py' tests/multidevice
"""

import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent
FILES = sorted(p.name for p in (HERE / "multidevice").glob("md_*.py"))


@pytest.mark.parametrize("name", FILES)
def test_multidevice(name, request):
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    markers = request.config.getoption("-m") or "not gpu and not slow"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "python_files=md_*.py",
           "-o", "addopts=", "-m", markers, str(HERE / "multidevice" / name)]
    result = subprocess.run(cmd, cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=900)
    # pytest exits 5 when every test of the file is deselected (e.g. -m slow and none is slow).
    assert result.returncode in (0, 5), f"{' '.join(cmd)}\n{result.stdout[-20000:]}\n{result.stderr[-5000:]}"
