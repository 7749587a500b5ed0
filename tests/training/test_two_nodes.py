"""Two node launchers on one host, presented as a two-node Slurm allocation (one task per node), train what one
launcher of all four ranks trains: the multi-node rendezvous, global ranks and groups, on every change.

Each launcher is `entrypoint train --nproc-per-node 2` with the variables Slurm gives a task of a 2-node step
(SLURM_NODEID 0 and 1, one master). TP=2 x DP=2, fp32 on gloo: the same ranks in the same groups compute the
same floats, so the losses are equal, not merely close.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_train_equivalence import GPT, clean_env, data_flags

from megatron_ds.runtime.rendezvous import hosted_store

pytestmark = pytest.mark.slow

ENTRYPOINT = os.path.join(os.path.dirname(sys.executable), "entrypoint")
ITERS = 4
LAYOUT = ["--tensor-model-parallel-size", "2", "--micro-batch-size", "1", "--global-batch-size", "4"]


def _argv(corpus, metrics) -> list[str]:
    return [ENTRYPOINT, "train", *GPT, *data_flags(corpus), *LAYOUT, "--train-iters", str(ITERS), "--lr", "1e-3",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--log-interval", "1",
            "--eval-iters", "0", "--metrics-file", str(metrics), "--nproc-per-node", "2"]


def _slurm_node(node: int, store_env: dict[str, str]) -> dict[str, str]:
    """What a task of `srun -N2 --ntasks-per-node=1` sees on node `node` (both nodes are this host). The test
    serves the rendezvous store, as torchrun's agent would: a port probed here and bound seconds later by rank 0
    could be taken in between on a busy CI host."""
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(node), "SLURM_NTASKS": "2",
            "SLURM_LOCALID": "0", "SLURM_NODEID": str(node), "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_NODELIST": "localhost,localhost",
            "MASTER_ADDR": "127.0.0.1", **store_env}


def _losses(metrics) -> list[float]:
    return [r["lm_loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "lm_loss" in r]


def test_two_node_launchers_train_the_losses_of_one_launcher_of_four_ranks(tmp_path, demo_corpus):
    one = tmp_path / "one_launcher"
    one.mkdir()
    single = subprocess.run([*_argv(demo_corpus, one / "metrics.jsonl")[:-1], "4"], cwd=one, env=clean_env(),
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-4000:]
    assert "TP 2 x PP 1 x DP 2" in single.stdout

    nodes = []
    with hosted_store() as store:
        for node in (0, 1):
            work = tmp_path / f"node{node}"
            work.mkdir()
            nodes.append(subprocess.Popen(_argv(demo_corpus, work / "metrics.jsonl"), cwd=work,
                                          env={**clean_env(), **_slurm_node(node, store.rank_env)},
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=300) for p in nodes]
    for node, (p, (out, err)) in enumerate(zip(nodes, outs)):
        assert p.returncode == 0, f"node {node}:\n{out[-2000:]}\n{err[-4000:]}"
        assert f"slurm: node {node}/2, spawning 2 local rank(s)" in err, err[-3000:]
        assert "world 4" in err
    assert "TP 2 x PP 1 x DP 2" in outs[0][0]  # rank 0 (node 0) logs
    assert not (tmp_path / "node1" / "metrics.jsonl").exists()  # only global rank 0 writes metrics
    got, want = _losses(tmp_path / "node0" / "metrics.jsonl"), _losses(one / "metrics.jsonl")
    assert len(got) == ITERS and got == want, (got, want)
