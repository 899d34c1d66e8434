"""Each test process writes its metrics to a folder of its own (a pytest plugin, loaded with
``-p`` so that it runs before the settings are imported).

The settings put ``PROMETHEUS_MULTIPROC_DIR`` in the environment, and a real deployment's
processes share it on purpose. The test runs are many processes side by side (each pass's
workers, both passes): sharing one folder, a test that counts a series before and after its
own request saw other processes' requests counted in between. The processes the tests start
do not inherit it either (``tests.harness.store.process_env``): theirs is under their own
``LLMGW_VAR_DIR``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Every process makes its own: an xdist worker inherits the controller's environment.
_DIR = tempfile.mkdtemp(prefix=f"llmgw-test-metrics-{os.getpid()}-")
os.environ["PROMETHEUS_MULTIPROC_DIR"] = _DIR
atexit.register(shutil.rmtree, _DIR, ignore_errors=True)
