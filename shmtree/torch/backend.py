"""The process group of backend "shmtree": ProcessGroupShmtree, and its registration with
torch.distributed (the package's docstring, shmtree/torch/__init__.py, says what it does)."""
from __future__ import annotations

import atexit
import datetime
import os
import queue
import threading
import warnings
import weakref

import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future

from ..frontend import calls
from ..groups.group import Group
from .options import (BACKEND, INLINE_BYTES, SUPPORTED, _AllreduceOptions, _BarrierOptions,
                      _BroadcastOptions, _OP, _ROOT, _ReduceOptions, _TIMEOUT, _TOKEN_KEY,
                      _check_avg, _failed, _form, _invalid, _op, _seconds)
from .tensors import (_ALIGN, _SPARSE, _STRIDED, _check_dense, _check_match, _check_root,
                      _layout_name, _packed, _reduced_locally, _strided_view, _tensors, _unpacked,
                      _view)
from .coalesced import _Coalesced
from .gathers import _Gathers
from .p2p import _PointToPoint
from .reproducible import REDUCTION_ENV, _Reproducible, _reduction_mode
from .survive import _Survive                # abort, get_error (issue 38)
from .works import _DoneWork, _Failed, _FailedWork, _PostedWork, _call, _done, _settle


def _unsupported(method, what):
    """A ProcessGroup method the backend does not offer (yet): it raises, naming shmtree and
    the operation (NotImplementedError: a RuntimeError, the type torch's C++ carries)."""
    def refuse(self, *args, **kwargs):
        raise NotImplementedError(
            f"shmtree: {what} is not supported yet by the shmtree backend "
            f"(ProcessGroup.{method}); supported: {SUPPORTED}.  For the rest, a gloo group "
            "over the same ranks: torch.distributed.new_group(backend='gloo')")
    refuse.__name__ = method
    return refuse


class ProcessGroupShmtree(_Survive, _Gathers, _Coalesced, _PointToPoint, _Reproducible,
                          dist.ProcessGroup):
    """The process group of backend "shmtree" (see the docstring of shmtree.torch).

    Its operations are written in four places: here (the work objects, all_reduce, broadcast,
    reduce, barrier), gathers.py (all_gather, reduce_scatter, gather, scatter, all_to_all),
    coalesced.py (the coalesced forms) and p2p.py (send, recv).
    """

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        self._reduction = _reduction_mode(os.environ.get(REDUCTION_ENV) or "default",
                                          REDUCTION_ENV)     # (reproducible.py)
        self._timeout = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) \
            else None
        if rank == 0:
            self._group = Group(size, pin=False)
            store.set(_TOKEN_KEY, self._group.rendezvous_token())
        else:
            self._group = Group.from_token(store.get(_TOKEN_KEY))
        with warnings.catch_warnings():   # (a subgroup's: this process joins another group;
            warnings.filterwarnings(      # torch's groups do not use shmtree.current())
                "ignore", message=".*joins a second one", category=RuntimeWarning)
            self._comm = self._group.join(rank)
        self._size = size
        try:                              # (bfloat16's numpy type: imported by every rank here,
            import ml_dtypes  # noqa: F401    not by one rank inside its first bfloat16 call
        except ImportError:               # while the others wait in theirs)
            pass
        self._failure = None              # a failure nobody has seen yet, for the next operation
        self._issuing = threading.Lock()  # one thread at a time makes this group's calls
        self._completions = None          # the completion thread's queue (made on first use)
        self._completer = None
        self._stopped = False             # shut down: no completion thread any more
        self._lazy = None                 # a small recv not posted yet (_LazyRecvWork)
        # rank 0's descriptor must stay open until everyone has attached: meet once
        self._comm._run(calls.barrier(self._comm, self._timeout))
        _LIVE.add(self)

    def getBackendName(self):
        return BACKEND

    # torch keeps a group's name in its backends (ProcessGroup::getGroupName: "ProcessGroup
    # name not set" when it has none, as a Python process group has); a DeviceMesh asks for it
    def _set_group_name(self, name):
        self._group_name = name
        try:
            super()._set_group_name(name)
        except RuntimeError:
            pass

    @property
    def group_name(self):
        name = getattr(self, "_group_name", None)
        return name if name is not None else super().group_name

    def __repr__(self):
        return f"<ProcessGroupShmtree rank={self._comm.rank} size={self._comm.size}>"

    # ---- work objects ----

    def _seen(self, error):
        """A failure was raised to someone (Work.wait): the next operation need not."""
        if self._failure is error:
            self._failure = None

    def _complete(self, fn):
        """Run fn in the completion thread (started on first use): posted operations' futures
        are completed there, outside shmtree's progress thread, so that their then()
        callbacks may issue collectives (DDP comm hooks: PowerSGD waits on an all_reduce
        inside one)."""
        q = self._completions
        if q is None:
            if self._stopped:                     # (a completion after shutdown: run here)
                fn()
                return
            q = self._completions = queue.SimpleQueue()
            self._completer = threading.Thread(target=_completion_loop, args=(q,),
                                               name=f"shmtree-torch-completion-{self._size}",
                                               daemon=True)
            self._completer.start()
        q.put(fn)

    def _work(self, made, nbytes, finish):
        """Make the calls - each of `made` (_call's) parses its call into a CallSpec (calls.py)
        and call(True) gives the step that runs it blocking, call(False) the step that posts it
        (a Request) - and return a Work whose future finish() sets (its value) once they are
        done.  Messages of at most INLINE_BYTES run blocking, at once (a hand-off to the
        progress thread costs more than they do); larger ones are posted, so that the caller
        (DDP's backward pass) computes meanwhile.  Calls complete in issue order either way.
        A call's argument errors raise here; the failure of the collective (a mismatch, a dead
        peer, a timeout) raises from the Work's wait(), fails its future (DDP's reducer raises
        it), and, should nobody wait, is raised by the group's next operation."""
        self._check_failed()
        if nbytes <= INLINE_BYTES or self._completer is threading.current_thread():
            # (in the completion thread - a then() callback's call - blocking: a posted call's
            # completion would queue behind the callback that waits for it)
            with self._issuing:
                self._post_lazy()
                try:
                    steps = [call(True) for call in made]
                except Exception as exc:          # (torch's C++ takes RuntimeErrors)
                    raise RuntimeError(f"{type(exc).__name__}: {exc}") from None
                try:
                    for step in steps:
                        step()
                    value = finish()
                except Exception as exc:
                    error = _failed(self._comm.rank, exc)
                    self._failure = error
                    return _FailedWork(error, self)
            return _DoneWork(value)
        # Everything the posted path needs is made before the first call is posted: from then
        # on the progress thread wants the GIL, and each step left here would make it (and the
        # peers waiting for this rank's part) wait behind this thread.
        source = Future()
        requests = []
        work = _PostedWork(requests, source, source.then(_settle), self)

        complete = self._completion(work, requests, source, finish)

        with self._issuing:
            self._post_lazy()
            try:
                steps = [call(False) for call in made]
                for step in steps:
                    requests.append(step())
            except Exception as exc:              # (torch's C++ takes RuntimeErrors)
                raise RuntimeError(f"{type(exc).__name__}: {exc}") from None
        requests[-1].add_done_callback(lambda _: self._complete(complete))
        return work

    def _completion(self, work, requests, source, finish):
        """What completes a posted Work (in the completion thread, once its last request is
        done): source gets finish()'s value, or the first failure."""
        def complete():
            failed = next((r.exception() for r in requests if r.exception() is not None), None)
            if failed is None:
                try:
                    value = finish()
                except BaseException as exc:      # (a failure of the finishing step itself)
                    failed = exc
            if failed is not None:
                error = _failed(self._comm.rank, failed)
                work._error = error
                self._failure = error             # (for the next operation, if nobody waits)
                source.set_result(_Failed(error))
                return
            source.set_result(value)
        return complete

    def _divide(self, tensors, op, mine=True):
        """AVG: the sum, divided by the size (where the result is)."""
        if op == "avg" and mine:
            for t in tensors:
                t.detach().div_(self._comm.size)
        return tensors

    # ---- collectives ----

    def allreduce(self, tensors, opts=None, *args, **kwargs):
        """allreduce(tensors, opts) and allreduce(tensors, op=SUM, timeout=None): every tensor
        of the list gets the reduction over all ranks and all the list's tensors (gloo's)."""
        if type(opts) is not _AllreduceOptions or args or kwargs:
            opts = _form(opts, args, kwargs, _AllreduceOptions, "allreduce", (_OP, _TIMEOUT))
        if type(tensors) is not list:
            tensors = _tensors(tensors, "allreduce")
        red = _op(opts.reduceOp)
        secs = _seconds(opts.timeout, self._timeout)
        if len(tensors) == 1 and tensors[0].layout == _STRIDED:
            _check_avg(red, tensors, "all_reduce")
            a = _strided_view(tensors[0])
            if self._exact(red, a):
                return self._summed(a, secs, lambda: self._divide(tensors, red))
            return self._work([_call(calls.allreduce, self._comm, a,
                                     "sum" if red == "avg" else red, out=a, timeout=secs,
                                     **self._reproducibly(red))],
                              a.nbytes, lambda: self._divide(tensors, red))
        if not tensors:
            raise _invalid("allreduce", "requires non-empty tensor list")
        layout = tensors[0].layout
        for i, t in enumerate(tensors):
            if t.layout != layout:
                raise _invalid("allreduce", f"invalid tensor layout at index {i} (expected "
                                            f"{_layout_name(tensors[0])}, got {_layout_name(t)})")
        _check_match("allreduce", tensors)
        if layout == _SPARSE:
            if red != "sum":
                raise _invalid("allreduce", "unsupported reduction operation (allreduce of "
                                            "sparse tensors only works with ReduceOp.SUM)")
            return self._sparse_allreduce(tensors, secs)
        if layout != _STRIDED:
            raise _invalid("allreduce", "unsupported layout")
        _check_avg(red, tensors, "all_reduce")
        for t in tensors:
            _view(t)                              # (its checks: CPU tensors)
        acc = _reduced_locally(tensors, red)
        a = _view(acc)

        def finish():
            if red == "avg":
                acc.div_(self._comm.size)
            for t in tensors:
                t.detach().copy_(acc)
            return tensors
        if self._exact(red, a):
            return self._summed(a, secs, finish)
        return self._work([_call(calls.allreduce, self._comm, a, "sum" if red == "avg" else red,
                                 out=a, timeout=secs, **self._reproducibly(red))], a.nbytes,
                          finish)

    def _sparse_allreduce(self, tensors, secs):
        """Sparse COO allreduce, as gloo's: the list summed locally and coalesced; every rank's
        shape and nnz gathered, then its indices and values; their sum coalesced is copied
        into every tensor of the list.  Runs blocking (two allgathers)."""
        comm, size = self._comm, self._comm.size
        acc = tensors[0].detach()
        for t in tensors[1:]:
            acc = acc + t.detach()
        acc = acc.coalesce()
        sparse_dim, dense_dim = acc.sparse_dim(), acc.dense_dim()
        if sparse_dim > 4 or dense_dim > 4:
            raise _invalid("allreduce", "sparse tensors of more than 4 sparse or dense "
                                        "dimensions are not supported")
        meta = torch.zeros(9, dtype=torch.int64)
        for i in range(sparse_dim):
            meta[i] = acc.shape[i]
        for i in range(dense_dim):
            meta[4 + i] = acc.shape[sparse_dim + i]
        meta[8] = acc._nnz()
        metas = torch.empty((size, 9), dtype=torch.int64)
        indices = acc._indices().t().contiguous()           # (nnz, sparse_dim)
        values = acc._values().contiguous()                 # (nnz, *dense)
        blob, pieces = _packed([indices, values])
        row = values[0].numel() if values.shape[0] else int(np.prod(values.shape[1:]))
        item = values.element_size()

        def run():
            comm._start(calls.allgather(comm, _view(meta), out=_view(metas), timeout=secs))
            if not all(torch.equal(metas[r, :8], meta[:8]) for r in range(size)):
                raise RuntimeError("shmtree: ProcessGroupShmtree.allreduce: Sparse dimensions "
                                   "do not match")
            return comm._start(calls.allgather(comm, _view(blob), axis=0, timeout=secs))

        with self._issuing:
            self._post_lazy()
            try:
                gathered = torch.from_numpy(np.ascontiguousarray(run()))
            except Exception as exc:
                error = RuntimeError(f"shmtree: rank {comm.rank}: the operation failed: "
                                     f"{type(exc).__name__}: {exc}")
                self._failure = error
                return _FailedWork(error, self)
        all_idx, all_val, off = [], [], 0
        for r in range(size):
            nnz = int(metas[r, 8])
            ib, vb = nnz * sparse_dim * 8, nnz * row * item
            vo = -(-ib // _ALIGN) * _ALIGN
            whole = max(vo + -(-vb // _ALIGN) * _ALIGN, _ALIGN)
            all_idx.append(_unpacked(gathered, off, ib, torch.empty((nnz, sparse_dim),
                                                                    dtype=torch.int64)))
            all_val.append(_unpacked(gathered, off + vo, vb,
                                     torch.empty((nnz,) + tuple(values.shape[1:]),
                                                 dtype=values.dtype)))
            off += whole
        out = torch.sparse_coo_tensor(torch.cat(all_idx).t(), torch.cat(all_val), acc.shape,
                                      dtype=acc.dtype).coalesce()
        with torch.no_grad():                     # (a sparse tensor's detach() is another
            for t in tensors:                     # tensor: its copy_ would not reach t)
                t.copy_(out)
        return _done(tensors)

    def broadcast(self, tensors, opts=None, *args, **kwargs):
        """broadcast(tensors, opts) and broadcast(tensor, root, timeout=None): the root rank's
        tensors[opts.rootTensor] goes to every tensor of every rank's list (gloo's)."""
        if type(opts) is not _BroadcastOptions or args or kwargs:
            opts = _form(opts, args, kwargs, _BroadcastOptions, "broadcast", (_ROOT, _TIMEOUT))
        if type(tensors) is not list:
            tensors = _tensors(tensors, "broadcast")
        comm, root, rt = self._comm, opts.rootRank, opts.rootTensor
        secs = _seconds(opts.timeout, self._timeout)
        _check_root("broadcast", root, comm.size)
        if not 0 <= rt < len(tensors):
            raise _invalid("broadcast", f"invalid root tensor: {rt}")
        if len(tensors) == 1:
            a = _view(tensors[0])
            return self._work([_call(calls.broadcast, comm, a, root, out=a, timeout=secs)],
                              a.nbytes, lambda: tensors)
        _check_dense("broadcast", tensors)
        _check_match("broadcast", tensors)
        a = _view(tensors[rt])

        def finish():
            for i, t in enumerate(tensors):
                if i != rt:
                    t.detach().copy_(tensors[rt].detach())
            return tensors
        return self._work([_call(calls.broadcast, comm, a, root, out=a, timeout=secs)],
                          a.nbytes, finish)

    def reduce(self, tensors, opts=None, *args, **kwargs):
        """reduce(tensors, opts) and reduce(tensor, root, op=SUM, timeout=None)."""
        if type(opts) is not _ReduceOptions or args or kwargs:
            opts = _form(opts, args, kwargs, _ReduceOptions, "reduce", (_ROOT, _OP, _TIMEOUT))
        if type(tensors) is not list:
            tensors = _tensors(tensors, "reduce")
        comm, root = self._comm, opts.rootRank
        red = _op(opts.reduceOp)
        secs = _seconds(opts.timeout, self._timeout)
        _check_root("reduce", root, comm.size)
        if not 0 <= opts.rootTensor < len(tensors):
            raise _invalid("reduce", f"invalid root tensor: {opts.rootTensor}")
        if len(tensors) != 1:
            raise _invalid("reduce", "requires a single-element tensor list")
        _check_dense("reduce", tensors)
        _check_avg(red, tensors, "reduce")
        a = _view(tensors[0])
        return self._work([_call(calls.reduce, comm, a, "sum" if red == "avg" else red, root,
                                 out=a if comm.rank == root else None, timeout=secs,
                                 **self._reproducibly(red))],
                          a.nbytes, lambda: self._divide(tensors, red, comm.rank == root))
    def barrier(self, opts=None, *args, **kwargs):
        """barrier(opts) and barrier(timeout=None)."""
        if type(opts) is not _BarrierOptions or args or kwargs:
            opts = _form(opts, args, kwargs, _BarrierOptions, "barrier", (_TIMEOUT,))
        secs = _seconds(opts.timeout, self._timeout)
        return self._work([_call(calls.barrier, self._comm, timeout=secs)], 0, lambda: [])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """A barrier that raises once `timeout` runs out (gloo's monitored_barrier; shmtree's
        barrier timeout aborts the group).  torch's dist.monitored_barrier refuses every
        backend but gloo: call it on the group, dist.group.WORLD.monitored_barrier(timeout)."""
        if isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(seconds=timeout)
        work = self.barrier(timeout=timeout)
        try:
            work.wait()
        except RuntimeError as exc:
            raise RuntimeError(f"shmtree: rank {self._comm.rank}: monitored_barrier failed "
                               f"(timeout {timeout}): {exc}") from None
    def _check_failed(self):
        """Before an operation: an earlier one's failure that nobody waited for, or the group
        aborted, raises here (RuntimeError: what torch's C++ takes)."""
        failed, self._failure = self._failure, None
        if failed is not None:
            raise RuntimeError(f"shmtree: an earlier operation of this process group failed: "
                               f"{type(failed).__name__}: {failed}")
        if self._group.aborted():
            raise RuntimeError(f"shmtree: rank {self._comm.rank}: "
                               f"{self._group.describe_abort()}")

    _start_coalescing = _unsupported("_start_coalescing",
                                     "coalescing by device (_coalescing_manager with a device; "
                                     "batch_isend_irecv runs its operations one by one)")
    _end_coalescing = _unsupported("_end_coalescing",
                                   "coalescing by device (_coalescing_manager with a device; "
                                   "batch_isend_irecv runs its operations one by one)")

    def shutdown(self):
        self._stopped = True
        q, self._completions = self._completions, None
        if q is not None:
            q.put(None)
            if self._completer is not threading.current_thread():
                self._completer.join(5)
        self._comm.close()
        self._group.close()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass


def _completion_loop(q):
    """The completion thread: runs what posted operations' completions hand it, in order,
    until told to stop (None)."""
    while True:
        fn = q.get()
        if fn is None:
            return
        try:
            fn()
        except BaseException:                     # (a then() callback's own failure is the
            pass                                  # future's; nothing else raises here)


_LIVE = weakref.WeakSet()           # this process's process groups, for _stop_failed_at_exit


@atexit.register
def _stop_failed_at_exit():
    """At interpreter exit, before torch's C++ objects go: stop the progress thread of every
    process group whose shmtree group failed (a peer died), so that it is not still failing
    the posted operations, inside torch's futures, while they are destroyed (a rank 0 that
    raised from DDP after its peer died exited once with SIGABRT).  A healthy group is left
    as it is (its outstanding operations may still need peers that are alive)."""
    for pg in list(_LIVE):
        try:
            if pg._group.aborted():
                pg.shutdown()
        except Exception:
            pass


def _create(store, rank, size, timeout):
    return ProcessGroupShmtree(store, rank, size, timeout)


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
