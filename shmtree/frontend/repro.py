"""Reproducible sums (issue 37; docs/design.md, "Reproducible sums"): the executors of the
calls whose CallSpec says so (calls.CallSpec.reproducible: descriptor kind KIND_DETERMINISTIC).

* ``deterministic=True`` (allreduce, reduce, reduce_scatter): the op applied in rank order
  0, 1, ..., P-1 to every element, as one multi-source kernel call (shmtree/_kernels.pyx's, on
  the P contributions: the rule of a flat tree's root; _rounding.fold_rows), whatever the plan:
  - where the plan's own schedule already folds so (P = 1; a message that travels inline in
    the latency round of a flat tree rooted at 0 with its children in rank order - one node,
    P <= 8 -; a pipelined flat tree; an allreduce of two ranks, whose ring schedule folds every
    block x_0 op x_1 under the tag _RANK_ORDER) - and for integer and bool dtypes, whose every
    op is exact - the engine's call itself, with the deterministic descriptor kind;
  - else small messages (P x the message at most GATHER_BYTES): one allgather of every input,
    each rank folds the P rows (reduce: the root alone);
  - else, on a ring order 0..P-1 (one node), for float32/float64/complex: the engine's own
    pipelined reduce to rank P-1, whose chain from rank 0 is the left fold in rank order (each
    rank folds the partial it receives with its own input), then its broadcast (_chained);
  - else the transpose: an exchange sends block q (np.array_split of the items into P; a
    reduce_scatter's blocks of rows) of every rank to rank q, which folds its P rows, then an
    allgather of the folded blocks (reduce: an exchange to the root; reduce_scatter: none).
  scan and exscan fold in rank order always (collectives.Executors._scan): with
  deterministic=True they are the same call under the deterministic kind.
* Accumulator allreduce (an Accumulator, or reproducible=True: each rank's array one term):
  the exact sum of every rank's terms (shmtree/accumulator.py), as integers; its rounds are
  shmtree/accumulating.py's.

Every round carries the call's descriptor kind (codes.det_kind), so that a rank making the
plain call while another makes the reproducible one raises CollectiveMismatchError on every
rank.  The communicator across nodes (Spanning) runs the same schemes in its own steps
(spanning(): the agreement round, then exchanges and allgathers across nodes, or its
pipelined allreduce for the Accumulator's rounds and exact dtypes).

Layers: the front end's (tests/test_import_graph.py): it imports calls, accumulating,
accumulator and the extensions, never the communicators (it calls their methods: Executors'
_call, _exchange, _work, _broadcast; Communicator's _finish, _bound_run; Spanning's _agree,
_check, _exchange_nodes, _allgather_data, _reduce_pipeline).
"""
from __future__ import annotations

import functools
import math
import os
import time

import numpy as np

from .. import _engine, _kernels, _rounding
from . import calls
from .accumulating import Across, accumulating, accumulated
from ..accumulator import Accumulator
from .calls import (ALLGATHER, ALLREDUCE, BROADCAST, REDUCE, REDUCE_SCATTER, bytes_of,
                    split_bounds)
from ..codes import (DET_ACCUMULATE, DET_ALLREDUCE, DET_REDUCE, DET_REDUCE_SCATTER, DET_ROOTS,
                    KIND_ROOT_STEP, det_kind, kind_name)
from ..ops import OP_NAMES, dtype_name, reduction_codes
from .persistent import DECLINED

__all__ = ["prepared", "spanning", "quick", "bind", "described", "GATHER_BYTES"]
# (the Accumulator allreduce's rounds: shmtree/accumulating.py)

GATHER_BYTES = 256 << 10    # a deterministic call of at most this many bytes in all (P x the
                            # message, or small_bytes where that is more) is one allgather of
                            # every input; larger ones the transpose (the rule of the scan:
                            # collectives.scan_gathers)
_EXACT = "biu"              # dtype kinds whose every op gives the same bits in any order
_NOTHING = np.empty(0, np.uint8)
_U1 = _kernels.DTYPE_CODES["u1"]
_BOR = _kernels.OP_CODES["bor"]
_RANK_ORDER = _engine.RANK_ORDER    # (Engine.call's tag: an allreduce of two ranks folds x_0 op x_1)


# ---------------------------------------------------------------------------------------------
# one machine (Communicator: Executors._prepared's hook)


def prepared(comm, spec):
    """The function that runs a reproducible call (spec.reproducible) on one machine."""
    if spec.kind // KIND_ROOT_STEP == DET_ACCUMULATE:
        return functools.partial(accumulating, comm, spec)
    if spec.coll == REDUCE_SCATTER:
        return functools.partial(_reduce_scatter, comm, spec)
    return functools.partial(_reducing, comm, spec)


def ordered(comm, coll, nbytes):
    """Does the engine's own call of `coll` over nbytes apply the op in rank order, as one
    fold of the P inputs (a flat tree's root: x_0, x_1, ..., x_{P-1} in one kernel call; an
    allreduce of two ranks under the ring schedule, made with the tag _RANK_ORDER: every block
    x_0 op x_1)?"""
    got = comm.__dict__.get("_repro_order")
    if got is None:
        plan = comm._plan
        got = comm._repro_order = (comm.size, plan.small_bytes, _flat(plan.small_tree),
                                   plan.large_schedule == "tree" and _flat(plan.large_tree))
    P, small_bytes, small, large = got
    if P == 1:
        return True
    if nbytes <= small_bytes:
        return small
    return (large or P == 2) and coll == ALLREDUCE    # (two ranks: the ring's rank 0 folds its
                                                      # own first under _RANK_ORDER)


def _chained(comm, dt, nbytes, root):
    """Is the engine's reduce to rank P-1 the rank-order fold here?  Its chain runs along the
    ring order from position 0 to the root's, each rank folding the partial it receives (the
    left operand) with its own input: on a ring order 0, 1, ..., P-1 (one node) that is
    ((x_0 op x_1) op x_2) ... op x_{P-1}, one rounding per step - so not for float16 and
    bfloat16, whose fold rounds once.  For a message the chain carries (above small_bytes);
    a reduce to another root is not."""
    got = comm.__dict__.get("_repro_chain")
    if got is None:
        plan = comm._plan
        got = comm._repro_chain = (
            plan.large_tree.ring == tuple(range(comm.size))
            and plan.algorithm("reduce", plan.small_bytes + 1) == "chain", plan.small_bytes)
    return got[0] and nbytes > got[1] and dt.name not in _HALF and \
        (root is None or root == comm.size - 1)


_HALF = ("float16", "bfloat16")


def _flat(tree):
    """A flat tree rooted at 0 whose children are 1, 2, ..., P-1 in that order."""
    return tree.root == 0 and tree.children[0] == tuple(range(1, tree.size))


def _plain(a):
    flags = a.flags
    return a if (flags.c_contiguous and flags.aligned) else np.array(a, order="C")


def _dims(a, opc, root=None):
    """The descriptor's shape of a deterministic call's rounds: the input's shape, the op,
    the item size and the dtype (a reduce's root too when the kind cannot say it)."""
    shape = list(a.shape) if a.ndim <= 28 else [a.size]
    tail = [opc, a.dtype.itemsize, calls.dtype_digest(a.dtype)]
    return shape + tail + ([root] if root is not None and root >= DET_ROOTS else [])


def _gathers(nbytes, P, small_bytes):
    whole = nbytes * P
    return whole <= small_bytes or whole <= GATHER_BYTES


def _reducing(comm, spec):
    """allreduce / reduce, deterministic=True."""
    a, root, P, me = spec.array, spec.root, comm.size, comm.rank
    mine = root is None or root == me
    result, dst, copy_back = calls.destination(a, spec.out if mine else None)
    src = _plain(a)
    if _engine.clash(src, dst):
        src = src.copy()                      # (out overlaps the input without being it)
    dst = dst.reshape(src.shape)
    kind, deadline = spec.kind, spec.deadline
    if src.dtype.kind in _EXACT or src.size == 0 or (
            ordered(comm, spec.coll, src.nbytes) and (root or 0) < DET_ROOTS):
        comm._call(spec.coll, src, dst if mine else None, (spec.opc, spec.dtc), root or 0,
                   kind, deadline, _RANK_ORDER if spec.coll == ALLREDUCE else 0)
    else:
        _rank_fold(comm, src, dst if mine else None, root, spec.opc, kind, deadline)
    if copy_back is not None and mine:
        copy_back[...] = dst.reshape(copy_back.shape)
    return result if mine else None


def _rank_fold(comm, src, dst, root, opc, kind, deadline):
    """The rank-order fold of every rank's src into dst (allreduce: every rank; reduce: the
    root, dst None elsewhere): one allgather and a local fold, or the transpose."""
    P, me, dt = comm.size, comm.rank, src.dtype
    dtc = _kernels.dtype_code(dt)
    dims = _dims(src, opc, root)
    n = src.size
    if _gathers(src.nbytes, P, comm._plan.small_bytes):
        stack = comm._work(0, (P, n), dt)
        comm._call(ALLGATHER, bytes_of(src), bytes_of(stack), None, 0, kind, deadline, 0, dims,
                   comm._even_positions(src.nbytes))
        if dst is not None:
            _rounding.fold_rows(dst, stack, opc, dtc)
        return
    if _chained(comm, dt, src.nbytes, root):     # (the engine's reduce to P-1, a broadcast)
        last = P - 1
        comm._call(REDUCE, src, dst if me == last else None, (opc, dtc), last, kind, deadline)
        if root is None:
            comm._broadcast(calls.CallSpec("broadcast", BROADCAST, kind,
                                           dst if me == last else None, dst, root=last,
                                           deadline=deadline))
        return
    b = split_bounds(n, P)
    sizes = np.array([b[q + 1] - b[q] for q in range(P)], np.uint64) * np.uint64(dt.itemsize)
    m = b[me + 1] - b[me]
    rows = comm._work(0, (P, m), dt)
    comm._exchange(src.reshape(-1), rows, np.tile(sizes, P), kind, dims, deadline)
    if root is None:                          # allreduce: fold into place, then allgather
        flat = dst.reshape(-1)
        _rounding.fold_rows(flat[b[me]:b[me + 1]], rows, opc, dtc)
        offsets = [b[q] * dt.itemsize for q in range(P + 1)]
        view = bytes_of(flat)
        comm._call(ALLGATHER, view[offsets[me]:offsets[me + 1]], view, None, 0, kind, deadline,
                   0, dims, comm._by_position(offsets))
        return
    folded = comm._work(1, (m,), dt)
    _rounding.fold_rows(folded, rows, opc, dtc)
    B = np.zeros(P * P, np.uint64)
    B[root::P] = sizes                        # (rank p's block p goes to the root)
    comm._exchange(folded, dst.reshape(-1) if dst is not None else _NOTHING, B, kind, dims,
                   deadline)


def _reduce_scatter(comm, spec):
    """reduce_scatter, deterministic=True: rank q folds block q (np.array_split's rows) of
    every rank, in rank order (one exchange), where the engine's own call would not."""
    a, out, P, me = spec.array, spec.out, comm.size, comm.rank
    lo, hi, shape = calls.scatter_shape(a, out, P, me)
    result, copy_back = calls.out_for(out, shape, a.dtype, "reduce_scatter")
    src = _plain(a)
    if _engine.clash(src, result):
        src = src.copy()
    kind, deadline, dt = spec.kind, spec.deadline, a.dtype
    if dt.kind in _EXACT or src.size == 0 or ordered(comm, REDUCE_SCATTER, src.nbytes):
        comm._call(REDUCE_SCATTER, src, result, (spec.opc, spec.dtc), 0, kind, deadline)
        return calls.finish(result, copy_back)
    row = math.prod(a.shape[1:])
    b = split_bounds(a.shape[0], P)
    sizes = np.array([(b[q + 1] - b[q]) * row for q in range(P)], np.uint64) * \
        np.uint64(dt.itemsize)
    rows = comm._work(0, (P, (hi - lo) * row), dt)
    comm._exchange(src.reshape(-1), rows, np.tile(sizes, P), kind, _dims(src, spec.opc),
                   deadline)
    _rounding.fold_rows(result, rows, spec.opc, spec.dtc)
    return calls.finish(result, copy_back)


_QUICK_KINDS = {ALLREDUCE: det_kind(DET_ALLREDUCE), REDUCE_SCATTER: det_kind(DET_REDUCE_SCATTER)}


def quick(comm, coll, array, op, out, root, timeout):
    """Front's quick path of a deterministic call of a plain ndarray (no parse: the engine's
    C twin parses it): where the engine's own call folds in rank order (ordered; integer and
    bool dtypes), that one Engine.call under the deterministic kind, as Communicator._quick
    makes a plain one; an allreduce or reduce that the chain (_chained) or one allgather
    (_gathers) does, those engine calls; DECLINED otherwise, or for anything the parse must
    look at first (nothing has run then: the call is parsed, then run by prepared())."""
    order = comm.__dict__.get("_repro_order")
    if order is None:
        if getattr(comm, "_engine", None) is None:    # (not one machine's communicator)
            return DECLINED
        ordered(comm, coll, 0)
        order = comm._repro_order
    if type(array) is not np.ndarray or comm._closed or comm._pid != os.getpid() \
            or comm.group._closed:
        return DECLINED
    progress = comm._progress
    if progress is not None and (progress.outstanding or progress.is_current_thread()):
        return DECLINED
    if coll == REDUCE:
        if type(root) is not int or not 0 <= root < min(comm.size, DET_ROOTS):
            return DECLINED
        kind = det_kind(DET_REDUCE, root)
    else:
        root = 0 if coll != ALLREDUCE else None
        kind = _QUICK_KINDS[coll]
    if array.dtype.kind not in _EXACT:
        if not ordered(comm, coll, array.nbytes):     # (the one rule, the parsed call's too)
            if coll == REDUCE_SCATTER:
                return DECLINED
            return _quick_fold(comm, array, op, out, root, kind, timeout)
    eng = comm._engine
    start = None if timeout is None else time.monotonic()
    return _one_call(comm, eng, coll, array, out, op, root or 0, kind, timeout, start)


def _one_call(comm, eng, coll, array, out, op, root, kind, timeout, start, dims=None,
              offs=None):
    """One engine call of a quick path, driven to its end: its result, or DECLINED (the
    engine declined: nothing ran)."""
    try:
        got = eng.call(coll, array, out, op, root, kind, timeout,
                       _RANK_ORDER if coll == ALLREDUCE else 0, dims, offs)
        if got is None:
            return DECLINED
        rc, result = got
        if rc != _engine.DONE:
            result = comm._finish(eng, rc, None if start is None else start + timeout, result)
    except BaseException as exc:
        comm._interrupted(eng, exc)
        raise
    return result


def _quick_fold(comm, array, op, out, root, kind, timeout):
    """quick's allreduce / reduce where the plan does not fold in rank order: the chain (the
    engine's reduce to rank P-1, then its broadcast from there) or one allgather and a local
    fold, as _rank_fold runs them, for a C-contiguous input and out= None or a plain array
    of its shape and dtype (in place, or clear of it)."""
    P, me, dt = comm.size, comm.rank, array.dtype
    if not (array.flags.c_contiguous and array.flags.aligned) or array.ndim > 28:
        return DECLINED
    if out is not None and (type(out) is not np.ndarray or out.dtype != dt or
                            out.shape != array.shape or not out.flags.c_contiguous or
                            not out.flags.aligned or not out.flags.writeable or
                            (out is not array and np.may_share_memory(out, array))):
        return DECLINED
    codes = _CODES.get((op, dt))
    if codes is None:
        try:
            codes = reduction_codes(op, dt)
            hash(op)
        except Exception:                     # (the parse says what is wrong)
            return DECLINED
        if len(_CODES) < 64:
            _CODES[(op, dt)] = codes
    mine = root is None or root == me
    nbytes = array.nbytes
    eng = comm._engine
    start = None if timeout is None else time.monotonic()
    if _gathers(nbytes, P, comm._plan.small_bytes):
        stack = comm._work(0, (P, array.size), dt)
        got = _one_call(comm, eng, ALLGATHER, bytes_of(array), bytes_of(stack), None, 0, kind,
                        timeout, start, _dims(array, codes[0], root),
                        comm._even_positions(nbytes))
        if got is DECLINED or not mine:
            return got if got is DECLINED else None
        dst = np.empty(array.shape, dt) if out is None else out
        _rounding.fold_rows(dst, stack, codes[0], codes[1])
        return dst
    if _chained(comm, dt, nbytes, root):
        last = P - 1
        dst = (np.empty(array.shape, dt) if out is None else out) if mine else None
        got = _one_call(comm, eng, REDUCE, array, dst if me == last else None, codes, last,
                        kind, timeout, start)
        if got is DECLINED or root is not None:
            return got if got is DECLINED or me == root else None
        now = None if timeout is None else time.monotonic()
        left = None if timeout is None else max(0.0, start + timeout - now)
        claim = dst
        got = _one_call(comm, eng, BROADCAST, dst if me == last else None, dst, None, last,
                        kind, left, now)
        if got is DECLINED:                   # (mid-call: the executor's broadcast then)
            return comm._broadcast(calls.CallSpec("broadcast", BROADCAST, kind,
                                                  dst if me == last else None, dst,
                                                  root=last, deadline=None if start is None
                                                  else start + timeout))
        if type(got) is tuple:                # (a broadcast whose data did not come yet)
            got = comm._broadcast_rest(got, claim, last, dst, kind,
                                       None if start is None else start + timeout)
        return dst
    return DECLINED


_CODES = {}                 # (op, dtype) -> the reduction's codes, of the quick folds


def bind(comm, spec, slow):
    """Communicator._bind of a reproducible call: the engine's own call bound (as a plain
    one's) where it folds in rank order and no timeout is given; else None (p() runs the
    bound spec through the dispatch: prepared())."""
    if spec.kind // KIND_ROOT_STEP == DET_ACCUMULATE or \
            spec.coll not in (ALLREDUCE, REDUCE, REDUCE_SCATTER):
        return None
    a, out, root = spec.array, spec.out, spec.root or 0
    if type(a) is not np.ndarray or (out is not None and type(out) is not np.ndarray) or \
            spec.timeout is not None or root >= DET_ROOTS:
        return None
    if a.dtype.kind not in _EXACT and not ordered(comm, spec.coll, a.nbytes):
        return None
    return comm._bound_run(spec.coll, a, out, (spec.opc, spec.dtc), root, spec.kind,
                           _RANK_ORDER if spec.coll == ALLREDUCE else 0, slow)


# ---------------------------------------------------------------------------------------------
# across nodes (Spanning._executor's hook)


def spanning(comm, spec):
    """The function that runs a reproducible call across nodes (a Spanning of several nodes):
    its agreement round (a row of the deterministic kind: ranks that disagree raise
    CollectiveMismatchError on every rank of every node), then the data."""
    a, out, root, deadline, opc = spec.array, spec.out, spec.root, spec.deadline, spec.opc
    det = spec.kind // KIND_ROOT_STEP
    if type(a) is Accumulator:
        row = _row(spec.kind, -1, opc, a.shape, a.dtype)
    else:
        row = _row(spec.kind, -1 if root is None else root, opc, a.shape, a.dtype)

    def run():
        table = comm._agree(row, deadline)
        comm._check(table)
        if det == DET_ACCUMULATE:
            return accumulated(Across(comm, deadline), spec)
        if spec.coll == REDUCE_SCATTER:
            return _span_reduce_scatter(comm, spec)
        return _span_reducing(comm, spec)
    run.call = kind_name(spec.kind)
    return run


def _row(kind, root, opc, shape, dtype):
    """A rank's description of its call, as the Spanning's agreement compares them (the
    layout of nodes._row: kind, root, op, dtype digest, dtype number, bytes, ndim, first two
    dimensions, shape digest, extra)."""
    shape = tuple(shape)
    d0 = shape[0] if len(shape) > 0 else 0
    d1 = shape[1] if len(shape) > 1 else 0
    nbytes = dtype.itemsize * math.prod(shape)
    return [kind, root, opc, calls.dtype_digest(dtype), dtype.num, nbytes, len(shape), d0, d1,
            hash(shape) & 0x7fffffffffffffff, -1]


def _span_reducing(comm, spec):
    """allreduce / reduce, deterministic=True, across nodes: integer and bool dtypes (exact)
    through the Spanning's pipelined allreduce; floats: one allgather of every input (small)
    or the transpose (exchanges across nodes), folded in global rank order."""
    a, root, P, me = spec.array, spec.root, comm.size, comm.rank
    deadline, opc = spec.deadline, spec.opc
    mine = root is None or root == me
    result, dst, copy_back = calls.destination(a, spec.out if mine else None)
    src = np.ascontiguousarray(a).reshape(-1)
    flat = dst.reshape(-1)
    if _engine.clash(src, flat):
        src = src.copy()
    dt, n, name = a.dtype, a.size, OP_NAMES[opc]
    if dt.kind in _EXACT:
        deliver = root is None or comm._where[root][0] == comm.node
        comm._reduce_pipeline(src, flat if mine else None, name, deliver, deadline)
    elif a.nbytes * P <= _SPAN_GATHER_BYTES:
        stack = np.empty((P, n), dt)
        comm._allgather_data(src, None, [1] * P, a.nbytes, stack, deadline)
        if mine:
            _rounding.fold_rows(flat, stack, opc, _kernels.dtype_code(dt))
    else:
        b = split_bounds(n, P)
        sizes = np.array([b[q + 1] - b[q] for q in range(P)], np.int64)
        m = int(sizes[me])
        rows = np.empty((P, m), dt)
        comm._exchange_nodes(_apart(bytes_of(src), bytes_of(flat)), bytes_of(rows),
                             np.tile(sizes * dt.itemsize, (P, 1)), deadline)
        folded = np.empty(m, dt)
        _rounding.fold_rows(folded, rows, opc, _kernels.dtype_code(dt))
        if root is None:
            comm._allgather_data(folded, 0, [int(s) for s in sizes], dt.itemsize, flat,
                                 deadline)
        else:
            B = np.zeros((P, P), np.int64)
            B[:, root] = sizes * dt.itemsize
            comm._exchange_nodes(bytes_of(folded), bytes_of(flat) if mine else _NOTHING, B,
                                 deadline)
    if copy_back is not None and mine:
        copy_back[...] = dst.reshape(copy_back.shape)
    return result if mine else None


_SPAN_GATHER_BYTES = 64 << 10      # (the Spanning's scan rule: nodes.SCAN_GATHER_BYTES)


def _span_reduce_scatter(comm, spec):
    """reduce_scatter, deterministic=True, across nodes: the transpose's exchange of blocks of
    rows, each folded by its rank (every dtype: one exchange is what the call needs)."""
    a, out, P, me = spec.array, spec.out, comm.size, comm.rank
    lo, hi, shape = calls.scatter_shape(a, out, P, me)
    result, copy_back = calls.out_for(out, shape, a.dtype, "reduce_scatter")
    src = np.ascontiguousarray(a).reshape(-1)
    dt = a.dtype
    row = math.prod(a.shape[1:])
    b = split_bounds(a.shape[0], P)
    sizes = np.array([(b[q + 1] - b[q]) * row for q in range(P)], np.int64) * dt.itemsize
    rows = np.empty((P, (hi - lo) * row), dt)
    comm._exchange_nodes(_apart(bytes_of(src), bytes_of(result)), bytes_of(rows),
                         np.tile(sizes, (P, 1)), spec.deadline)
    _rounding.fold_rows(result, rows, spec.opc, spec.dtc)
    return calls.finish(result, copy_back)


def _apart(src, dst):
    return src.copy() if src.size and dst.size and np.may_share_memory(src, dst) else src


# ---------------------------------------------------------------------------------------------
# mismatch messages (Communicator._mismatch_message's hook)


def described(kind, opc, dtc, shape, nbytes):
    """A reproducible call's round as a mismatch message says it: its name (the kind) and
    what its descriptor carries (the shape, dtype and op; an Accumulator's shape and dtype)."""
    name = kind_name(kind)
    dims = [d for d in shape if d is not Ellipsis]
    if kind // KIND_ROOT_STEP == DET_ACCUMULATE:
        if dims and dims[-1] in (-1, -2):     # (the small forms' allgathers: of states, of
            dims = dims[:-1]                  # reproducible=True's terms)
        if dims:
            return f"{name}(shape={tuple(dims[:-1])}, dtype {calls.dtype_text(dims[-1])})"
        return name
    if dtc == _U1 and opc == _BOR and len(dims) >= 3:     # an allgather or exchange round
        if kind // KIND_ROOT_STEP == DET_REDUCE + DET_ROOTS and len(dims) >= 4:
            name = f"deterministic reduce(root={dims[-1]})"     # (_dims: a root of its own)
            dims = dims[:-1]
        return (f"{name}(shape={tuple(dims[:-3])}, dtype {calls.dtype_text(dims[-1])}, "
                f"op={OP_NAMES.get(dims[-3], dims[-3])!r})")
    return (f"{name}(shape={tuple(dims)}, dtype={dtype_name(dtc)}, "
            f"op={OP_NAMES.get(opc, opc)!r})")
