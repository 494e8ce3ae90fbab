"""Test helper: run a function on W gloo ranks (processes on localhost) and collect results.

    results = gloo_ranks.run(fn, world=2, args=(...,), timeout_s=120)   # [rank 0's, ...]

Each rank is a spawned /usr/bin/python3 process with one torch thread, in a gloo process
group rendezvousing through a file in a fresh temporary directory (no port to pick). `fn` is
called as fn(rank, world, *args) and must be a top-level function of an importable module
(the test file itself works: spawn re-imports it as __mp_main__). Its return value is
saved with torch.save and loaded here. A rank that raises makes run() raise with that
rank's traceback; a rank that is still running after timeout_s is killed, and run() raises.
Ranks end with os._exit after a final barrier, skipping the gloo teardown (which has been
seen to hang after a peer had finished).
"""

import datetime
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank, world, workdir, fn, args, timeout_s):
    code = 1
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        result = fn(rank, world, *args)
        torch.save(result, f"{workdir}/result.{rank}.tmp")
        os.replace(f"{workdir}/result.{rank}.tmp", f"{workdir}/result.{rank}")
        dist.barrier()
        code = 0
    except BaseException:  # noqa: B902  (reported to the parent, whatever it is)
        with open(f"{workdir}/error.{rank}", "w") as f:
            f.write(traceback.format_exc())
    finally:
        os._exit(code)


def run(fn, world, args=(), timeout_s=120):
    """fn(rank, world, *args) on `world` gloo ranks; returns the per-rank results in order."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="gloo_ranks.", dir=os.environ.get("TEST_TMPDIR")) as d:
        procs = [ctx.Process(target=_rank_main, args=(r, world, d, fn, args, timeout_s))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(1.0)  # let the others report too, then stop them
                break
            time.sleep(0.05)
        timed_out = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        errors = []
        for r in range(world):
            path = f"{d}/error.{r}"
            if os.path.exists(path):
                with open(path) as f:
                    errors.append(f"rank {r}:\n{f.read()}")
        if errors or timed_out or any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"gloo ranks failed (world {world}, exit codes "
                               f"{[p.exitcode for p in procs]}, still running after "
                               f"{timeout_s} s: {timed_out})\n" + "\n".join(errors))
        return [torch.load(f"{d}/result.{r}") for r in range(world)]
