"""A torch.distributed backend: `import shmtree.torch`, then
`torch.distributed.init_process_group("shmtree", ...)` in processes of one machine started by any
launcher (torchrun, torch.multiprocessing.spawn), and DistributedDataParallel and FSDP
(fully_shard) run on shmtree.

The group is formed through the launcher's store: rank 0 creates a shmtree.Group of the world's
size (not pinned: torch runs threads of its own) and publishes its rendezvous token; the others
attach with Group.from_token (only processes of the same user can) and every rank joins.  Each
operation builds shmtree's calls on numpy views of the tensors (CallSpecs, calls.py; the same
memory: in place, no copies for contiguous tensors), runs or posts them (the communicator's
_run / _post, the path of its public methods) and returns a Work whose future the call's
completion sets, so `work.wait()` and `work.get_future()` behave as gloo's: a failed
operation raises from `wait()` and fails its future (never a success with unreduced data).
Small send / recv skip the threads: a send that fits in the ring is written at once, a recv is
held back until waited for (then received in the waiting thread) or until anything else needs
it posted (ProcessGroupShmtree.send / recv).

Every method is callable as torch documents ProcessGroup's: `opts` optional, the convenience
forms (`pg.allreduce(t)`, `pg.broadcast(t, root=0)`, `pg.allgather(outs, t)`,
`pg.reduce(t, root=0, op=...)`, `pg.reduce_scatter(out, parts)`, `pg.barrier(timeout)`), lists
of several tensors as gloo treats them (allreduce reduces all of them together, broadcast sends
the root's `rootTensor` to every tensor, allgather of n inputs fills n lists of n*size), gloo's
argument checks (RuntimeErrors with gloo's words, raised by the call), uneven reduce_scatter,
future values shaped as gloo's; sparse COO allreduce (indices and values gathered, then
coalesced, as gloo does); the coalesced forms; monitored_barrier.  Argument errors raise from
the call; a failure of the collective itself (a mismatch, a dead peer, a timeout) from
`wait()`.  Futures complete outside shmtree's progress thread, so their `then()` callbacks may
issue collectives (DDP comm hooks such as PowerSGD).

Outputs of any layout are written (a non-contiguous one through a temporary); ReduceOp.AVG of
integer tensors is refused before anything is touched, as gloo's RuntimeError; what the backend
does not offer (ReduceOp.PREMUL_SUM, coalescing by device) raises NotImplementedError naming
shmtree and the operation.  A local error that leaves the other ranks waiting in the operation
is made theirs too: all_to_all_single's bad split sizes are said in the call's round (every
rank raises, a ValueError), all_gather's outputs that do not fit the input are checked against
what every rank passed (gathered all the same: the error names every rank's shape and dtype).

Supported: all_reduce (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR), broadcast, reduce,
all_gather, all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor, gather, scatter,
all_to_all, all_to_all_single (split sizes: shmtree's alltoall(counts=)), send, recv, isend,
irecv, recv from any source (recv / irecv with src=None: recv_anysource, its Work's
_source_rank() the sender's rank), batch_isend_irecv (shmtree's messages, with tags), barrier,
the coalesced forms,
monitored_barrier; subgroups (new_group, DeviceMesh: a shmtree group each, made through the
subgroup's store as the world's is - torch calls the creator on the members only); CPU tensors
of the dtypes shmtree reduces (bool, ints, float16, bfloat16 (with ml_dtypes), float32/64,
complex64/128).  torch is optional:
`pip install "shmtree[torch]"`.

The package (issue 36; one module, shmtree/torch.py, before)::

    backend     ProcessGroupShmtree: the work objects, all_reduce, broadcast, reduce, barrier;
                the backend's registration with torch.distributed
    gathers     all_gather, reduce_scatter, gather, scatter, all_to_all  } mixins of
    coalesced   the coalesced forms                                       } ProcessGroupShmtree
    p2p         send, recv, recv from any source                          }
    reproducible  the reduction mode (set_reduction, SHMTREE_TORCH_REDUCTION) }
    works       the Work objects and the calls they run
    tensors     gloo's checks of the tensor lists, numpy views, packing, the local reduction
    options     the backend's constants, ReduceOps, options objects, timeouts, their errors

It may import every layer of shmtree below it (it uses the front end's calls, groups, p2p) and
nothing imports it: shmtree's own __init__ never imports torch.
"""
from __future__ import annotations

# the names shmtree.torch had as one module (shmtree/torch.py, before issue 36) stay: the
# backend's own, and those it imported
import atexit  # noqa: F401
import concurrent.futures  # noqa: F401
import datetime  # noqa: F401
import queue  # noqa: F401
import threading  # noqa: F401
import warnings  # noqa: F401
import weakref  # noqa: F401

import numpy as np  # noqa: F401
import torch  # noqa: F401
import torch.distributed as dist  # noqa: F401
from torch.futures import Future  # noqa: F401

from ..frontend import calls  # noqa: F401
from ..arrays import as_numpy  # noqa: F401
from ..codes import KIND_ALLTOALL  # noqa: F401
from ..errors import CollectiveMismatchError  # noqa: F401
from ..groups.group import Group  # noqa: F401
from ..p2p.records import ANY_SOURCE, QUICK_BYTES, Status  # noqa: F401
from .backend import ProcessGroupShmtree  # (registers the backend "shmtree")
from .options import BACKEND, INLINE_BYTES, QUICK_P2P_BYTES, SUPPORTED, ArgumentError
from .reproducible import REDUCTION_ENV, REDUCTIONS, communicator, reduction, set_reduction
from .survive import failed_ranks, shrink_group        # after a failure (issue 38)

__all__ = ["BACKEND", "SUPPORTED", "ProcessGroupShmtree", "ArgumentError", "QUICK_P2P_BYTES",
           "INLINE_BYTES", "REDUCTION_ENV", "REDUCTIONS", "set_reduction", "reduction",
           "communicator", "failed_ranks", "shrink_group"]
