"""A torch.distributed backend: `import shmtree.torch`, then
`torch.distributed.init_process_group("shmtree", ...)` in processes of one machine started by any
launcher (torchrun, torch.multiprocessing.spawn), and DistributedDataParallel runs on shmtree.

The group is formed through the launcher's store: rank 0 creates a shmtree.Group of the world's
size (not pinned: torch runs threads of its own) and publishes its rendezvous token; the others
attach with Group.from_token (only processes of the same user can) and every rank joins.  Each
operation builds shmtree's calls on numpy views of the tensors (CallSpecs, calls.py; the same
memory: in place, no copies for contiguous tensors), runs or posts them (the communicator's
_run / _post, the path of its public methods) and returns a Work made from a torch Future
that the call's completion sets, so `work.wait()` and `work.get_future()` behave as gloo's: a failed
operation raises from `wait()` and fails its future (never a success with unreduced data).
Outputs of any layout are written (a non-contiguous one through a temporary); ReduceOp.AVG of
integer tensors is refused before anything is touched, as gloo's RuntimeError; every operation
the backend does not offer raises NotImplementedError naming shmtree and the operation.

Supported: all_reduce (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR), broadcast, reduce,
all_gather, all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor, barrier; CPU tensors
of the dtypes shmtree reduces (bool, ints, float16, bfloat16 (with ml_dtypes), float32/64,
complex64/128).  torch is optional: `pip install "shmtree[torch]"`.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import datetime
import weakref

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from . import calls
from .arrays import _to_torch, as_numpy
from .group import Group

BACKEND = "shmtree"
_TOKEN_KEY = "shmtree/group-token"
INLINE_BYTES = 256 << 10        # operations on at most this much run blocking (see _work)
SUPPORTED = ("all_reduce, broadcast, reduce, all_gather, all_gather_into_tensor, reduce_scatter, "
             "reduce_scatter_tensor, barrier")


_OPS = {"SUM": "sum", "AVG": "avg", "PRODUCT": "prod", "MIN": "min", "MAX": "max",
        "BAND": "band", "BOR": "bor", "BXOR": "bxor"}


def _op_name(reduce_op):
    """The name of a torch ReduceOp ("SUM", "PREMUL_SUM", ...): a ReduceOp object carries its
    RedOpType in .op; ReduceOp.SUM & co. are RedOpTypes themselves."""
    kind = getattr(reduce_op, "op", reduce_op)
    return getattr(kind, "name", None) or repr(reduce_op)


def _op(reduce_op):
    """shmtree's op name for a torch ReduceOp ("avg": the sum, then divided by the size)."""
    name = _op_name(reduce_op)
    if name not in _OPS:
        raise NotImplementedError(                # (a RuntimeError, as gloo's "Cannot use ...")
            f"shmtree: ReduceOp.{name} is not supported by the shmtree backend (supported: "
            f"{', '.join('ReduceOp.' + n for n in _OPS)})")
    return _OPS[name]


def _check_avg(op, tensors, what):
    """ReduceOp.AVG of integer or bool tensors: refused before any call (the tensors stay as they
    were), with the RuntimeError gloo gives (whose division fails once the sum is made)."""
    if op != "avg":
        return
    for t in tensors:
        dtype = getattr(t, "dtype", None)
        if isinstance(dtype, torch.dtype) and not (dtype.is_floating_point or dtype.is_complex):
            try:                                  # torch's own words for it, as gloo gives them
                torch.empty(0, dtype=dtype).div_(2)
                why = "an average is not an integer"
            except RuntimeError as exc:
                why = str(exc)
            raise RuntimeError(f"shmtree: {what} with ReduceOp.AVG of a {dtype} tensor: {why} "
                               "(use a floating-point tensor, or ReduceOp.SUM and divide)")


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


def _shaped(t, shape, what):
    """(a numpy array of `shape` over tensor t's memory, for an operation to write; a step
    that puts the result into t, or None).  When t's layout has no view of that shape (a
    non-contiguous tensor), the operation writes a contiguous temporary, and the step copies
    it into t: the output is written either way (numpy's reshape would copy, and the copy be
    filled and dropped)."""
    _view(t)                                      # (its checks: a CPU tensor)
    shape = tuple(int(n) for n in shape)
    n = 1
    for d in shape:
        n *= d
    if t.numel() != n:
        raise RuntimeError(f"shmtree: {what}: the output tensor has {t.numel()} elements "
                           f"(shape {tuple(t.shape)}), expected {n}")
    try:
        return _view(t.detach().view(shape)), None
    except RuntimeError:                          # (no view of that shape over t's strides)
        tmp = torch.empty(shape, dtype=t.dtype)
        return _view(tmp), lambda: t.detach().copy_(tmp.view(t.shape))


class _Failed:
    """What the source future of a posted operation carries when the operation failed."""

    __slots__ = ("error",)

    def __init__(self, error):
        self.error = error


def _settle(source):
    """The value of a posted operation's future (a then() of its source): the output
    tensors, or the operation's failure raised, which torch turns into an error of the
    future (an error C++ sees too: DDP's reducer raises it, where a Python exception object
    set as a future's value would be taken for its tensors)."""
    value = source.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


class _PostedWork(dist.Work):
    """The Work of a posted operation: wait() returns once it is done and raises its failure;
    get_future() fails likewise (see _settle)."""

    def __init__(self, requests, source, future):
        super().__init__()
        self._requests, self._source, self._future = requests, source, future
        self._error = None              # the failure, set before the source completes

    def wait(self, timeout=None):
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) \
            else timeout
        try:
            self._requests[-1].exception(seconds or None)     # (0: torch's "no timeout")
        except (TimeoutError, concurrent.futures.TimeoutError):     # (one type from 3.11)
            raise RuntimeError(f"shmtree: the operation is not done after {seconds} s "
                               "(Work.wait timed out; it is still running)") from None
        self._source.wait()             # (its completion callback has run)
        try:
            # and the future's own value is made: the then() of the source runs in the thread
            # that completed it, possibly after the source's waiters were woken
            self._future.wait()
        except Exception:
            if self._error is None:
                raise
        if self._error is not None:
            raise RuntimeError(str(self._error))
        return True

    def get_future(self):
        return self._future

    def is_completed(self):
        return self._future.done()

    def is_success(self):
        return self._future.done() and self._error is None

    def exception(self):
        return self._error

    def result(self):
        self.wait()
        return self._future.wait()

    def synchronize(self):
        pass


def _unsupported(method, what):
    """A ProcessGroup method the backend does not offer: it raises, naming shmtree and the
    operation (NotImplementedError: a RuntimeError, the type torch's C++ carries)."""
    def refuse(self, *args, **kwargs):
        raise NotImplementedError(
            f"shmtree: {what} is not supported yet by the shmtree backend "
            f"(ProcessGroup.{method}); supported: {SUPPORTED}.  For the rest, a gloo group "
            "over the same ranks: torch.distributed.new_group(backend='gloo')")
    refuse.__name__ = method
    return refuse


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
        self._comm._run(calls.barrier(self._comm, self._timeout))
        _LIVE.add(self)

    def getBackendName(self):
        return BACKEND

    def __repr__(self):
        return f"<ProcessGroupShmtree rank={self._comm.rank} size={self._comm.size}>"

    # ---- work objects ----

    def _work(self, made, nbytes, finish):
        """Make the calls - each of `made` (_call's) parses its call into a CallSpec (calls.py)
        and call(True) runs it blocking, call(False) posts it (a Request) - and return a Work
        whose future finish() sets (its value) once they are done.  Messages of at most
        INLINE_BYTES run blocking, at once (a hand-off to the progress thread costs more than
        they do); larger ones are posted, so that the caller (DDP's backward pass) computes
        meanwhile.  Calls complete in issue order either way.
        The failure of a blocking call is raised by this call (as RuntimeError, which torch's
        C++ carries); that of a posted one by the Work's wait(), its future's wait() and
        value() (DDP's reducer raises it), and, should nobody wait, by the group's next
        operation."""
        failed, self._failure = self._failure, None
        if failed is not None:
            raise RuntimeError(f"shmtree: an earlier operation of this process group failed: "
                               f"{type(failed).__name__}: {failed}")
        if self._group.aborted():
            raise RuntimeError(f"shmtree: rank {self._comm.rank}: "
                               f"{self._group.describe_abort()}")
        if nbytes <= INLINE_BYTES:
            fut = Future()
            try:
                for call in made:
                    call(True)
                fut.set_result(finish())
            except Exception as exc:              # (torch's C++ takes RuntimeErrors)
                raise RuntimeError(f"{type(exc).__name__}: {exc}") from None
            return _create_work_from_future(fut)
        # Everything the posted path needs is made before the first call is posted: from then
        # on the progress thread wants the GIL, and each step left here would make it (and the
        # peers waiting for this rank's part) wait behind this thread.
        source = Future()
        requests = []
        work = _PostedWork(requests, source, source.then(_settle))

        def done(_):
            failed = next((r.exception() for r in requests if r.exception() is not None), None)
            if failed is None:
                try:
                    value = finish()
                except BaseException as exc:      # (a failure of the finishing step itself)
                    failed = exc
            if failed is not None:
                error = RuntimeError(f"shmtree: rank {self._comm.rank}: the operation failed: "
                                     f"{type(failed).__name__}: {failed}")
                work._error = error
                self._failure = failed            # (for the next operation, if nobody waits)
                source.set_result(_Failed(error))
                return
            source.set_result(value)

        try:
            for call in made:
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
        _check_avg(op, tensors, "all_reduce")
        comm, timeout = self._comm, self._timeout
        arrays = [_view(t) for t in tensors]
        made = [_call(calls.allreduce, comm, a, "sum" if op == "avg" else op, out=a,
                      timeout=timeout) for a in arrays]
        return self._work(made, sum(a.nbytes for a in arrays),
                          lambda: self._divide(tensors, op))

    def broadcast(self, tensors, opts):
        comm, root = self._comm, opts.rootRank
        arrays = [_view(t) for t in tensors]
        made = [_call(calls.broadcast, comm, a, root, out=a, timeout=self._timeout)
                for a in arrays]
        return self._work(made, sum(a.nbytes for a in arrays), lambda: tensors)

    def reduce(self, tensors, opts):
        op, root, comm = _op(opts.reduceOp), opts.rootRank, self._comm
        _check_avg(op, tensors, "reduce")
        arrays = [_view(t) for t in tensors]
        made = [_call(calls.reduce, comm, a, "sum" if op == "avg" else op, root,
                      out=a if comm.rank == root else None, timeout=self._timeout)
                for a in arrays]
        return self._work(made, sum(a.nbytes for a in arrays),
                          lambda: self._divide(tensors, op, comm.rank == root))

    def allgather(self, output_tensors, input_tensors, opts):
        comm, size = self._comm, self._comm.size
        pairs = [(_view(t), outs) for t, outs in zip(input_tensors, output_tensors)]
        gathered = [np.empty((size,) + a.shape, a.dtype) for a, _ in pairs]
        made = [_call(calls.allgather, comm, a, out=g, timeout=self._timeout)
                for (a, _), g in zip(pairs, gathered)]

        def finish():
            for (_, outs), g in zip(pairs, gathered):
                for r, o in enumerate(outs):
                    o.detach().copy_(_to_torch(g[r]))
            return output_tensors
        return self._work(made, sum(g.nbytes for g in gathered), finish)

    def _allgather_base(self, output, input, opts):
        comm = self._comm
        out, put = _shaped(output, (comm.size,) + tuple(input.shape), "all_gather_into_tensor")
        made = [_call(calls.allgather, comm, _view(input), out=out, timeout=self._timeout)]

        def finish():
            if put is not None:
                put()
            return [output]
        return self._work(made, out.nbytes, finish)

    def reduce_scatter(self, output_tensors, input_lists, opts):
        op, comm = _op(opts.reduceOp), self._comm
        _check_avg(op, output_tensors, "reduce_scatter")
        wholes = [np.concatenate([_view(p).reshape(-1) for p in parts]) for parts in input_lists]
        outs = [_shaped(out, (out.numel(),), "reduce_scatter") for out in output_tensors]
        made = [_call(calls.reduce_scatter, comm, w, "sum" if op == "avg" else op, out=o,
                      timeout=self._timeout) for w, (o, _) in zip(wholes, outs)]

        def finish():
            for _, put in outs:
                if put is not None:
                    put()
            return self._divide(output_tensors, op)
        return self._work(made, sum(w.nbytes for w in wholes), finish)

    def _reduce_scatter_base(self, output, input, opts):
        op, comm = _op(opts.reduceOp), self._comm
        _check_avg(op, [output], "reduce_scatter_tensor")
        block = (input.shape[0] // comm.size,) + tuple(input.shape[1:])
        a = _view(input)
        out, put = _shaped(output, block, "reduce_scatter_tensor")
        made = [_call(calls.reduce_scatter, comm, a, "sum" if op == "avg" else op, out=out,
                      timeout=self._timeout)]

        def finish():
            if put is not None:
                put()
            return self._divide([output], op)
        return self._work(made, a.nbytes, finish)

    all_gather_single = _allgather_base          # (the names torch >= 2.10 calls)
    reduce_scatter_single = _reduce_scatter_base

    def barrier(self, opts=None):
        comm = self._comm
        return self._work([_call(calls.barrier, comm, timeout=self._timeout)], 0, lambda: [])

    # ---- what the backend does not offer (yet): each says so (torch's own ProcessGroup would
    # answer "No backend type associated with device type cpu", naming neither) ----

    gather = _unsupported("gather", "gather (torch.distributed.gather, gather_object)")
    scatter = _unsupported("scatter", "scatter (torch.distributed.scatter, "
                                      "scatter_object_list)")
    alltoall = _unsupported("alltoall", "all_to_all")
    alltoall_base = _unsupported("alltoall_base", "all_to_all_single")
    all_to_all_single = _unsupported("all_to_all_single", "all_to_all_single")
    send = _unsupported("send", "send / isend (point-to-point messages)")
    recv = _unsupported("recv", "recv / irecv (point-to-point messages)")
    recv_anysource = _unsupported("recv_anysource", "recv from any source (point-to-point)")
    allreduce_coalesced = _unsupported("allreduce_coalesced",
                                       "all_reduce_coalesced (and coalesced all_reduce)")
    allgather_coalesced = _unsupported("allgather_coalesced", "all_gather_coalesced")
    allgather_into_tensor_coalesced = _unsupported("allgather_into_tensor_coalesced",
                                                   "coalesced all_gather_into_tensor")
    all_gather_single_coalesced = _unsupported("all_gather_single_coalesced",
                                               "coalesced all_gather_into_tensor")
    reduce_scatter_tensor_coalesced = _unsupported("reduce_scatter_tensor_coalesced",
                                                   "coalesced reduce_scatter_tensor")
    reduce_scatter_single_coalesced = _unsupported("reduce_scatter_single_coalesced",
                                                   "coalesced reduce_scatter_tensor")
    _start_coalescing = _unsupported("_start_coalescing",
                                     "coalescing (batch_isend_irecv, _coalescing_manager)")
    _end_coalescing = _unsupported("_end_coalescing",
                                   "coalescing (batch_isend_irecv, _coalescing_manager)")
    monitored_barrier = _unsupported("monitored_barrier", "monitored_barrier")

    def shutdown(self):
        self._comm.close()
        self._group.close()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass


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


def _call(parse, comm, *args, **kwargs):
    """A call, as _work makes it: call(True) parses it (parse: calls.allreduce, ...; the
    CallSpec every way into a collective builds) and runs it blocking, call(False) parses and
    posts it (a Request): both through the front end's one dispatch (Front._start: a rooted
    call's local error is said to the other ranks before it is raised, as the communicator's
    methods do)."""
    def call(now):
        return comm._start(parse(comm, *args, posted=not now, **kwargs))
    return call


def _create(store, rank, size, timeout):
    return ProcessGroupShmtree(store, rank, size, timeout)


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
