"""The memory-copy limit: what P processes copying the same bytes at once can do.

Every rank runs ``np.copyto(dst, src)`` of the message size, all ranks at the same time (they
meet at a barrier before the timed calls), with the measurement protocol of ``measure.py``.  An
allreduce must at least read its input and write its output, so this time is the floor that
the "vs copy" column of every table compares against.

``copy_measurement`` runs inside any rank that has a ``sync`` (shmtree's workers use it, so the
copy is measured in the same pinned processes as the allreduce); ``run_copy`` runs it in the
bench's own forked processes when shmtree is not part of the run.
"""
import numpy as np

from . import harness
from .measure import Buffers, measure, slowest
from .units import count_for


def copy_measurement(sync, rank, size, plan, buffers=None):
    """This rank's summary for copying `size` bytes, all ranks at once."""
    bufs = buffers or Buffers(count_for(size, plan.dtype), plan.dtype, rank, plan.fresh,
                              plan.rotation_bytes)

    def call(i):
        src, dst = bufs.pair(i)
        np.copyto(dst, src)

    return measure(call, sync, plan.iters, plan.target_s)


def _worker(peer, sizes, plan):
    return [copy_measurement(peer, peer.rank, size, plan) for size in sizes]


def run_copy(sizes, nprocs, plan, pin=None):
    """{size: combined summary} for the concurrent copy, in the bench's own processes."""
    per_rank = harness.launch(_worker, nprocs, (sizes, plan), pin=pin)
    return {size: slowest([r[k] for r in per_rank]) for k, size in enumerate(sizes)}
