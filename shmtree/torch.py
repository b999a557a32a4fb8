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
of the dtypes shmtree reduces (bool, ints, float16/32/64, complex64/128).  bfloat16 is refused
(it has no numpy view yet).  torch is optional: `pip install "shmtree[torch]"`.
"""
from __future__ import annotations

import datetime

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from .group import Group

BACKEND = "shmtree"
_TOKEN_KEY = "shmtree/group-token"


def _op(reduce_op):
    """shmtree's op name for a torch ReduceOp (and whether to divide by the size: AVG)."""
    R = dist.ReduceOp
    for torch_op, name in ((R.SUM, "sum"), (R.AVG, "avg"), (R.PRODUCT, "prod"), (R.MIN, "min"),
                           (R.MAX, "max"), (R.BAND, "band"), (R.BOR, "bor"), (R.BXOR, "bxor")):
        if reduce_op == torch_op:
            return name
    raise ValueError(f"shmtree: the torch backend does not support {reduce_op}")


def _view(t):
    """A numpy view of a CPU tensor's memory (a tensor that requires grad: of its detach())."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"shmtree: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"shmtree: the shmtree backend takes CPU tensors, got one on {t.device}")
    if t.dtype == torch.bfloat16:
        raise TypeError("shmtree: bfloat16 tensors are not supported by the shmtree backend yet")
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
        # rank 0's descriptor must stay open until everyone has attached: meet once
        self._comm.barrier(timeout=self._timeout)

    def getBackendName(self):
        return BACKEND

    def __repr__(self):
        return f"<ProcessGroupShmtree rank={self._comm.rank} size={self._comm.size}>"

    # ---- work objects ----

    def _work(self, requests, finish):
        """A Work whose future is set when the last of `requests` (they complete in order) is
        done: with finish() (its value), or with the first failure."""
        fut = Future()

        def done(_):
            failed = next((r.exception() for r in requests if r.exception() is not None), None)
            if failed is not None:
                fut.set_exception(failed)
                return
            try:
                value = finish()
            except BaseException as exc:          # (a failure of the finishing step itself)
                fut.set_exception(exc)
                return
            fut.set_result(value)

        if requests:
            requests[-1].add_done_callback(done)
        else:
            fut.set_result(finish())
        return _create_work_from_future(fut)

    # ---- collectives ----

    def allreduce(self, tensors, opts):
        op = _op(opts.reduceOp)
        reqs = []
        for t in tensors:
            a = _view(t)
            reqs.append(self._comm.iallreduce(a, "sum" if op == "avg" else op, out=a,
                                              timeout=self._timeout))

        def finish():
            if op == "avg":
                for t in tensors:
                    t.detach().div_(self._comm.size)
            return tensors
        return self._work(reqs, finish)

    def broadcast(self, tensors, opts):
        root = opts.rootRank
        reqs = [self._comm.ibroadcast(_view(t), root, out=_view(t), timeout=self._timeout)
                for t in tensors]
        return self._work(reqs, lambda: tensors)

    def reduce(self, tensors, opts):
        op, root, me = _op(opts.reduceOp), opts.rootRank, self._comm.rank
        reqs = [self._comm.ireduce(_view(t), "sum" if op == "avg" else op, root,
                                   out=_view(t) if me == root else None, timeout=self._timeout)
                for t in tensors]

        def finish():
            if op == "avg" and me == root:
                for t in tensors:
                    t.detach().div_(self._comm.size)
            return tensors
        return self._work(reqs, finish)

    def allgather(self, output_tensors, input_tensors, opts):
        reqs = [self._comm.iallgather(_view(t), timeout=self._timeout) for t in input_tensors]

        def finish():
            for outs, req in zip(output_tensors, reqs):
                got = req.result()
                for r, o in enumerate(outs):
                    o.detach().copy_(torch.from_numpy(got[r]))
            return output_tensors
        return self._work(reqs, finish)

    def _allgather_base(self, output, input, opts):
        size = self._comm.size
        out = _view(output).reshape((size,) + tuple(input.shape))
        req = self._comm.iallgather(_view(input), out=out, timeout=self._timeout)
        return self._work([req], lambda: [output])

    def reduce_scatter(self, output_tensors, input_lists, opts):
        op = _op(opts.reduceOp)
        reqs = []
        for out, parts in zip(output_tensors, input_lists):
            whole = np.concatenate([_view(p).reshape(-1) for p in parts])
            reqs.append(self._comm.ireduce_scatter(whole, "sum" if op == "avg" else op,
                                                   out=_view(out).reshape(-1),
                                                   timeout=self._timeout))

        def finish():
            if op == "avg":
                for t in output_tensors:
                    t.detach().div_(self._comm.size)
            return output_tensors
        return self._work(reqs, finish)

    def _reduce_scatter_base(self, output, input, opts):
        op = _op(opts.reduceOp)
        req = self._comm.ireduce_scatter(_view(input), "sum" if op == "avg" else op,
                                         out=_view(output).reshape(
                                             (input.shape[0] // self._comm.size,)
                                             + tuple(input.shape[1:])),
                                         timeout=self._timeout)

        def finish():
            if op == "avg":
                output.detach().div_(self._comm.size)
            return [output]
        return self._work([req], finish)

    all_gather_single = _allgather_base          # (the names torch >= 2.10 calls)
    reduce_scatter_single = _reduce_scatter_base

    def barrier(self, opts=None):
        return self._work([self._comm.ibarrier(timeout=self._timeout)], lambda: [])

    def shutdown(self):
        self._comm.close()
        self._group.close()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass


def _create(store, rank, size, timeout):
    return ProcessGroupShmtree(store, rank, size, timeout)


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
