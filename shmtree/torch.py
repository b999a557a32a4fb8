"""A torch.distributed backend: `import shmtree.torch`, then
`torch.distributed.init_process_group("shmtree", ...)` in processes of one machine started by any
launcher (torchrun, torch.multiprocessing.spawn), and DistributedDataParallel runs on shmtree.

The group is formed through the launcher's store: rank 0 creates a shmtree.Group of the world's
size (not pinned: torch runs threads of its own) and publishes its rendezvous token; the others
attach with Group.from_token (only processes of the same user can) and every rank joins.  Each
operation posts shmtree's nonblocking call on numpy views of the tensors (the same memory: in
place, no copies for contiguous tensors) and returns a Work made from a torch Future that the
call's completion sets, so `work.wait()` and `work.get_future()` behave as gloo's.

Supported: all_reduce (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR), broadcast, reduce,
all_gather, all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor, barrier; CPU tensors
of the dtypes shmtree reduces (bool, ints, float16, bfloat16 (with ml_dtypes), float32/64,
complex64/128).  torch is optional: `pip install "shmtree[torch]"`.
"""
from __future__ import annotations

import datetime

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from .arrays import _to_torch, as_numpy
from .group import Group

BACKEND = "shmtree"
_TOKEN_KEY = "shmtree/group-token"
INLINE_BYTES = 256 << 10        # operations on at most this much run blocking (see _work)


def _op(reduce_op):
    """shmtree's op name for a torch ReduceOp (and whether to divide by the size: AVG)."""
    R = dist.ReduceOp
    for torch_op, name in ((R.SUM, "sum"), (R.AVG, "avg"), (R.PRODUCT, "prod"), (R.MIN, "min"),
                           (R.MAX, "max"), (R.BAND, "band"), (R.BOR, "bor"), (R.BXOR, "bxor")):
        if reduce_op == torch_op:
            return name
    raise ValueError(f"shmtree: the torch backend does not support {reduce_op}")


def _view(t):
    """A numpy view of a CPU tensor's memory (a tensor that requires grad: of its detach();
    bfloat16 as ml_dtypes.bfloat16)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"shmtree: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"shmtree: the shmtree backend takes CPU tensors, got one on {t.device}")
    if t.dtype == torch.bfloat16:
        return as_numpy(t, "the shmtree backend")
    return t.detach().numpy()


class ProcessGroupShmtree(dist.ProcessGroup):
    """The process group of backend "shmtree" (see the module's docstring)."""

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        self._timeout = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) \
            else None
        if rank == 0:
            self._group = Group(size, pin=False)
            store.set(_TOKEN_KEY, self._group.rendezvous_token())
        else:
            self._group = Group.from_token(store.get(_TOKEN_KEY))
        self._comm = self._group.join(rank)
        self._failure = None              # a posted operation's failure, for the next one
        # rank 0's descriptor must stay open until everyone has attached: meet once
        self._comm.barrier(timeout=self._timeout)

    def getBackendName(self):
        return BACKEND

    def __repr__(self):
        return f"<ProcessGroupShmtree rank={self._comm.rank} size={self._comm.size}>"

    # ---- work objects ----

    def _work(self, calls, nbytes, finish):
        """Make the calls - call(blocking) makes one: the blocking collective, or its i-form
        (a Request) - and return a Work whose future finish() sets (its value) once they are
        done.  Messages of at most INLINE_BYTES run blocking, at once (a hand-off to the
        progress thread costs more than they do); larger ones are posted, so that the caller
        (DDP's backward pass) computes meanwhile.  Calls complete in issue order either way.
        Failures are raised (as RuntimeError, which torch's C++ carries) by this call: one of
        the blocking calls, or of a posted call that failed since the last operation."""
        fut = Future()
        failed, self._failure = self._failure, None
        if failed is not None:
            raise RuntimeError(f"shmtree: an earlier operation of this process group failed: "
                               f"{type(failed).__name__}: {failed}")
        if self._group.aborted():
            raise RuntimeError(f"shmtree: rank {self._comm.rank}: "
                               f"{self._group.describe_abort()}")
        if nbytes <= INLINE_BYTES:
            try:
                for call in calls:
                    call(True)
                fut.set_result(finish())
            except Exception as exc:              # (torch's C++ takes RuntimeErrors)
                raise RuntimeError(f"{type(exc).__name__}: {exc}") from None
            return _create_work_from_future(fut)
        # Everything the posted path needs is made before the first call is posted: from then
        # on the progress thread wants the GIL, and each step left here would make it (and the
        # peers waiting for this rank's part) wait behind this thread.
        work = _create_work_from_future(fut)
        requests = []

        def done(_):
            failed = next((r.exception() for r in requests if r.exception() is not None), None)
            if failed is not None:
                # torch cannot take a Python exception in a future that DDP's reducer waits
                # on (the process crashes in the autograd engine): the future completes, and
                # the group's next operation raises the failure, in the caller's thread
                self._failure = failed
                fut.set_result(finish())
                return
            try:
                value = finish()
            except BaseException as exc:          # (a failure of the finishing step itself)
                fut.set_exception(exc)
                return
            fut.set_result(value)

        try:
            for call in calls:
                requests.append(call(False))
        except Exception as exc:                  # (torch's C++ takes RuntimeErrors)
            raise RuntimeError(f"{type(exc).__name__}: {exc}") from None
        requests[-1].add_done_callback(done)
        return work

    def _divide(self, tensors, op, mine=True):
        """AVG: the sum, divided by the size (where the result is)."""
        if op == "avg" and mine:
            for t in tensors:
                t.detach().div_(self._comm.size)
        return tensors

    # ---- collectives ----

    def allreduce(self, tensors, opts):
        op = _op(opts.reduceOp)
        comm, timeout = self._comm, self._timeout
        arrays = [_view(t) for t in tensors]
        calls = [_call(comm.allreduce, comm.iallreduce, a,
                                   "sum" if op == "avg" else op, out=a, timeout=timeout)
                 for a in arrays]
        return self._work(calls, sum(a.nbytes for a in arrays),
                          lambda: self._divide(tensors, op))

    def broadcast(self, tensors, opts):
        comm, root = self._comm, opts.rootRank
        arrays = [_view(t) for t in tensors]
        calls = [_call(comm.broadcast, comm.ibroadcast, a, root, out=a,
                                   timeout=self._timeout) for a in arrays]
        return self._work(calls, sum(a.nbytes for a in arrays), lambda: tensors)

    def reduce(self, tensors, opts):
        op, root, comm = _op(opts.reduceOp), opts.rootRank, self._comm
        arrays = [_view(t) for t in tensors]
        calls = [_call(comm.reduce, comm.ireduce, a,
                                   "sum" if op == "avg" else op, root,
                                   out=a if comm.rank == root else None,
                                   timeout=self._timeout) for a in arrays]
        return self._work(calls, sum(a.nbytes for a in arrays),
                          lambda: self._divide(tensors, op, comm.rank == root))

    def allgather(self, output_tensors, input_tensors, opts):
        comm, size = self._comm, self._comm.size
        pairs = [(_view(t), outs) for t, outs in zip(input_tensors, output_tensors)]
        gathered = [np.empty((size,) + a.shape, a.dtype) for a, _ in pairs]
        calls = [_call(comm.allgather, comm.iallgather, a, out=g,
                                   timeout=self._timeout) for (a, _), g in zip(pairs, gathered)]

        def finish():
            for (_, outs), g in zip(pairs, gathered):
                for r, o in enumerate(outs):
                    o.detach().copy_(_to_torch(g[r]))
            return output_tensors
        return self._work(calls, sum(g.nbytes for g in gathered), finish)

    def _allgather_base(self, output, input, opts):
        comm = self._comm
        out = _view(output).reshape((comm.size,) + tuple(input.shape))
        calls = [_call(comm.allgather, comm.iallgather, _view(input), out=out,
                                   timeout=self._timeout)]
        return self._work(calls, out.nbytes, lambda: [output])

    def reduce_scatter(self, output_tensors, input_lists, opts):
        op, comm = _op(opts.reduceOp), self._comm
        wholes = [np.concatenate([_view(p).reshape(-1) for p in parts]) for parts in input_lists]
        calls = [_call(comm.reduce_scatter, comm.ireduce_scatter, w,
                                   "sum" if op == "avg" else op, out=_view(out).reshape(-1),
                                   timeout=self._timeout)
                 for w, out in zip(wholes, output_tensors)]
        return self._work(calls, sum(w.nbytes for w in wholes),
                          lambda: self._divide(output_tensors, op))

    def _reduce_scatter_base(self, output, input, opts):
        op, comm = _op(opts.reduceOp), self._comm
        block = (input.shape[0] // comm.size,) + tuple(input.shape[1:])
        a = _view(input)
        calls = [_call(comm.reduce_scatter, comm.ireduce_scatter, a,
                                   "sum" if op == "avg" else op,
                                   out=_view(output).reshape(block), timeout=self._timeout)]
        return self._work(calls, a.nbytes, lambda: self._divide([output], op))

    all_gather_single = _allgather_base          # (the names torch >= 2.10 calls)
    reduce_scatter_single = _reduce_scatter_base

    def barrier(self, opts=None):
        comm = self._comm
        return self._work([_call(comm.barrier, comm.ibarrier,
                                             timeout=self._timeout)], 0, lambda: [])

    def shutdown(self):
        self._comm.close()
        self._group.close()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass


def _call(blocking, nonblocking, *args, **kwargs):
    """A call, as _work makes it: call(True) the blocking form, call(False) the i-form."""
    def call(now):
        return (blocking if now else nonblocking)(*args, **kwargs)
    return call


def _create(store, rank, size, timeout):
    return ProcessGroupShmtree(store, rank, size, timeout)


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
