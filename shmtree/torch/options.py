"""The backend's constants and its arguments as torch documents them and gloo checks them:
ReduceOps, options objects (and their keyword forms), timeouts, and the errors they raise."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as _c10d

from ..p2p.records import QUICK_BYTES

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


def _seconds(timeout, default):
    """An options object's timeout in seconds (unset, -1 ms: the group's)."""
    if timeout is None or timeout <= _NONE:
        return default
    return timeout.total_seconds()
