"""torch.distributed's gloo allreduce, a baseline column of ``compare`` when torch is installed.

The ranks are forked by ``harness.py`` from a parent that has not imported torch (each child
imports it after the fork), set one intra-op thread each, and rendezvous through a ``file://``
store in a private temporary folder, which the parent removes afterwards; gloo's own sockets are
put on the loopback device (``GLOO_SOCKET_IFNAME=lo``), so nothing leaves the machine.

gloo reduces in place (``dist.all_reduce(tensor)``), so each call reduces the rank's input
buffer itself, through a zero-copy ``torch.from_numpy`` view: it does not pay the separate output
write that the other columns pay.  The first call is checked against the expected value; later
calls keep reducing the already-reduced values (floats may reach inf, integers wrap), which does
not change the time.
"""
import datetime
import importlib.util
import os
import shutil
import tempfile

from . import harness
from .measure import Buffers, measure, slowest, verify
from .units import count_for


HINT = "pip install torch"


def missing():
    """None when torch (with torch.distributed) can be imported, else the n/a reason."""
    return None if importlib.util.find_spec("torch") else "n/a (not installed)"


def _worker(peer, store, sizes, plan):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's sockets on the loopback device only
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=peer.rank,
                            world_size=peer.size, timeout=datetime.timedelta(seconds=120))
    op = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
          "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[plan.op]
    try:
        return [_one_size(peer, dist, torch, op, size, plan) for size in sizes]
    finally:
        dist.destroy_process_group()


def _one_size(peer, dist, torch, op, size, plan):
    bufs = Buffers(count_for(size, plan.dtype), plan.dtype, peer.rank, plan.fresh,
                   plan.rotation_bytes)
    tensors = [torch.from_numpy(x) for x in bufs.inputs]
    dist.all_reduce(tensors[0], op=op)
    verify(bufs.inputs[0], plan.op, peer.size, "gloo")

    def call(i):
        dist.all_reduce(tensors[i % len(tensors)], op=op)

    return measure(call, peer, plan.iters, plan.target_s)


def run_gloo(sizes, nprocs, plan, pin=None):
    """{size: summary} of torch.distributed.all_reduce on the gloo backend."""
    folder = tempfile.mkdtemp(prefix="shmtree-bench-gloo-")
    try:
        store = os.path.join(folder, "store")
        per_rank = harness.launch(_worker, nprocs, (store, sizes, plan), pin=pin)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {size: slowest([r[k] for r in per_rank]) for k, size in enumerate(sizes)}
