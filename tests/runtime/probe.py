"""A rank for the launcher tests: joins the gloo group from env://, all-reduces rank+1, reports.

usage: python probe.py OUT_DIR   (writes OUT_DIR/rank<RANK>.json)
"""

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

out_dir = Path(sys.argv[1])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
report = {
    "rank": dist.get_rank(), "world_size": dist.get_world_size(), "allreduce_sum": value.item(),
    "env_rank": int(os.environ["RANK"]), "local_rank": int(os.environ["LOCAL_RANK"]),
    "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]), "master_addr": os.environ["MASTER_ADDR"],
    "master_port": int(os.environ["MASTER_PORT"]), "profile": os.environ.get("MDS_PROFILE"),
    "affinity": sorted(os.sched_getaffinity(0)), "pid": os.getpid(),
}
dist.destroy_process_group()
(out_dir / f"rank{report['rank']}.json").write_text(json.dumps(report))
