"""A finished rank leaves with its exit code at once, output flushed, whatever its threads still hold."""

from __future__ import annotations

import subprocess
import sys
import time

SCRIPT = """
import threading, sys
from megatron_ds.runtime.bootstrap import leave_rank

threading.Thread(target=threading.Event().wait).start()  # a thread the interpreter's teardown would wait on
print("trained", flush=False)
sys.stderr.write("last words")
leave_rank(3)
"""


def test_leave_rank_exits_with_the_code_and_flushed_output():
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert result.returncode == 3, result.stderr
    assert result.stdout == "trained\n"
    assert result.stderr.endswith("last words")
    assert time.monotonic() - start < 30
