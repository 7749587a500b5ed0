"""FP8 (torchao, tensorwise) under the parallel layouts, through the real training loop on the CPU (two gloo ranks
of fp8_train_driver.py: `entrypoint train`'s rank path; only the "FP8 needs a GPU" rule is skipped).

Tensorwise dynamic scaling takes each scale from the current tensor of the current micro-batch, so data
parallelism (each rank one of the micro-batches that one rank accumulates), ZeRO-1/2/3 and the pipeline run the
same FP8 casts as one rank: they must follow its FP8 curve as the bf16 layouts follow the bf16 one. Tensor
parallelism scales each rank's weight slice and activations by their own amax (not bitwise the same casts),
and stays within the same bound here.
"""

from __future__ import annotations

import pytest
from test_fp8_checkpoints import losses, run_driver

pytestmark = pytest.mark.slow

LAYOUTS = {
    "dp2-zero1": ["--zero-stage", "1"],
    "dp2-zero2": ["--zero-stage", "2"],
    "dp2-zero3": ["--zero-stage", "3"],
    "pp2": ["--pipeline-model-parallel-size", "2", "--zero-stage", "1"],
    "tp2": ["--tensor-model-parallel-size", "2", "--zero-stage", "1"],
}
# bf16 on the CPU, reductions in another order: observed <= 1.2e-3 on every iteration and ~4e-4 on average for
# every layout (the GPU layouts' bounds are 1e-2 and 2.5e-3); the curve falls by 7% over the 10 iterations. Those
# figures are for the samples of --data-order mds, which these runs keep: Megatron's order (the default) starts on
# other documents, where 10 iterations fall by only 2.5%, too little to show that every layout trains.
REL, MEAN_REL = 3e-3, 1e-3
DATA_ORDER = ["--data-order", "mds"]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, demo_corpus):
    cwd = tmp_path_factory.mktemp("fp8-one-rank")
    run_driver(cwd, demo_corpus, *DATA_ORDER)
    return losses(cwd)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fp8_layout_follows_the_one_rank_fp8_curve(layout, one_rank, demo_corpus, tmp_path):
    out = run_driver(tmp_path, demo_corpus, *LAYOUTS[layout], *DATA_ORDER, nproc=2)
    assert "FP8 torchao" in out, out[-3000:]
    got = losses(tmp_path)
    assert sorted(got) == sorted(one_rank) == list(range(1, 11))
    rel = {i: abs(got[i] - one_rank[i]) / abs(one_rank[i]) for i in got}
    print(f"\n{layout}: max relative loss difference {max(rel.values()):.2e}", {i: f"{r:.1e}" for i, r in rel.items()})
    assert max(rel.values()) <= REL and sum(rel.values()) / len(rel) <= MEAN_REL, (rel, got, one_rank)
    assert one_rank[10] < 0.95 * one_rank[1]  # falls by 7%: a layout that does not train cannot hide in the bound
