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
"""
from __future__ import annotations

import atexit
import concurrent.futures
import datetime
import queue
import threading
import warnings
import weakref

import numpy as np
import torch
import torch.distributed as dist
import torch._C._distributed_c10d as _c10d
from torch.futures import Future

from . import calls
from .arrays import as_numpy
from .codes import ABORT_TIMEOUT, KIND_ALLTOALL
from .errors import CollectiveMismatchError
from .group import Group
from .messages import ANY_SOURCE, QUICK_BYTES, Status, _rank_arg

BACKEND = "shmtree"
_TOKEN_KEY = "shmtree/group-token"
QUICK_P2P_BYTES = QUICK_BYTES             # send / recv of at most this: see their docstrings
INLINE_BYTES = 256 << 10        # operations on at most this much run blocking (see _work)
SUPPORTED = ("all_reduce, broadcast, reduce, all_gather, all_gather_into_tensor, reduce_scatter, "
             "reduce_scatter_tensor, gather, scatter, all_to_all, all_to_all_single, send, recv, "
             "isend, irecv, recv from any source, batch_isend_irecv, barrier, "
             "monitored_barrier, the coalesced forms")

_OPS = {"SUM": "sum", "AVG": "avg", "PRODUCT": "prod", "MIN": "min", "MAX": "max",
        "BAND": "band", "BOR": "bor", "BXOR": "bxor"}

# the options classes, looked up once (the hot path compares types)
_AllreduceOptions = dist.AllreduceOptions
_BroadcastOptions = dist.BroadcastOptions
_ReduceOptions = dist.ReduceOptions
_ReduceScatterOptions = dist.ReduceScatterOptions
_AllgatherOptions = _c10d.AllgatherOptions
_BarrierOptions = _c10d.BarrierOptions
_AllreduceCoalescedOptions = dist.AllreduceCoalescedOptions
_GatherOptions = _c10d.GatherOptions
_ScatterOptions = _c10d.ScatterOptions
_Tensor = torch.Tensor
_CFuture = torch._C.Future
_STRIDED = torch.strided
_SPARSE = torch.sparse_coo
_NONE = datetime.timedelta(0)       # an options object's timeout at most this: none given


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


# ---- the arguments, as torch documents them and gloo checks them ----


class ArgumentError(RuntimeError, ValueError):
    """A bad argument (or an operation that failed because some rank's was bad: a mismatch
    between the ranks, a local error said in the call's round): a RuntimeError, as gloo
    raises one (in its words), and a ValueError, as Python and torch's own checks name it."""


def _invalid(what, text):
    """An invalid argument: gloo's RuntimeError, its words, naming shmtree and the operation."""
    return RuntimeError(f"shmtree: ProcessGroupShmtree.{what}: {text}")


def _invalid_value(what, text):
    """_invalid, also a ValueError (ArgumentError)."""
    return ArgumentError(f"shmtree: ProcessGroupShmtree.{what}: {text}")


def _failed(rank, exc):
    """The RuntimeError a failed operation raises from wait() (an ArgumentError when what
    failed it is a ValueError: CollectiveMismatchError, a bad argument of some rank)."""
    cls = ArgumentError if isinstance(exc, ValueError) else RuntimeError
    return cls(f"shmtree: rank {rank}: the operation failed: {type(exc).__name__}: {exc}")


def _raised(error):
    """A Work's failure, raised anew (its type kept: RuntimeError or ArgumentError)."""
    return (ArgumentError if isinstance(error, ArgumentError) else RuntimeError)(str(error))


def _form(opts, args, kwargs, cls, what, fields):
    """The options object of a call: opts itself when it is one of cls (the form torch's C++
    and torch.distributed use), else one made from the convenience form's arguments - opts,
    then args, positionally, and kwargs, bound to `fields` ((parameter, option), in torch's
    order: allreduce(tensors, op, timeout), broadcast(tensor, root, timeout), ...)."""
    if isinstance(opts, cls) and not args and not kwargs:
        return opts
    if isinstance(opts, cls):
        raise TypeError(f"shmtree: ProcessGroupShmtree.{what}: an options object and "
                        f"{', '.join(kwargs) or 'more arguments'} given")
    values = ((opts,) if opts is not None else ()) + tuple(args)
    names = [name for name, _ in fields]
    if len(values) > len(names) or any(k not in names for k in kwargs):
        raise TypeError(f"shmtree: ProcessGroupShmtree.{what}() takes ({', '.join(names)}) "
                        f"after its tensors, or an options object")
    given = dict(zip(names, values))
    for key, value in kwargs.items():
        if key in given:
            raise TypeError(f"shmtree: ProcessGroupShmtree.{what}() got {key!r} twice")
        given[key] = value
    made = cls()
    for name, option in fields:
        value = given.get(name)
        if value is not None:
            if option == "timeout" and not isinstance(value, datetime.timedelta):
                value = datetime.timedelta(seconds=float(value))
            setattr(made, option, value)
    return made


_OP, _ROOT, _TIMEOUT = ("op", "reduceOp"), ("root", "rootRank"), ("timeout", "timeout")


def _tensors(x, what, name="tensors"):
    """A list of tensors: a list or tuple as given, a single tensor as a list of one."""
    if isinstance(x, _Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return list(x)
    raise TypeError(f"shmtree: ProcessGroupShmtree.{what}: {name} must be a tensor or a list of "
                    f"tensors, got {type(x).__name__}")


def _tensor_lists(x, what, name):
    """A list of lists of tensors."""
    if not isinstance(x, (list, tuple)) or not all(isinstance(v, (list, tuple)) for v in x):
        raise TypeError(f"shmtree: ProcessGroupShmtree.{what}: {name} must be a list of lists "
                        f"of tensors, got {type(x).__name__}")
    return [list(v) for v in x]


def _layout_name(t):
    return "Strided" if t.layout == _STRIDED else "Sparse" if t.layout == _SPARSE \
        else str(t.layout)


def _size_text(t):
    return "(" + ", ".join(str(int(n)) for n in t.shape) + ")"


def _check_match(what, tensors, dtype=None, shape=None, start=0):
    """gloo's assertTypeAndSizesMatch: every tensor of the list has the dtype and the shape of
    the first (or those given)."""
    first = tensors[0] if tensors else None
    dtype = first.dtype if dtype is None else dtype
    shape = first.shape if shape is None else shape
    for i, t in enumerate(tensors):
        if not isinstance(t, _Tensor):
            raise TypeError(f"shmtree: ProcessGroupShmtree.{what}: expected a torch.Tensor at "
                            f"index {start + i}, got {type(t).__name__}")
        if t.dtype != dtype:
            raise _invalid(what, f"invalid tensor type at index {start + i} (expected {dtype}, "
                                 f"got {t.dtype})")
        if t.shape != shape:
            raise _invalid(what, f"invalid tensor size at index {start + i} (expected "
                                 f"({', '.join(str(int(n)) for n in shape)}), got "
                                 f"{_size_text(t)})")


def _check_root_list(what, lists, side, stop, size, like):
    """gloo's checks of the root's list of lists in gather (side "output") and scatter
    ("input"): one list of `size` dense tensors of `like`'s dtype and shape (gloo ends the
    first message with `stop`)."""
    if len(lists) != 1:
        raise _invalid(what, f"requires a single-element {side} list containing a list "
                             f"with {size} tensors{stop}")
    if len(lists[0]) != size:
        raise _invalid(what, f"Incorrect {side} list size {len(lists[0])}. "
                             f"{side.capitalize()} list size should be {size}, same as size of "
                             "the process group.")
    _check_dense(what, lists[0])
    _check_match(what, lists[0], like.dtype, like.shape)
    for t in lists[0]:
        _view(t)


def _check_pairs(what, outputs, inputs, size, gathered):
    """gloo's checks of a coalesced call's (output, input) pairs: non-empty lists of one
    length, each pair of one dtype, the larger of each pair holding `size` times the smaller
    (gathered: the output, allgather; else the input, reduce_scatter), dense tensors."""
    if not inputs:
        raise _invalid(what, "requires non-empty input tensor list")
    if len(outputs) != len(inputs):
        raise _invalid(what, "requires input/output tensor lists to have the same length")
    for i, (o, t) in enumerate(zip(outputs, inputs)):
        if o.dtype != t.dtype:
            raise _invalid(what, f"invalid tensor type at index {i} (expected {t.dtype}, "
                                 f"got {o.dtype})")
        whole, part = (o, t) if gathered else (t, o)
        if whole.numel() != size * part.numel():
            raise _invalid(what, f"invalid tensor size at index {i} (expected {size} x "
                                 f"{_size_text(part)}, got {_size_text(whole)})")
    _check_dense(what, inputs + outputs)


def _check_dense(what, tensors):
    """gloo's assertDense / assertLayoutMatch for a collective of strided tensors on the CPU."""
    for i, t in enumerate(tensors):
        if isinstance(t, _Tensor) and t.layout != _STRIDED:
            raise _invalid(what, f"invalid tensor layout at index {i} (expected Strided, got "
                                 f"{_layout_name(t)})")


def _check_root(what, root, size):
    if not 0 <= root < size:
        raise _invalid(what, f"invalid root rank: {root}")


def _seconds(timeout, default):
    """An options object's timeout in seconds (unset, -1 ms: the group's)."""
    if timeout is None or timeout <= _NONE:
        return default
    return timeout.total_seconds()


def _check_splits(what, splits, t, size, side):
    """gloo's checkSplitSizes: no splits, dim 0 divides by the size; else `size` of them
    summing to dim 0 (gloo's words; an ArgumentError: a RuntimeError and a ValueError)."""
    rows = int(t.shape[0])
    if not splits:
        if rows % size:
            raise _invalid_value(what, f"Tensor's dim 0 does not divide equally across group "
                                       f"size (the {side} has {rows} rows, the group {size} "
                                       "ranks)")
    elif len(splits) != size:
        raise _invalid_value(what, f"Number of tensor splits not equal to group size "
                                   f"({side}_split_sizes {splits}: {len(splits)} for {size} "
                                   "ranks)")
    elif sum(splits) != rows or any(n < 0 for n in splits):
        raise _invalid_value(what, f"Split sizes doesn't match total dim 0 size "
                                   f"({side}_split_sizes {splits} sum to {sum(splits)}, the "
                                   f"{side} has {rows} rows)")


def _single_p2p(what, tensors, tag):
    """gloo's checkSingleTensor and checkTag: (the one contiguous dense tensor, the tag)."""
    tensors = _tensors(tensors, what)
    if len(tensors) != 1:
        raise _invalid(what, "takes a single tensor")
    t = tensors[0]
    if not isinstance(t, _Tensor):
        raise TypeError(f"shmtree: ProcessGroupShmtree.{what}: expected a torch.Tensor, got "
                        f"{type(t).__name__}")
    if t.layout != _STRIDED:
        raise _invalid(what, "input tensor has to be dense")
    if not t.is_contiguous():
        raise _invalid(what, "input tensor has to be contiguous")
    tag = int(tag)
    if tag < 0:
        raise _invalid(what, "Tag must be nonnegative")
    return t, tag


def _p2p_bytes(t):
    """A contiguous CPU tensor's bytes, as a 1-d uint8 numpy view (a message carries bytes:
    the receiver's tensor gives them their dtype and shape, as gloo's)."""
    _view(t)                                      # (its checks: a CPU tensor)
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _blocks_of_one(tensors, avoid=None):
    """The tensor of shape (n, *shape) whose rows are `tensors` - n contiguous tensors of one
    shape and dtype lying one after the other in the same memory (list(x.chunk(n)) of a
    contiguous x) - as a view of that memory; None when they are not (or when that memory
    overlaps the tensor `avoid`).  gather and scatter use it instead of a copy."""
    try:
        t0 = tensors[0].detach()
        nbytes = t0.numel() * t0.element_size()
        if not nbytes:
            return None
        start = t0.data_ptr()
        for i, t in enumerate(tensors):
            if t.layout != _STRIDED or t.dtype != t0.dtype or t.shape != t0.shape \
                    or not t.is_contiguous() or t.data_ptr() != start + i * nbytes \
                    or t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr():
                return None
        if avoid is not None:
            lo, hi = avoid.data_ptr(), avoid.data_ptr() + avoid.numel() * avoid.element_size()
            if lo < start + len(tensors) * nbytes and start < hi:
                return None
        whole = t0.as_strided((len(tensors), t0.numel()), (t0.numel(), 1))
        return whole.view((len(tensors),) + tuple(t0.shape))
    except (RuntimeError, TypeError, ValueError):
        return None


def _view(t):
    """A numpy view of a CPU tensor's memory (a tensor that requires grad: of its detach();
    bfloat16 as ml_dtypes.bfloat16)."""
    if isinstance(t, _Tensor) and t.layout != _STRIDED:
        raise ValueError(f"shmtree: the shmtree backend takes strided tensors here, got "
                         f"{t.layout}")
    return _strided_view(t)


def _strided_view(t):
    """_view of a tensor known to be strided."""
    if not isinstance(t, _Tensor):
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
        raise _invalid(what, f"invalid tensor size: the output tensor has {t.numel()} elements "
                             f"(shape {tuple(t.shape)}), expected {n}")
    try:
        return _view(t.detach().view(shape)), None
    except RuntimeError:                          # (no view of that shape over t's strides)
        tmp = torch.empty(shape, dtype=t.dtype)
        return _view(tmp), lambda: t.detach().copy_(tmp.view(t.shape))


def _flat(t):
    """t's elements in order, as a 1-d tensor (a view when t is contiguous)."""
    return t.detach().reshape(-1)


def _bytes(t):
    """t's elements as a contiguous 1-d uint8 tensor (a view when t is contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


_ALIGN = 16                     # pieces packed into one byte buffer start at multiples of this


def _packed(tensors):
    """(a contiguous uint8 tensor holding each tensor's bytes, each piece starting at a
    multiple of _ALIGN; the pieces' (offset, nbytes))."""
    pieces, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        pieces.append((offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    buf = torch.empty(max(offset, _ALIGN), dtype=torch.uint8)
    for t, (off, nbytes) in zip(tensors, pieces):
        if nbytes:
            buf[off:off + nbytes].copy_(_bytes(t))
    return buf, pieces


def _unpacked(buf, offset, nbytes, like):
    """The tensor of `like`'s dtype and shape over bytes [offset, offset+nbytes) of buf."""
    if nbytes == 0:
        return torch.empty(like.shape, dtype=like.dtype)
    return buf[offset:offset + nbytes].view(like.dtype).view(like.shape)


_LOCAL = {"sum": torch.Tensor.add_, "avg": torch.Tensor.add_, "prod": torch.Tensor.mul_,
          "band": torch.Tensor.bitwise_and_, "bor": torch.Tensor.bitwise_or_,
          "bxor": torch.Tensor.bitwise_xor_}


def _reduced_locally(tensors, op):
    """The elementwise reduction of the tensors of one rank's list (gloo reduces a list of
    several tensors locally, then across the ranks): a new contiguous tensor."""
    acc = tensors[0].detach().clone(memory_format=torch.contiguous_format)
    for t in tensors[1:]:
        t = t.detach()
        if op == "min":
            torch.minimum(acc, t, out=acc)
        elif op == "max":
            torch.maximum(acc, t, out=acc)
        elif acc.dtype == torch.bool and op in ("sum", "avg"):
            acc.logical_or_(t)
        elif acc.dtype == torch.bool and op == "prod":
            acc.logical_and_(t)
        else:
            _LOCAL[op](acc, t)
    return acc


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

    _recv_from = None                   # a recv's: its source rank, or ANY_SOURCE

    def __init__(self, requests, source, future, pg):
        super().__init__()
        self._requests, self._source, self._future = requests, source, future
        self._pg = pg
        self._error = None              # the failure, set before the source completes

    def _source_rank(self):
        """A recv's source rank: the one it named, or (recv_anysource) the sender's once it is
        done (-1 before, as gloo's); any other operation's: torch's error."""
        src = self._recv_from
        if src is None:
            return super()._source_rank()
        if src != ANY_SOURCE:
            return src
        req = self._requests[-1] if self._requests else None
        status = getattr(req, "status", None) if req is not None and req.done() else None
        return -1 if status is None else status.source

    source_rank = _source_rank

    def wait(self, timeout=None):
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) \
            else timeout
        try:
            self._requests[-1].exception(seconds or None)     # (0: torch's "no timeout")
        except (TimeoutError, concurrent.futures.TimeoutError):     # (one type from 3.11)
            raise RuntimeError(f"shmtree: the operation is not done after {seconds} s "
                               "(Work.wait timed out; it is still running)") from None
        self._source.wait()             # (its completion has run)
        try:
            # and the future's own value is made: the then() of the source runs in the thread
            # that completed it, possibly after the source's waiters were woken
            self._future.wait()
        except Exception:
            if self._error is None:
                raise
        if self._error is not None:
            self._pg._seen(self._error)
            raise _raised(self._error)
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


class _FailedWork(dist.Work):
    """The Work of an operation that ran at once and failed (a mismatch, a dead peer, a
    timeout): wait() raises its failure and its future is failed (a Work made from a failed
    torch future would report success from wait())."""

    def __init__(self, error, pg):
        super().__init__()
        self._error, self._pg = error, pg
        self._future = Future()
        self._future.set_exception(error)

    def wait(self, timeout=None):
        self._pg._seen(self._error)
        raise _raised(self._error)

    def get_future(self):
        return self._future

    def is_completed(self):
        return True

    def is_success(self):
        return False

    def exception(self):
        return self._error

    def result(self):
        self.wait()

    def synchronize(self):
        pass


class _DoneWork(dist.Work):
    """The Work of an operation done at once: its future (made when asked for: most callers,
    torch.distributed's blocking functions, only wait) holds `value`."""

    def __init__(self, value):
        super().__init__()
        self._value = value
        self._future = None

    def wait(self, timeout=None):
        return True

    def get_future(self):
        fut = self._future
        if fut is None:                           # (torch's C++ Future, which a Work made from
            fut = self._future = _CFuture([])     # a future gives too: the Python subclass's
            fut.set_result(self._value)           # methods cost more)
        return fut

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def exception(self):
        return None

    def result(self):
        return self._value

    def synchronize(self):
        pass


_done = _DoneWork


class _LazyRecvWork(dist.Work):
    """The Work of a small recv (ProcessGroupShmtree.recv): held back until waited for (then
    received in the waiting thread, blocking: shmtree's recv) or until anything else needs it
    posted (then a _PostedWork, which this one forwards to)."""

    def __init__(self, pg, t, buf, src, tag):
        super().__init__()
        self._pg, self._t, self._buf, self._src, self._tag = pg, t, buf, src, tag
        self._posted = None             # the _PostedWork, once posted
        self._done = False              # received here
        self._error = None              # posting it failed (raised by wait)
        self._got_from = -1             # the sender's rank, once received here

    def _post(self):                    # (under the group's _issuing; by _post_lazy)
        comm, buf, src, tag, t = self._pg._comm, self._buf, self._src, self._tag, self._t
        try:
            self._posted = self._pg._p2p_post(lambda: comm.irecv(src, tag=tag, out=buf),
                                              lambda: [t])
            self._posted._recv_from = src
        except RuntimeError as exc:     # (not the failure of whatever made it post)
            self._error = exc

    def _source_rank(self):
        """The sender's rank (gloo's: -1 until received; a recv that named it: that one)."""
        if self._posted is not None:
            return self._posted._source_rank()
        if self._src != ANY_SOURCE:
            return self._src
        return self._got_from

    source_rank = _source_rank

    def _posted_work(self):
        pg = self._pg
        if self._posted is None and not self._done:
            with pg._issuing:
                if pg._lazy is self:
                    pg._post_lazy()
        return self._posted

    def wait(self, timeout=None):
        if timeout is not None:                  # (a wait that may give up: posted)
            self._posted_work()
        pg = self._pg
        if self._posted is None and self._error is None and not self._done:
            with pg._issuing:
                if pg._lazy is self:             # (else posted meanwhile, by another thread)
                    pg._lazy = None
                    status = Status()
                    try:
                        pg._comm.recv(self._src, tag=self._tag, out=self._buf, status=status)
                    except Exception as exc:
                        raise _failed(pg._comm.rank, exc) from None
                    self._got_from = status.source
                    self._done = True
                    return True
        if self._error is not None:
            raise self._error
        if self._posted is not None:
            return self._posted.wait(timeout)
        return True

    def get_future(self):
        posted = self._posted_work()
        if posted is not None:
            return posted.get_future()
        if self._error is not None:
            fut = Future()
            fut.set_exception(self._error)
            return fut
        return _DoneWork([self._t]).get_future()

    def is_completed(self):
        posted = self._posted_work()
        return posted.is_completed() if posted is not None else True

    def is_success(self):
        posted = self._posted_work()
        return posted.is_success() if posted is not None else self._error is None

    def exception(self):
        posted = self._posted_work()
        return posted.exception() if posted is not None else self._error

    def result(self):
        self.wait()
        return [self._t]

    def synchronize(self):
        pass


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
            return self._work([_call(calls.allreduce, self._comm, a,
                                     "sum" if red == "avg" else red, out=a, timeout=secs)],
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
        return self._work([_call(calls.allreduce, self._comm, a, "sum" if red == "avg" else red,
                                 out=a, timeout=secs)], a.nbytes, finish)

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
                                 out=a if comm.rank == root else None, timeout=secs)],
                          a.nbytes, lambda: self._divide(tensors, red, comm.rank == root))

    def allgather(self, output_tensors, input_tensors, opts=None, *args, **kwargs):
        """allgather(output_lists, input_tensors, opts) and allgather(output_tensors,
        input_tensor, timeout=None).  n inputs fill each of n output lists of n*size tensors:
        rank r's input j is entry r*n+j (gloo's); the future's value is the one output list
        for n = 1, the list of them otherwise."""
        what = "allgather"
        if type(opts) is not _AllgatherOptions or args or kwargs:
            opts = _form(opts, args, kwargs, _AllgatherOptions, what, (_TIMEOUT,))
        if isinstance(input_tensors, _Tensor):     # the convenience form
            output_tensors, input_tensors = [_tensors(output_tensors, what, "output_tensors")], \
                [input_tensors]
        else:
            output_tensors = _tensor_lists(output_tensors, what, "output_tensors")
            input_tensors = _tensors(input_tensors, what, "input_tensors")
        secs = _seconds(opts.timeout, self._timeout)
        comm, size = self._comm, self._comm.size
        n = len(input_tensors)
        if n == 0:
            raise _invalid(what, "requires non-empty input tensor list")
        if len(output_tensors) != n:
            raise _invalid(what, "requires input/output tensor lists to have the same length")
        for i, outs in enumerate(output_tensors):
            if len(outs) != n * size:
                raise _invalid(what, f"invalid output tensor list at index {i} (expected length "
                                     f"{n * size}, got {len(outs)})")
        _check_dense(what, input_tensors)
        _check_match(what, input_tensors)
        first = input_tensors[0]
        bad = None                      # outputs that do not fit the input (said below)
        for outs in output_tensors:
            _check_dense(what, outs)
            try:
                _check_match(what, outs, first.dtype, first.shape)
            except RuntimeError as exc:
                bad = bad or exc
        if n == 1:
            a = _view(first)
        else:
            for t in input_tensors:
                _view(t)
            a = _view(torch.stack([t.detach() for t in input_tensors]))
        if bad is not None:
            raise self._gather_refused(bad, a, secs, first)
        gathered = torch.empty((size,) + tuple(a.shape), dtype=first.dtype)
        g = _view(gathered)
        every = gathered.view((size * n,) + tuple(first.shape))

        def finish():
            for outs in output_tensors:
                for k, o in enumerate(outs):
                    o.detach().copy_(every[k])
            return output_tensors[0] if n == 1 else output_tensors
        return self._work([_call(calls.allgather, comm, a, out=g, timeout=secs)], g.nbytes,
                          finish)

    def _allgather_base(self, output, input, opts=None):
        """all_gather_into_tensor: output holds size copies' room, dim 0 rank-major."""
        what = "all_gather_into_tensor"
        comm, size = self._comm, self._comm.size
        secs = _seconds(getattr(opts, "timeout", None), self._timeout)
        if output.dtype != input.dtype:
            raise self._gather_refused(
                _invalid(what, f"invalid tensor type at index 0 (expected {input.dtype}, got "
                               f"{output.dtype})"), _view(input), secs, input)
        if output.numel() != size * input.numel():
            raise self._gather_refused(
                _invalid(what, f"invalid tensor size at index 0 (expected {size} x "
                               f"{_size_text(input)}, got {_size_text(output)})"),
                _view(input), secs, input)
        out, put = _shaped(output, (size,) + tuple(input.shape), what)

        def finish():
            if put is not None:
                put()
            return list(output.chunk(size)) if output.dim() else [output]
        return self._work([_call(calls.allgather, comm, _view(input), out=out, timeout=secs)],
                          out.nbytes, finish)

    def _gather_refused(self, error, a, secs, like):
        """An all_gather whose outputs do not fit this rank's input `a` (error: gloo's
        RuntimeError for that; returned to raise, an ArgumentError with its words).  The input
        is gathered all the same first, into a temporary (blocking): the other ranks'
        all_gather takes part with it, so none waits for this rank, and the error says what
        every rank passed - when their inputs differ (tensor sizes that differ by rank) every
        rank's all_gather fails naming each rank's shape and dtype, and so does this one's
        error; else it names the one shape and dtype they share."""
        comm = self._comm
        self._check_failed()
        tmp = np.empty((comm.size,) + tuple(a.shape), a.dtype)
        theirs = None
        with self._issuing:
            self._post_lazy()
            try:
                _call(calls.allgather, comm, a, out=tmp, timeout=secs)(True)()
            except CollectiveMismatchError as exc:
                theirs = exc
            except Exception as exc:              # (a dead peer, a timeout: said with it)
                return RuntimeError(f"{error} (and gathering every rank's input to compare "
                                    f"failed: {type(exc).__name__}: {exc})")
        if theirs is not None:
            said = str(theirs).split("ranks disagree on the collective call: ", 1)[-1]
            return ArgumentError(f"{error}: all_gather takes tensors of one shape and dtype on "
                                 f"every rank, and the ranks' differ: {said}")
        return ArgumentError(f"{error} (every rank's input has shape {_size_text(like)} and "
                             f"dtype {like.dtype}: each output tensor must have them)")

    def _said(self, error, kind, name, secs):
        """A local error of an operation that the other ranks make with arguments that may
        be right (error: returned, to raise): said in the call's round first (their call then
        raises a CollectiveMismatchError naming this rank's error: none waits for this rank;
        ranks that all made an error each raise their own)."""
        comm = self._comm
        if comm.size > 1 and not self._group.aborted():
            spec = calls.CallSpec(name, getattr(calls, name.upper()), kind, error=error,
                                  timeout=secs, deadline=calls.deadline_of(secs))
            with self._issuing:
                self._post_lazy()
                try:
                    comm._start(spec)             # (raises `error`, once said)
                except Exception:
                    pass
        return error

    def reduce_scatter(self, output_tensors, input_tensors, opts=None, *args, **kwargs):
        """reduce_scatter(outputs, input_lists, opts) and reduce_scatter(output, inputs,
        op=SUM, timeout=None): rank r's output gets the reduction of every rank's inputs[r];
        the inputs' sizes may differ (rank r's output has inputs[r]'s)."""
        what = "reduce_scatter"
        if type(opts) is not _ReduceScatterOptions or args or kwargs:
            opts = _form(opts, args, kwargs, _ReduceScatterOptions, what, (_OP, _TIMEOUT))
        if isinstance(output_tensors, _Tensor):    # the convenience form
            output_tensors, input_tensors = [output_tensors], [_tensors(input_tensors, what)]
        else:
            output_tensors = _tensors(output_tensors, what, "output_tensors")
            input_tensors = _tensor_lists(input_tensors, what, "input_tensors")
        red = _op(opts.reduceOp)
        secs = _seconds(opts.timeout, self._timeout)
        comm, size, rank = self._comm, self._comm.size, self._comm.rank
        if len(output_tensors) != 1:
            raise _invalid(what, "reduce_scatter only supports 1 output")
        if len(input_tensors) != 1:
            raise _invalid(what, "requires input/output tensor lists to have the same length")
        out, parts = output_tensors[0], input_tensors[0]
        if len(parts) != size:
            raise _invalid(what, "invalid input tensor list size, must be world size")
        _check_dense(what, [out] + parts)
        for i, p in enumerate(parts):
            if p.dtype != out.dtype:
                raise _invalid(what, f"invalid tensor type at index {i} (expected {out.dtype}, "
                                     f"got {p.dtype})")
        if out.numel() != parts[rank].numel():
            raise _invalid(what, f"invalid tensor size: the output has {out.numel()} elements, "
                                 f"this rank's input {parts[rank].numel()}")
        _check_avg(red, [out], what)
        for p in parts:
            _view(p)
        counts = [p.numel() for p in parts]
        base = "sum" if red == "avg" else red
        if len(set(counts)) == 1:
            whole = torch.cat([_flat(p) for p in parts])
            o, put = _shaped(out, (out.numel(),), what)
        else:                                     # uneven: each part padded to the longest
            longest = max(counts)
            whole = torch.zeros((size, longest), dtype=out.dtype)
            for k, p in enumerate(parts):
                whole[k, :counts[k]] = _flat(p)
            block = torch.empty((1, longest), dtype=out.dtype)
            o = _view(block)

            def put():
                out.detach().copy_(block[0, :counts[rank]].view(out.shape))
        w = _view(whole)

        def finish():
            if put is not None:
                put()
            return self._divide(output_tensors, red)
        return self._work([_call(calls.reduce_scatter, comm, w, base, out=o, timeout=secs)],
                          w.nbytes, finish)

    def _reduce_scatter_base(self, output, input, opts=None):
        """reduce_scatter_tensor: input holds size blocks of output's size, dim 0 rank-major."""
        what = "reduce_scatter_tensor"
        if type(opts) is not _ReduceScatterOptions:
            opts = _form(opts, (), {}, _ReduceScatterOptions, what, (_OP, _TIMEOUT))
        red, comm = _op(opts.reduceOp), self._comm
        if output.dtype != input.dtype:
            raise _invalid(what, f"invalid tensor type (expected {input.dtype}, got "
                                 f"{output.dtype})")
        if input.numel() != comm.size * output.numel():
            raise _invalid(what, f"invalid tensor size: the input has {input.numel()} elements, "
                                 f"expected {comm.size} x {output.numel()}")
        _check_avg(red, [output], what)
        a = _view(input).reshape(comm.size, -1) if input.is_contiguous() \
            else _view(input.reshape(comm.size, -1))
        out, put = _shaped(output, (1, output.numel()), what)

        def finish():
            if put is not None:
                put()
            return self._divide([output], red)
        return self._work([_call(calls.reduce_scatter, comm, a, "sum" if red == "avg" else red,
                                 out=out, timeout=_seconds(opts.timeout, self._timeout))],
                          a.nbytes, finish)

    all_gather_single = _allgather_base          # (the names torch >= 2.10 calls)
    reduce_scatter_single = _reduce_scatter_base

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

    # ---- the coalesced forms: one collective for the whole list ----

    def allreduce_coalesced(self, tensors, opts=None):
        """Each tensor reduced over the ranks (elementwise, each on its own: not together as
        allreduce's list), as one collective."""
        what = "allreduce_coalesced"
        if type(opts) is not _AllreduceCoalescedOptions:
            opts = _form(opts, (), {}, _AllreduceCoalescedOptions, what, (_OP, _TIMEOUT))
        tensors = _tensors(tensors, what)
        if not tensors:
            raise _invalid(what, "requires non-empty tensor list")
        for i, t in enumerate(tensors):
            if t.layout != tensors[0].layout:
                raise _invalid(what, f"invalid tensor layout at index {i} (expected "
                                     f"{_layout_name(tensors[0])}, got {_layout_name(t)})")
        if any(t.dtype != tensors[0].dtype for t in tensors):
            raise _invalid(what, "tensors must all have the same type")
        if tensors[0].layout != _STRIDED:
            raise _invalid(what, "unsupported layout")
        red = _op(opts.reduceOp)
        _check_avg(red, tensors, "all_reduce_coalesced")
        for t in tensors:
            _view(t)
        flat = torch.cat([_flat(t) for t in tensors])
        a = _view(flat)

        def finish():
            if red == "avg":
                flat.div_(self._comm.size)
            for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
                t.detach().copy_(piece.view(t.shape))
            return tensors
        return self._work([_call(calls.allreduce, self._comm, a, "sum" if red == "avg" else red,
                                 out=a, timeout=_seconds(opts.timeout, self._timeout))],
                          a.nbytes, finish)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """output_lists[r][j] gets rank r's input_list[j]: one allgather of their bytes."""
        what = "allgather_coalesced"
        output_lists = _tensor_lists(output_lists, what, "output_lists")
        inputs = _tensors(input_list, what, "input_list")
        size = self._comm.size
        if not inputs:
            raise _invalid(what, "requires non-empty input tensor list")
        if len(output_lists) != size:
            raise _invalid(what, "output lists should be equal to world size")
        for outs in output_lists:
            if len(outs) != len(inputs):
                raise _invalid(what, f"invalid output size: (expected length {len(inputs)}, "
                                     f"got {len(outs)})")
            for i, (o, t) in enumerate(zip(outs, inputs)):
                if o.dtype != t.dtype:
                    raise _invalid(what, f"invalid tensor type at index {i} (expected "
                                         f"{t.dtype}, got {o.dtype})")
                if o.shape != t.shape:
                    raise _invalid(what, f"invalid size of output tensor at index {i} "
                                         f"(expected length {_size_text(t)}, got "
                                         f"{_size_text(o)})")
        _check_dense(what, inputs)
        for t in inputs:
            _view(t)

        def place(gathered, pieces):
            for r, outs in enumerate(output_lists):
                for o, (off, nb) in zip(outs, pieces):
                    o.detach().copy_(_unpacked(gathered[r], off, nb, o))
            return output_lists
        return self._gather_bytes(inputs, place, getattr(opts, "timeout", None))

    def _gather_bytes(self, inputs, place, timeout):
        """One allgather of the inputs' bytes (any dtypes, packed); place(gathered, pieces)
        writes the outputs from the (size, nbytes) uint8 result and gives the value."""
        blob, pieces = _packed(inputs)
        gathered = torch.empty((self._comm.size, blob.numel()), dtype=torch.uint8)
        g = _view(gathered)
        return self._work([_call(calls.allgather, self._comm, _view(blob), out=g,
                                 timeout=_seconds(timeout, self._timeout))], g.nbytes,
                          lambda: place(gathered, pieces))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        """all_gather_into_tensor of each pair, as one allgather."""
        what = "allgather_into_tensor_coalesced"
        outputs, inputs = _tensors(outputs, what, "outputs"), _tensors(inputs, what, "inputs")
        size = self._comm.size
        _check_pairs(what, outputs, inputs, size, True)
        for t in inputs + outputs:
            _view(t)

        def place(gathered, pieces):
            for o, t, (off, nb) in zip(outputs, inputs, pieces):
                whole = torch.stack([_unpacked(gathered[r], off, nb, t) for r in range(size)])
                o.detach().copy_(whole.view(o.shape))
            return [[o.chunk(size)[r] if o.dim() else o for o in outputs] for r in range(size)]
        return self._gather_bytes(inputs, place, getattr(opts, "timeout", None))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        """reduce_scatter_tensor of each pair: one reduce_scatter per dtype."""
        what = "reduce_scatter_tensor_coalesced"
        if type(opts) is not _ReduceScatterOptions:
            opts = _form(opts, (), {}, _ReduceScatterOptions, what, (_OP, _TIMEOUT))
        outputs, inputs = _tensors(outputs, what, "outputs"), _tensors(inputs, what, "inputs")
        comm, size = self._comm, self._comm.size
        _check_pairs(what, outputs, inputs, size, False)
        red = _op(opts.reduceOp)
        _check_avg(red, outputs, what)
        for t in inputs + outputs:
            _view(t)
        secs = _seconds(opts.timeout, self._timeout)
        groups = {}
        for i, o in enumerate(outputs):
            groups.setdefault(o.dtype, []).append(i)
        made, blocks, nbytes = [], [], 0
        for dtype, which in groups.items():
            whole = torch.cat([inputs[i].detach().reshape(size, -1) for i in which], dim=1)
            block = torch.empty((1, whole.shape[1]), dtype=dtype)
            blocks.append((which, block))
            w = _view(whole)
            nbytes += w.nbytes
            made.append(_call(calls.reduce_scatter, comm, w, "sum" if red == "avg" else red,
                              out=_view(block), timeout=secs))

        def finish():
            for which, block in blocks:
                pieces = block[0].split([outputs[i].numel() for i in which])
                for i, piece in zip(which, pieces):
                    outputs[i].detach().copy_(piece.view(outputs[i].shape))
            return self._divide(outputs, red)
        return self._work(made, nbytes, finish)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # ---- gather, scatter, all_to_all: shmtree's gather, scatter and alltoall ----

    def gather(self, output_tensors, input_tensors, opts=None, *args, **kwargs):
        """gather(output_lists, inputs, opts) and gather(outputs, input, root, timeout=None):
        the root's output_lists[0][r] gets rank r's inputs[0]; the others pass no output
        (gloo's checks).  One shmtree gather; the future's value is the output lists on the
        root, [] elsewhere."""
        what = "gather"
        if type(opts) is not _GatherOptions or args or kwargs:
            opts = _form(opts, args, kwargs, _GatherOptions, what, (_ROOT, _TIMEOUT))
        comm, size, rank = self._comm, self._comm.size, self._comm.rank
        root = opts.rootRank
        if isinstance(input_tensors, _Tensor):     # the convenience form
            outs = _tensors(output_tensors, what, "output_tensors") \
                if output_tensors is not None else []
            output_tensors, input_tensors = ([outs] if outs or rank == root else []), \
                [input_tensors]
        else:
            output_tensors = _tensor_lists(output_tensors, what, "output_tensors")
            input_tensors = _tensors(input_tensors, what, "input_tensors")
        _check_root(what, root, size)
        if len(input_tensors) != 1:
            raise _invalid(what, "requires a single-element input tensor list")
        _check_dense(what, input_tensors)
        inp = input_tensors[0]
        if rank == root:
            _check_root_list(what, output_tensors, "output", ".", size, inp)
        elif output_tensors:
            raise _invalid(what, "requires empty output on non-root")
        a = _view(inp)
        gathered = direct = None
        if rank == root:                           # (into the outputs when they are one
            direct = _blocks_of_one(output_tensors[0], avoid=inp)   # buffer's blocks)
            gathered = direct if direct is not None else \
                torch.empty((size,) + tuple(inp.shape), dtype=inp.dtype)

        def finish():
            if gathered is None:
                return []
            if direct is None:
                for r, o in enumerate(output_tensors[0]):
                    o.detach().copy_(gathered[r])
            return output_tensors[0]
        return self._work([_call(calls.gather, comm, a, root,
                                 out=_view(gathered) if gathered is not None else None,
                                 timeout=_seconds(opts.timeout, self._timeout))],
                          a.nbytes * (size if rank == root else 1), finish)

    def scatter(self, output_tensors, input_tensors, opts=None, *args, **kwargs):
        """scatter(outputs, input_lists, opts) and scatter(output, inputs, root, timeout=None):
        rank r's outputs[0] gets the root's input_lists[0][r]; the others pass no input (gloo's
        checks).  One shmtree scatter; the future's value is the outputs."""
        what = "scatter"
        if type(opts) is not _ScatterOptions or args or kwargs:
            opts = _form(opts, args, kwargs, _ScatterOptions, what, (_ROOT, _TIMEOUT))
        comm, size, rank = self._comm, self._comm.size, self._comm.rank
        root = opts.rootRank
        if isinstance(output_tensors, _Tensor):    # the convenience form
            ins = _tensors(input_tensors, what, "input_tensors") \
                if input_tensors is not None else []
            output_tensors, input_tensors = [output_tensors], \
                ([ins] if ins or rank == root else [])
        else:
            output_tensors = _tensors(output_tensors, what, "output_tensors")
            input_tensors = _tensor_lists(input_tensors, what, "input_tensors")
        _check_root(what, root, size)
        if len(output_tensors) != 1:
            raise _invalid(what, "requires a single-element output tensor list")
        _check_dense(what, output_tensors)
        out_t = output_tensors[0]
        whole = None
        if rank == root:
            _check_root_list(what, input_tensors, "input", "", size, out_t)
            whole = _blocks_of_one(input_tensors[0])     # (one buffer's blocks: no copy)
            if whole is None:
                whole = torch.stack([t.detach() for t in input_tensors[0]])
        elif input_tensors:
            raise _invalid(what, "requires empty input on non-root")
        out, put = _shaped(out_t, tuple(out_t.shape), what)

        def finish():
            if put is not None:
                put()
            return output_tensors
        return self._work([_call(calls.scatter, comm, _view(whole) if whole is not None
                                 else None, root, out=out,
                                 timeout=_seconds(opts.timeout, self._timeout))],
                          out.nbytes * (size if rank == root else 1), finish)

    def alltoall_base(self, output, input, output_split_sizes=None, input_split_sizes=None,
                      opts=None):
        """all_to_all_single: input's dim 0 split among the ranks (equally, or by
        input_split_sizes), output's dim 0 filled in source-rank order (equally, or by
        output_split_sizes).  Equal splits: one shmtree alltoall of (size, block) views;
        uneven: alltoall(counts=) of the rows (dim 0)."""
        what = "alltoall_base"
        comm, size = self._comm, self._comm.size
        out_s = [int(n) for n in (output_split_sizes or [])]
        in_s = [int(n) for n in (input_split_sizes or [])]
        secs = _seconds(getattr(opts, "timeout", None), self._timeout)
        try:                            # (each rank sees only its own: said in the round)
            _check_dense(what, [output])
            _check_dense(what, [input])
            if output.dtype != input.dtype:
                raise _invalid(what, f"invalid tensor type (expected {input.dtype}, got "
                                     f"{output.dtype})")
            if input.dim() == 0 or output.dim() == 0:
                raise _invalid(what, "the input and the output need at least one dimension")
            if not input.is_contiguous():
                raise _invalid_value(what, "Tensors must be contiguous (the input is not: as "
                                           "gloo, all_to_all_single takes a contiguous input; "
                                           "pass input.contiguous())")
            _check_splits(what, in_s, input, size, "input")
            _check_splits(what, out_s, output, size, "output")
            if not in_s and not out_s and output.numel() != input.numel():
                raise _invalid(what, f"invalid tensor size: the output has {output.numel()} "
                                     f"elements, the input {input.numel()}")
        except (RuntimeError, ValueError) as exc:
            raise self._said(exc, KIND_ALLTOALL, "alltoall", secs) from None
        inner = 1
        for n in input.shape[1:]:
            inner *= int(n)
        if not in_s and not out_s:
            a = _view(input).reshape(size, -1)
            out, put = _shaped(output, (size, output.numel() // size), what)
            counts = None
        else:
            rows = int(input.shape[0])
            counts = in_s or [rows // size] * size
            a = _view(input).reshape(rows, inner)
            out, put = _shaped(output, (int(output.shape[0]), inner), what)

        def finish():
            if put is not None:
                put()
            return [output]
        return self._work([_call(calls.alltoall, comm, a, counts, out=out, timeout=secs)],
                          max(a.nbytes, out.nbytes), finish)

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """all_to_all of lists: rank r's output_tensors[s] gets rank s's input_tensors[r] (any
        sizes, one dtype): one shmtree alltoall(counts=) of the elements."""
        what = "alltoall"
        comm, size = self._comm, self._comm.size
        outputs = _tensors(output_tensors, what, "output_tensors")
        inputs = _tensors(input_tensors, what, "input_tensors")
        if len(inputs) != size or len(outputs) != size:
            raise _invalid(what, f"requires input and output lists of the group's size {size} "
                                 f"(got {len(inputs)} inputs, {len(outputs)} outputs)")
        _check_dense(what, inputs)
        _check_dense(what, outputs)
        dtype = inputs[0].dtype
        for i, t in enumerate(inputs + outputs):
            if not isinstance(t, _Tensor):
                raise TypeError(f"shmtree: ProcessGroupShmtree.{what}: expected a torch.Tensor, "
                                f"got {type(t).__name__}")
            if t.dtype != dtype:
                raise _invalid(what, f"invalid tensor type at index {i % size} (expected "
                                     f"{dtype}, got {t.dtype})")
            _view(t)
        flat = torch.cat([_flat(t) for t in inputs])
        got = torch.empty(sum(o.numel() for o in outputs), dtype=dtype)
        g = _view(got)

        def finish():
            for o, piece in zip(outputs, got.split([o.numel() for o in outputs])):
                o.detach().copy_(piece.view(o.shape))
            return outputs
        return self._work([_call(calls.alltoall, comm, _view(flat),
                                 [t.numel() for t in inputs], out=g,
                                 timeout=_seconds(getattr(opts, "timeout", None),
                                                  self._timeout))],
                          max(g.nbytes, flat.numel() * flat.element_size()), finish)

    # ---- point-to-point: shmtree's messages (isend / irecv), always posted ----

    def send(self, tensors, dstRank, tag=0):
        """send([tensor], dst, tag): the tensor's bytes, as one shmtree message; the Work is
        done once the message is out (the tensor may then change).  A small message that fits
        in the channel's ring now, with nothing else on its way to dst, is written there at
        once (done: no hand-off to the progress thread); any other is posted (isend)."""
        t, tag = _single_p2p("send", tensors, tag)
        buf = _p2p_bytes(t)
        comm = self._comm
        if buf.nbytes <= QUICK_P2P_BYTES:
            self._check_failed()
            with self._issuing:
                self._post_lazy()
                try:
                    sent = comm._p2p().quick_send(buf, _rank_arg(comm, dstRank, "dest"), tag)
                except Exception as exc:          # (torch's C++ takes RuntimeErrors)
                    raise RuntimeError(f"{type(exc).__name__}: {exc}") from None
            if sent:
                return _DoneWork([t])
        return self._p2p(lambda: comm.isend(buf, dstRank, tag=tag), lambda: [t])

    def recv(self, tensors, srcRank, tag=0):
        """recv([tensor], src, tag): the next message from src with that tag, into the tensor
        (as many bytes as it holds: a sender's dtype or shape may differ, as with gloo).
        A small one (at most QUICK_P2P_BYTES) is not posted at once: its Work receives it in
        the caller's thread when waited for with no timeout (dist.recv: no hand-offs between
        threads), and posts it (irecv) the moment anything else is asked of it or of this
        process group (another operation, get_future, is_completed, a wait with a timeout):
        so at most one receive is held back, and a sender never waits for it (its message
        fits in the ring once the receives before it are posted)."""
        t, tag = _single_p2p("recv", tensors, tag)
        try:
            src = _rank_arg(self._comm, srcRank, "source")
        except (TypeError, ValueError) as exc:  # (torch's C++ takes RuntimeErrors)
            raise RuntimeError(f"{type(exc).__name__}: {exc}") from None
        return self._recv(t, src, tag)

    def recv_anysource(self, tensors, tag=0):
        """recv_anysource([tensor], tag) (torch.distributed.recv / irecv with src=None): the
        next message with that tag from any rank, into the tensor, as recv's; the Work's
        _source_rank() is the sender's rank once it is done (-1 before, as gloo's).  Messages
        of one sender arrive in the order sent; receives match in the order they were issued
        (shmtree's ANY_SOURCE)."""
        t, tag = _single_p2p("recv_anysource", tensors, tag)
        return self._recv(t, ANY_SOURCE, tag)

    def _recv(self, t, src, tag):
        """recv and recv_anysource (src: a rank or ANY_SOURCE, checked)."""
        buf = _p2p_bytes(t)
        comm = self._comm
        if buf.nbytes <= QUICK_P2P_BYTES:
            self._check_failed()
            with self._issuing:
                self._post_lazy()
                self._lazy = work = _LazyRecvWork(self, t, buf, src, tag)
            return work
        work = self._p2p(lambda: comm.irecv(src, tag=tag, out=buf), lambda: [t])
        work._recv_from = src
        return work

    def _post_lazy(self):
        """Post the held-back small receive, if any (under self._issuing)."""
        lazy = self._lazy
        if lazy is not None:
            self._lazy = None
            lazy._post()

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

    def _p2p(self, start, finish):
        """A message, posted: start() gives its Request (shmtree's isend / irecv); the Work's
        future gets finish()'s value once it is done.  Never blocking: batch_isend_irecv's
        sends and receives are issued one after the other before anyone waits."""
        self._check_failed()
        with self._issuing:
            self._post_lazy()
            return self._p2p_post(start, finish)

    def _p2p_post(self, start, finish):
        """_p2p's posting (under self._issuing)."""
        source = Future()
        requests = []
        work = _PostedWork(requests, source, source.then(_settle), self)
        complete = self._completion(work, requests, source, finish)
        try:
            requests.append(start())
        except Exception as exc:                  # (torch's C++ takes RuntimeErrors)
            raise RuntimeError(f"{type(exc).__name__}: {exc}") from None
        requests[-1].add_done_callback(lambda _: self._complete(complete))
        return work

    _start_coalescing = _unsupported("_start_coalescing",
                                     "coalescing by device (_coalescing_manager with a device; "
                                     "batch_isend_irecv runs its operations one by one)")
    _end_coalescing = _unsupported("_end_coalescing",
                                   "coalescing by device (_coalescing_manager with a device; "
                                   "batch_isend_irecv runs its operations one by one)")

    # ---- failures (issue 38): abort, the error state, shrink_group's equivalent ----

    def abort(self):
        """Revoke the group - every pending and later operation of every rank fails at once
        (shmtree's comm.revoke(): a RuntimeError naming the rank that aborted) - and shut this
        rank's side down.  Never blocks on the other ranks."""
        try:
            if not self._comm._closed and not self._group.closed:
                self._comm.revoke()
        finally:
            self.shutdown()

    def get_error(self):
        """The group's error state, as torch's C++ backends give it (ErrorType): SUCCESS while
        it is healthy; TIMEOUT when this rank's operation timed out; REMOTE_ERROR when another
        rank died, failed, timed out or revoked the group; COMM_ERROR when this rank's own
        operation failed it, or the group is shut down."""
        E = _c10d.ErrorType
        if self._stopped or self._group.closed:
            return E.COMM_ERROR
        reason, who = self._group._seg.abort_state()
        if not reason:
            return E.SUCCESS if self._failure is None else E.COMM_ERROR
        mine = who == self._comm.rank
        if reason == ABORT_TIMEOUT:
            return E.TIMEOUT if mine else E.REMOTE_ERROR
        return E.COMM_ERROR if mine else E.REMOTE_ERROR

    @property
    def supports_shrinking(self):
        """False: torch's shrink_group works on C++ backends only (ProcessGroup._get_backend);
        use shmtree.torch.shrink_group, which makes the survivors' group with new_group."""
        return False

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


def _call(parse, comm, *args, **kwargs):
    """A call, as _work makes it: call(True) parses it (parse: calls.allreduce, ...; the
    CallSpec every way into a collective builds; its argument errors raise here) and gives
    the step that runs it blocking, call(False) the step that posts it (a Request): both
    through the front end's one dispatch (Front._start: a rooted call's local error is said
    to the other ranks before it is raised, as the communicator's methods do)."""
    def call(now):
        spec = parse(comm, *args, posted=not now, **kwargs)
        return lambda: comm._start(spec)
    return call


def _create(store, rank, size, timeout):
    return ProcessGroupShmtree(store, rank, size, timeout)


def failed_ranks(group=None, timeout=None):
    """The global ranks of `group` (default: the world) that are gone, as its surviving ranks
    agree on them (shmtree's comm.agree over the group's shmtree communicator: it works after
    a failure, and completes with the same answer on every survivor).  Every surviving rank
    of the group calls it.

    Parameters
    ----------
    group : ProcessGroup, optional
        A process group of backend "shmtree" (default: the default group).
    timeout : float, optional
        Seconds after which a rank that has not called it, and has not died, counts as gone.

    Returns
    -------
    list of int
        Global ranks, in order.
    """
    pg = _shmtree_pg(group)
    pg._comm.agree(True, timeout=timeout)
    ranks = dist.get_process_group_ranks(group) if group is not None else \
        list(range(dist.get_world_size()))
    return [ranks[r] for r in pg._comm.failed_ranks()]


def shrink_group(group=None, timeout=None):
    """A new process group of the ranks of `group` that are alive: torch's shrink_group for
    the shmtree backend, without a restart (torch 2.13's own shrink_group needs a C++
    backend).  Every surviving rank calls it; the survivors agree on who they are
    (failed_ranks), then make their group with ``new_group(ranks, backend="shmtree",
    use_local_synchronization=True)`` (only its members take part).  The old group stays
    aborted: use the new one (``group=`` in every call) and destroy the old one.

    Parameters
    ----------
    group : ProcessGroup, optional
        A process group of backend "shmtree" (default: the default group).
    timeout : float, optional
        As failed_ranks'.

    Returns
    -------
    ProcessGroup
        The survivors' group (ranks renumbered in their old order).
    """
    gone = set(failed_ranks(group, timeout))
    ranks = dist.get_process_group_ranks(group) if group is not None else \
        list(range(dist.get_world_size()))
    return dist.new_group([r for r in ranks if r not in gone], backend=BACKEND,
                          use_local_synchronization=True)


def _shmtree_pg(group):
    pg = group if group is not None else dist.group.WORLD
    if not isinstance(pg, ProcessGroupShmtree):
        try:
            pg = pg._get_backend(torch.device("cpu"))
        except Exception:
            pass
    if not isinstance(pg, ProcessGroupShmtree):
        raise TypeError(f"shmtree.torch: {group!r} is not a process group of backend "
                        f"{BACKEND!r}")
    return pg


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
