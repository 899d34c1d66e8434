"""Each test process gets a var folder and a metrics folder of its own (a pytest plugin,
loaded with ``-p`` so that it runs before the settings are imported).

A deployment's processes share ``var/`` and ``PROMETHEUS_MULTIPROC_DIR`` on purpose: one host,
one reconciler lock, one usage journal folder, one metrics folder. The test runs are many
processes side by side (each pass's workers, both passes), and sharing them made tests of one
process see another's work: a test that counted a series before and after its own request saw
other processes' requests counted in between, and a test that ran a reconciler tick found the
host-wide tick lock (``var/reconciler.lock``) held by the other backend's pass running the same
module, and did nothing. The processes a test starts inherit this var folder unless they are
given their own (most are); the test process's metrics are kept apart from it, as
``tests.harness.store.process_env`` drops ``PROMETHEUS_MULTIPROC_DIR`` for them.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

# Every process makes its own: an xdist worker inherits the controller's environment.
_DIR = Path(tempfile.mkdtemp(prefix=f"llmgw-test-{os.getpid()}-"))
os.environ["LLMGW_VAR_DIR"] = str(_DIR / "var")
os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(_DIR / "metrics")
(_DIR / "metrics").mkdir()
atexit.register(shutil.rmtree, _DIR, ignore_errors=True)
