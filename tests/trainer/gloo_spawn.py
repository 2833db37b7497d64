"""Runs a test function on `world` Gloo ranks in spawned processes: the Python oracles' one way to start PyTorch ranks.

The ranks meet through a file store in a fresh temporary directory, not a TCP port picked beforehand (another test may
take such a port between the pick and the bind). Under load, PyTorch ranks aborted after their work was done
("terminate called without an active exception": the Gloo process group's teardown at W=2 and 4, seen in CI and in a
rehearsal), so once every rank has finished (a barrier) each flushes its output and leaves with os._exit(0), skipping
that teardown. A rank that still dies of a signal is retried once, with a line on stderr saying so. A rank that raises,
as a failed assertion of the test does, fails at once and is never retried.
"""
import os
import sys
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank, world, store, fn, args):
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    fn(rank, world, *args)
    dist.barrier()  # every rank has done its part
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # not the process group's teardown (see above)


def spawn_gloo(fn, world, *args):
    """fn(rank, world, *args) on ranks 0..world-1 of a fresh default Gloo process group; raises what a rank raised."""
    for attempt in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                mp.spawn(_rank, args=(world, os.path.join(tmp, "store"), fn, args), nprocs=world)
                return
            except mp.ProcessExitedException as e:
                if e.signal_name is None or attempt == 2:
                    raise
                print(f"PyTorch rank {e.error_index} of {world} died of {e.signal_name} in {fn.__name__}; "
                      "retrying once", file=sys.stderr)
