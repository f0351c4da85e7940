"""The documentation site builds under ``mkdocs build --strict``, as CI builds it.

CI runs the same build before the suite; this test makes a broken link (a relative link to a folder, a page
missing from the nav's files) fail the README's test command too, where it is seen before a push.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    warnings = [line for line in done.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert done.returncode == 0, "\n".join(warnings) or done.stderr[-2000:]
