"""Run a function on N real CPU ranks (gloo) and collect what each returns; for tests and checks.

``run_on_ranks(fn, world_size, *args, tp=2)`` spawns ``world_size`` fresh processes, each sets
the env:// variables, calls ``init_parallel(tp, pp, backend="gloo", sp=sp)`` and ``fn(*args)``; the
return values come back in rank order. ``fn`` must be importable (a module-level function).
If any rank fails, the others are killed and the first traceback is raised.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue as queue_module
import time
import traceback

from megatron_ds.runtime.rendezvous import hosted_store


def _rank_main(rank: int, world_size: int, store_env: dict, tp: int, pp: int, sp: int, fn, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", **store_env, RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch

    torch.set_num_threads(1)  # ranks share a couple of cores; oversubscription only slows them
    from megatron_ds.parallel import state

    try:
        state.init_parallel(tp, pp, backend="gloo", sp=sp)
        value = fn(*args)
        results.put((rank, True, pickle.dumps(value)))  # plain pickle: tensors travel by value
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the rank named
        results.put((rank, False, traceback.format_exc()))
    finally:
        # The queue sends from a feeder thread; flush it before the teardown, which can block while holding the
        # GIL (torch 2.1's gloo destroy_process_group: the result then never left and the parent timed out).
        results.close()
        results.join_thread()
        state.destroy()


def run_on_ranks(fn, world_size: int, *args, tp: int = 1, pp: int = 1, sp: int = 1, timeout: float = 180.0) -> list:
    with hosted_store() as store:
        return _run_ranks(fn, world_size, args, store.rank_env, tp, pp, sp, timeout)


def _run_ranks(fn, world_size: int, args: tuple, store_env: dict, tp: int, pp: int, sp: int, timeout: float) -> list:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, store_env, tp, pp, sp, fn, args, results),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    values: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            try:
                rank, ok, payload = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(values))} did not finish "
                                       f"within {timeout:.0f} s") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{payload}")
            values[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=10 if len(values) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [values[r] for r in range(world_size)]
