"""A rank for the watchdog tests: a few reported all_reduce steps, then `HANG_RANK` stops making progress.

Run as a rank (`entrypoint launch -- python hang_probe.py OUT HOW`). HOW:
  sleep   - the hanging rank sleeps; the others wait for it inside an all_reduce
  exit3   - rank 1 exits with code 3 at iteration 5 every time (a deterministic failure, for restart loops);
            the others wait outside any collective
Progress goes to the node supervisor ($MDS_WATCHDOG_DIR) or to this rank's own watchdog thread.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_ds.runtime.progress import Progress
from megatron_ds.runtime.watchdog import Timeouts

out, how = Path(sys.argv[1]), sys.argv[2]
rank = int(os.environ["RANK"])
# PROBE_STAGGER: rank r gets (r + 1) x 3 s, so rank 0 (waiting in the collective) fires first, deterministically
step_timeout = 3.0 * (rank + 1 if os.environ.get("PROBE_STAGGER") else 1)
progress = Progress.start(rank, Timeouts(step=step_timeout, slow_phase=60))
dist.init_process_group("gloo")
value = torch.ones(1)
for iteration in range(1, 9):
    dist.all_reduce(value)
    time.sleep(0.05)
    progress.step(iteration)
    if how == "exit3" and iteration == 5:
        if rank == 1:
            sys.exit(3)
        time.sleep(600)  # out of any collective, so rank 1's exit is the only failure
(out / f"hang_start_{rank}").write_text(str(time.time()))
if rank == int(os.environ.get("HANG_RANK", "1")):
    time.sleep(600)
dist.all_reduce(value)  # never completes: the hanging rank does not join
print("unreachable", flush=True)
