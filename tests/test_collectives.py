"""broadcast, reduce, allgather and reduce_scatter against numpy (docs/design.md, "Collectives").

Every rank's input is rebuilt in the parent from (case, rank), so the expected values are computed
here without receiving the inputs.  One shmtree.run carries many cases; every rank returns its
results and the parent checks each against numpy (exact for moves, integers, bool, min/max and
bitwise ops; within a tolerance for float and complex sum/prod, whose order is the schedule's).
"""
import pickle
import zlib

import numpy as np
import pytest

import shmtree
import shmtree.machine.plan
from procutil import run_ok

REDUCING = ["bool", "int8", "uint16", "int32", "uint64", "float16", "float32", "float64",
            "complex64", "complex128"]
SIZES = (0, 1, 7, 4099, 70001)           # 70001: a non-multiple of every chunk size used


def ops_for(dtype):
    kind = np.dtype(dtype).kind
    if kind == "c":
        return ("sum", "prod")
    if kind == "f":
        return ("sum", "prod", "min", "max")
    return ("sum", "prod", "min", "max", "band", "bor", "bxor")


UFUNC = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
         "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}


def make(dtype, op, n, rank, seed=0):
    dt = np.dtype(dtype)
    rng = np.random.default_rng(zlib.crc32(repr((dt.str, op, n, rank, seed)).encode()))
    if dt.kind == "b":
        return rng.random(n) < 0.5
    if dt.kind in "iu":
        if op == "prod":
            return rng.choice([1, 2, 3], size=n).astype(dt)
        info = np.iinfo(dt)
        native = dt.newbyteorder("=")
        return rng.integers(info.min, info.max, size=n, dtype=native, endpoint=True).astype(dt)
    if dt.kind == "f":
        lo, hi = (0.5, 1.5) if op == "prod" else (-1.0, 1.0)
        return rng.uniform(lo, hi, n).astype(dt)
    if dt.kind == "c":
        lo, hi = (0.5, 1.2) if op == "prod" else (-1.0, 1.0)
        return (rng.uniform(lo, hi, n) + 1j * rng.uniform(lo, hi, n)).astype(dt)
    if dt.kind in "SUV" or dt.fields is not None or dt.kind in "Mm":
        raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
        if dt.kind in "Mm":
            raw = rng.integers(-10**9, 10**9, size=n).astype(np.int64).view(np.uint8)
        return raw.view(dt) if n else np.empty(0, dt)
    return rng.uniform(-1, 1, n).astype(dt)


def reference(dtype, op, inputs):
    dt = np.dtype(dtype)
    stacked = np.stack(inputs)
    if dt.kind == "b":
        rule = {"sum": np.logical_or, "max": np.logical_or, "bor": np.logical_or,
                "prod": np.logical_and, "min": np.logical_and, "band": np.logical_and,
                "bxor": np.logical_xor}[op]
        return rule.reduce(stacked, axis=0)
    if dt == np.float16 and op in ("sum", "prod"):
        return UFUNC[op].reduce(stacked.astype(np.float32), axis=0).astype(np.float16)
    return UFUNC[op].reduce(stacked, axis=0, dtype=dt)


def same_bytes(got, want):
    """Moved data is exact; longdouble's padding bytes are whatever the producing process left
    there, so it is compared by value."""
    if got.dtype.kind == "f" and got.dtype.itemsize > 8:
        return np.array_equal(got, want)
    return got.tobytes() == want.tobytes()


def check(got, want, dtype, op=None):
    dt = np.dtype(dtype)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape,
                                                                  want.dtype, want.shape)
    if op in ("sum", "prod") and dt.kind in "fc":
        tol = {2: 2e-2, 4: 1e-4, 8: 1e-10, 16: 1e-10}[dt.itemsize if dt.kind == "f"
                                                        else dt.itemsize // 2]
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    else:
        assert got.tobytes() == want.tobytes()


# ---------------------------------------------------------------------------------------------
# workers (module level: they pickle for spawn)


def wire(a):
    """An array as it travels back to the test: numpy's pickling of an array drops a
    non-native byte order, so the dtype, shape and bytes travel separately."""
    return None if a is None else (pickle.dumps(a.dtype), a.shape, a.tobytes())


def unwire(w):
    if w is None:
        return None
    dt, shape, raw = w
    return np.frombuffer(raw, dtype=pickle.loads(dt)).reshape(shape) if raw else \
        np.empty(shape, pickle.loads(dt))


def bcast_worker(comm, cases):
    out = []
    for dtype, n, root, how in cases:
        x = make(dtype, None, n, root)
        if comm.rank == root:
            arg = x
        elif how == "none":
            arg = None
        else:
            arg = np.zeros_like(x)
        if how == "out":
            buf = np.empty_like(x)
            res = comm.broadcast(arg, root=root, out=buf)
            assert res is buf
        elif how == "inplace":
            res = comm.broadcast(arg, root=root, out=arg) if arg is not None else None
            if comm.rank != root:
                assert res is arg
        else:
            res = comm.broadcast(arg, root=root)
        out.append(wire(res))
    return out


def reduce_worker(comm, cases):
    """The ranks take different local paths in one call: a plain array (the C fast path), a
    strided view (the general path), an out= on the root (in place, or apart)."""
    out = []
    for i, (dtype, op, n, root) in enumerate(cases):
        x = make(dtype, op, n, comm.rank)
        how = (comm.rank + i) % 4
        if how == 1:
            x = np.repeat(x, 2)[::2]
        if how == 2 and comm.rank == root:
            x = x.copy()
            res = comm.reduce(x, op=op, root=root, out=x)
            assert res is x
        elif how == 3 and comm.rank == root:
            o = np.empty_like(x)
            res = comm.reduce(x, op=op, root=root, out=o)
            assert res is o
        else:
            res = comm.reduce(x, op=op, root=root)
        if comm.rank != root:
            assert res is None
        out.append(res)
    return out


def allgather_worker(comm, cases):
    out = []
    for dtype, n, axis in cases:
        m = n + (comm.rank % 3 if axis == 0 else 0)          # uneven lengths along axis 0
        x = make(dtype, None, m, comm.rank).reshape(-1) if m else np.empty(0, dtype)
        out.append(wire(comm.allgather(x, axis=axis)))
    return out


def reduce_scatter_worker(comm, cases):
    """The ranks take different local paths in one call: a plain array (the C fast path), a
    strided view (the general path) or an out= (the fast path into it)."""
    out = []
    P, r = comm.size, comm.rank
    for i, (dtype, op, n) in enumerate(cases):
        x = make(dtype, op, n, r)
        how = (r + i) % 3
        if how == 1 and x.ndim:
            x = np.repeat(x, 2, axis=0)[::2]
        if how == 2 and x.ndim:
            rows = n // P + (r < n % P)
            o = np.full((rows,) + x.shape[1:], 7, x.dtype)
            got = comm.reduce_scatter(x, op=op, out=o)
            assert got is o
        else:
            got = comm.reduce_scatter(x, op=op)
        out.append(got)
    return out


# ---------------------------------------------------------------------------------------------
# semantics


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P", [1, 2, 3, 5])
@pytest.mark.parametrize("tree", ["auto", "ring"])
def test_broadcast_every_root(P, tree):
    dtypes = ["uint8", "float64", "complex128", ">i4", "datetime64[ns]", "S5",
              [("a", "<i2"), ("b", ">f8")], np.longdouble]
    cases = [(dt, n, root, how) for root in range(P) for dt in dtypes for n in SIZES[:4]
             for how in ("new",)]
    cases += [("float32", n, root, how) for root in range(P) for n in (5, 70001)
              for how in ("none", "out", "inplace")]
    outs = run_ok(bcast_worker, P, args=(cases,), chunk_bytes=8192, tree=tree)
    for i, (dtype, n, root, how) in enumerate(cases):
        want = make(dtype, None, n, root)
        for rank, res in enumerate(unwire(o[i]) for o in outs):
            assert res.dtype == want.dtype and res.shape == want.shape, (dtype, n, root, how)
            assert same_bytes(res, want), (dtype, n, root, how, rank)


def paths_worker(comm):
    """Small broadcasts and allgathers where ranks take different local paths (the C fast path,
    or Python's for out=, non-contiguous arrays, long descriptions): the rounds must agree."""
    r, P = comm.rank, comm.size
    out = []
    deep = np.arange(2 * 3, dtype=np.int16).reshape((1,) * 8 + (2, 3))     # 10 dims: pickled
    rec = np.array([(1, 2.5), (3, -1.0)], dtype=[("a", "<i2"), ("b", ">f8")])
    for root in range(P):
        for x in (np.arange(7, dtype=np.float32) + root, deep + root, rec,
                  np.arange(300, dtype=np.float64)[::3] + root,             # 800 B, strided
                  np.arange(200, dtype=np.float64) * root):                 # 1600 B: 2 rounds
            if r == root:
                arg = x
            elif r % 3 == 1:
                arg = None
            else:
                arg = np.zeros_like(x)[..., ::-1] if x.ndim == 1 else np.zeros_like(x)
            if r % 2:                         # out=: strided when 1-D, else contiguous
                o = np.full((2 * x.shape[0],), 99, x.dtype)[::2] if x.ndim == 1 \
                    else np.full(x.shape, 99, x.dtype)
                got = comm.broadcast(arg, root=root, out=o)
                assert got is o
            else:
                got = comm.broadcast(arg, root=root)
            out.append(("b", root, wire(np.ascontiguousarray(got))))
    for x in (np.arange(5, dtype=np.int32) * (r + 1), np.array([r + 0.5]),
              np.full((3, 4), r, "S2")):
        if r % 2:
            o = np.empty((P,) + x.shape, x.dtype)
            got = comm.allgather(x, out=o)
            assert got is o
        elif r % 3 == 2:
            got = comm.allgather(np.repeat(x, 2, axis=0)[::2])                  # strided
        else:
            got = comm.allgather(x)
        out.append(("g", None, wire(got)))
    for n in (4, 50001):                      # in place: out[rank] is the input
        o = np.zeros((P, n))
        o[r] = np.arange(n) + r
        assert comm.allgather(o[r], out=o) is o
        out.append(("g", None, wire(o)))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P", [2, 3, 4])
def test_broadcast_and_allgather_mixed_local_paths(P):
    outs = run_ok(paths_worker, P)
    deep = np.arange(2 * 3, dtype=np.int16).reshape((1,) * 8 + (2, 3))
    rec = np.array([(1, 2.5), (3, -1.0)], dtype=[("a", "<i2"), ("b", ">f8")])
    want = []
    for root in range(P):
        for x in (np.arange(7, dtype=np.float32) + root, deep + root, rec,
                  np.arange(300, dtype=np.float64)[::3] + root,
                  np.arange(200, dtype=np.float64) * root):
            want.append(("b", root, x))
    for fill in (lambda r: np.arange(5, dtype=np.int32) * (r + 1), lambda r: np.array([r + 0.5]),
                 lambda r: np.full((3, 4), r, "S2")):
        want.append(("g", None, np.stack([fill(r) for r in range(P)])))
    for n in (4, 50001):
        want.append(("g", None, np.stack([np.arange(n) + r for r in range(P)]).astype(float)))
    for rank, out in enumerate(outs):
        assert len(out) == len(want)
        for (kind, root, w), (k2, root2, got) in zip(want, out):
            got = unwire(got)
            assert (kind, root) == (k2, root2)
            assert got.dtype == w.dtype and got.shape == w.shape, (rank, kind, root, w.dtype)
            assert same_bytes(got, w), (rank, kind, root, w.dtype, w.shape)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P", [1, 2, 4])
@pytest.mark.parametrize("tree", ["auto", "ring"])
def test_reduce_every_root_dtype_op(P, tree):
    cases = [(dt, op, n, root) for dt in REDUCING for op in ops_for(dt) for n in (0, 7, 70001)
             for root in sorted({0, P - 1})]
    outs = run_ok(reduce_worker, P, args=(cases,), chunk_bytes=8192, tree=tree)
    for i, (dtype, op, n, root) in enumerate(cases):
        want = reference(dtype, op, [make(dtype, op, n, r) for r in range(P)])
        check(outs[root][i], want, dtype, op)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P", [1, 3, 4])
@pytest.mark.parametrize("tree", ["auto", "ring"])
def test_allgather_stack_and_uneven_concat(P, tree):
    cases = [(dt, n, axis) for dt in ("uint8", "int64", "float16", "complex64", "S3", ">f8")
             for n in SIZES[:4] for axis in (None, 0)]
    outs = run_ok(allgather_worker, P, args=(cases,), chunk_bytes=8192, tree=tree)
    for i, (dtype, n, axis) in enumerate(cases):
        parts = []
        for r in range(P):
            m = n + (r % 3 if axis == 0 else 0)
            parts.append(make(dtype, None, m, r) if m else np.empty(0, dtype))
        # (numpy's stack/concatenate may hand back native byte order: the contract keeps it)
        want = (np.stack(parts) if axis is None else np.concatenate(parts)).astype(parts[0].dtype)
        for res in (unwire(o[i]) for o in outs):
            assert res.dtype == want.dtype and res.shape == want.shape, (dtype, n, axis)
            assert same_bytes(res, want), (dtype, n, axis)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P", [1, 2, 3, 5])
@pytest.mark.parametrize("tree", ["auto", "ring"])
def test_reduce_scatter_array_split_blocks(P, tree):
    cases = [(dt, op, n) for dt in ("int32", "float64", "bool", "float16") for op in ops_for(dt)
             for n in (0, 1, 7, 4099, 70001)]
    outs = run_ok(reduce_scatter_worker, P, args=(cases,), chunk_bytes=8192, tree=tree)
    for i, (dtype, op, n) in enumerate(cases):
        full = reference(dtype, op, [make(dtype, op, n, r) for r in range(P)])
        for rank, o in enumerate(outs):
            check(o[i], np.array_split(full, P)[rank], dtype, op)


# ---------------------------------------------------------------------------------------------
# every schedule, the module-level forms, spawn


def mixed_worker(comm, n):
    me, P = comm.rank, comm.size
    x = np.arange(n, dtype=np.float64) + me
    r = shmtree.reduce(x, op="max", root=1 % P)
    return (shmtree.broadcast(x if me == P - 1 else None, root=P - 1).tolist(),
            None if r is None else r.tolist(),
            shmtree.allgather(np.full(2, me, np.int16)).tolist(),
            shmtree.reduce_scatter(np.ones((n, 2), np.int32) * (me + 1)).tolist())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tree", ["chain", "binary", "flat", "ring", 3, "topology"])
@pytest.mark.parametrize("n", [3, 50001])
def test_every_schedule_and_module_level_forms(tree, n):
    P = 4
    outs = run_ok(mixed_worker, P, args=(n,), tree=tree, topology="2x2", chunk_bytes=4096)
    total = P * (P + 1) // 2
    for rank, (b, r, g, rs) in enumerate(outs):
        assert b == (np.arange(n) + P - 1.0).tolist()
        if rank == 1:
            assert r == (np.arange(n) + P - 1.0).tolist()
        assert g == [[q, q] for q in range(P)]
        assert rs == (np.ones((n, 2), np.int32) * total)[np.array_split(np.arange(n), P)[rank]] \
            .tolist()


@pytest.mark.timeout(120)
def test_spawned_workers():
    outs = run_ok(mixed_worker, 3, args=(1001,), start_method="spawn")
    assert all(o[2] == [[0, 0], [1, 1], [2, 2]] for o in outs)


# ---------------------------------------------------------------------------------------------
# misuse: local errors first, mismatches on every rank, the group usable after


def local_errors_worker(comm):
    errs = []
    for call in (lambda: comm.broadcast(np.ones(3), root=comm.size),
                 lambda: comm.reduce(np.ones(3), root=-1),
                 lambda: comm.broadcast(None, root=comm.rank),
                 lambda: comm.allgather(np.array([object()])),
                 lambda: comm.broadcast(np.array([object(), 1])),
                 lambda: comm.reduce(np.ones(3, complex), op="max"),
                 lambda: comm.reduce_scatter(np.float64(1.0)),
                 lambda: comm.allgather(np.ones(2), axis=1),
                 lambda: comm.reduce_scatter(np.ones(4), out=np.empty(17))):
        try:
            call()
            errs.append(None)
        except (TypeError, ValueError) as exc:
            errs.append(type(exc).__name__)
    ok = comm.allreduce(np.ones(2)).tolist()
    return errs, ok


@pytest.mark.timeout(60)
def test_local_errors_before_any_communication():
    for errs, ok in run_ok(local_errors_worker, 3):
        assert errs == ["ValueError", "ValueError", "ValueError", "TypeError", "TypeError",
                        "TypeError", "ValueError", "ValueError", "ValueError"]
        assert ok == [3.0, 3.0]


MISMATCHES = {
    "root": lambda c: c.broadcast(np.ones(3), root=0 if c.rank != 1 else 1),
    "bcast_shape": lambda c: c.broadcast(np.ones(3 if c.rank != 2 else 4), root=0),
    "bcast_dtype": lambda c: c.broadcast(np.ones(3, "<f8" if c.rank != 2 else ">f8"), root=0),
    "reduce_root": lambda c: c.reduce(np.ones(3), root=c.rank % 2),
    "reduce_op": lambda c: c.reduce(np.ones(3), op="sum" if c.rank else "max"),
    "reduce_dtype": lambda c: c.reduce(np.ones(3, np.float32 if c.rank else np.float64)),
    "allgather_shape": lambda c: c.allgather(np.ones(2 if c.rank else 3)),
    "allgather_dtype": lambda c: c.allgather(np.ones(2, "S8" if c.rank else "<f8")),
    "allgather_axis0_rest": lambda c: c.allgather(np.ones((2, 3 if c.rank else 4)), axis=0),
    "allgather_axis": lambda c: c.allgather(np.ones(2), axis=0 if c.rank else None),
    "rs_shape": lambda c: c.reduce_scatter(np.ones(6 if c.rank else 7)),
    "bcast_deep_shape": lambda c: c.broadcast(np.ones((1,) * 9 + (2 + (c.rank == 1),)),
                                              root=0),
    "bcast_record_dtype": lambda c: c.broadcast(
        np.zeros(2, [("a", "<i2"), ("b", ">f8" if c.rank != 2 else "<f8")]), root=1),
    "bcast_two_rounds_shape": lambda c: c.broadcast(np.ones(300 + (c.rank == 0)), root=2),
    "kind": lambda c: (c.broadcast(np.ones(3)) if c.rank else c.allreduce(np.ones(3))),
    # a rank that passes None claims its out's dtype and shape
    "bcast_out_claim_shape": lambda c: c.broadcast(
        np.ones(7) if c.rank == 0 else None, root=0,
        out=np.empty(7 + (c.rank == 2)) if c.rank else None),
    "bcast_out_claim_dtype": lambda c: c.broadcast(
        np.ones(50001) if c.rank == 1 else None, root=1,
        out=np.empty(50001, np.float32 if c.rank == 0 else float) if c.rank != 1 else None),
    "kind2": lambda c: (c.reduce(np.ones(3)) if c.rank else c.reduce_scatter(np.ones(3))),
    # large: the engine's own ring algorithms (under tree="ring")
    "large_bcast_root": lambda c: c.broadcast(np.ones(50001), root=c.rank % 2),
    "large_reduce_root": lambda c: c.reduce(np.ones(50001), root=c.rank % 2),
    "large_rs_shape": lambda c: c.reduce_scatter(np.ones(50001 + (c.rank == 2))),
    "large_ag_shape": lambda c: c.allgather(np.ones(50001 + (c.rank == 2))),
    "large_kind": lambda c: (c.reduce_scatter(np.ones(50001)) if c.rank else
                             c.allreduce(np.ones(50001))),
}


def mismatch_worker(comm, names):
    out = []
    for name in names:
        try:
            MISMATCHES[name](comm)
            out.append((name, None, ""))
        except shmtree.ShmtreeError as exc:
            out.append((name, type(exc).__name__, str(exc)))
        out.append(("after " + name, None, str(comm.allreduce(np.ones(1))[0])))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tree", ["auto", "ring"])
def test_mismatch_of_every_kind_on_every_rank_then_usable(tree):
    outs = run_ok(mismatch_worker, 3, args=(list(MISMATCHES),), chunk_bytes=8192, tree=tree)
    for rank, out in enumerate(outs):
        for name, what, msg in out:
            if name.startswith("after "):
                assert msg == "3.0", (rank, name)
                continue
            assert what == "CollectiveMismatchError", (rank, name, what, msg)
            assert "disagree" in msg, (rank, name, msg)


def one_call_worker(comm, n):
    """Large broadcasts whatever the ranks pass (the array, None, None with out=, a shared out,
    strided arrays): each is one engine call - the first round and the data in one - with the
    root's values."""
    r, P = comm.rank, comm.size
    calls, got = [], []
    shared = comm.zeros(n)
    for root in range(P):
        x = np.arange(n, dtype=float) + root
        for how in ("array", "none", "none_out", "shared", "strided"):
            if how == "array":
                args = (x if r == root else np.zeros(n),)
                kw = {}
            elif how == "strided":            # the general path on some ranks, C's on others
                args = (np.repeat(x, 2)[::2] if r == root else None,)
                kw = dict(out=np.empty(2 * n)[::2]) if r % 2 else {}
            elif how == "none":
                args, kw = (x if r == root else None,), {}
            elif how == "none_out":
                args, kw = (x if r == root else None,), dict(out=np.empty(n))
            else:
                if r == root:
                    shared[...] = x
                args, kw = (shared if r == root else None,), dict(out=shared)
            before = comm.stats()["calls"]
            res = comm.broadcast(*args, root=root, **kw)
            calls.append(comm.stats()["calls"] - before)
            got.append(bool(np.array_equal(res, x)))
    return calls, got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P", [2, 3])
def test_large_broadcast_is_one_call(P):
    for calls, got in run_ok(one_call_worker, P, args=(50001,)):
        assert all(got), got
        assert calls == [1] * len(calls), calls


def output_fails_worker(comm, n):
    """A rank that passed None cannot get its output between the first round and the data (its
    allocation fails): it raises that error, the others PeerLostError saying so, at once (in
    this call, or the next where the root was through its part)."""
    import time

    from shmtree.frontend import collectives

    if comm.rank == 1:
        def no_memory(out, shape, dtype, what):
            raise MemoryError(f"no room for {shape}")
        collectives._out_for = no_memory
    t0 = time.monotonic()
    try:
        comm.broadcast(np.ones(n) if comm.rank == 0 else None, root=0, timeout=60)
        comm.barrier(timeout=60)              # (the root may be through its part already)
    except (MemoryError, shmtree.PeerLostError) as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return None, "", time.monotonic() - t0


@pytest.mark.timeout(60)
def test_broadcast_output_failing_between_round_and_data():
    outs = run_ok(output_fails_worker, 3, args=(50001,))
    assert outs[1][:2] == ("MemoryError", "no room for (50001,)"), outs
    for rank in (0, 2):
        what, msg, secs = outs[rank]
        assert what == "PeerLostError" and "MemoryError inside broadcast" in msg, outs
        assert secs < 10, outs


def killed_mid_collective(comm, which):
    import os
    import signal
    import time

    calls = {"broadcast": lambda: comm.broadcast(np.ones(1 << 20) if comm.rank == 0 else None),
             "reduce_scatter": lambda: comm.reduce_scatter(np.ones(1 << 20)),
             "allgather": lambda: comm.allgather(np.ones(1 << 18))}
    if comm.rank == 1:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        calls[which]()
    except shmtree.PeerLostError as exc:
        return "PeerLostError", time.monotonic() - t0, str(exc)
    return None, time.monotonic() - t0, ""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["broadcast", "reduce_scatter", "allgather"])
def test_dead_peer_mid_collective(which):
    with pytest.raises(shmtree.WorkerError) as info:
        shmtree.run(killed_mid_collective, 3, args=(which,))
    assert info.value.rank == 1 and "SIGKILL" in str(info.value), info.value


# ---------------------------------------------------------------------------------------------
# bytes: the ring algorithms move what docs/algorithms.md says


def bytes_worker(comm, n):
    x = np.ones(n, np.float64)
    out = {}
    for name, call in (("allreduce", lambda: comm.allreduce(x)),
                       ("broadcast", lambda: comm.broadcast(x if comm.rank == 1 else None, 1)),
                       ("reduce", lambda: comm.reduce(x, root=2 % comm.size)),
                       ("reduce_scatter", lambda: comm.reduce_scatter(x)),
                       ("allgather", lambda: comm.allgather(x[:n // comm.size])),
                       ("scan", lambda: comm.scan(x)), ("exscan", lambda: comm.exscan(x))):
        comm.barrier()
        before = comm.stats()["bytes_sent"]
        call()
        out[name] = comm.stats()["bytes_sent"] - before
    out["small_bytes"] = comm.group.plan.small_bytes
    least = comm._engine.scan_chain_from()
    out["chain"] = bool(least) and x.nbytes >= least and comm._engine.scan_takes(x.nbytes)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tree", ["ring", "binary", "topology"])
@pytest.mark.parametrize("P", [2, 3, 4])
def test_ring_algorithms_send_the_minimum(P, tree, monkeypatch):
    """Bytes each rank publishes into rings for a message of X bytes: the allreduce 2(P-1)/P X,
    broadcast X (the chain's last rank 0), reduce X (the root 0), reduce_scatter and allgather
    (P-1)/P X (plus the broadcast's first round: 8P + 96 + 64 bytes, up and/or down); scan and
    exscan on the chain X (rank P-1 0)."""
    monkeypatch.setenv("SHMTREE_CMA", "0")  # (the rings' bytes: the single copy by cross-memory
                                             # attach has its own count, test_cma.py)
    n = 60000 * P
    X = n * 8
    # under a tree the collectives other than allreduce run on a ring channel of their own
    outs = run_ok(bytes_worker, P, args=(n,), tree=tree, topology="2x2", chunk_bytes=16384)
    plan = shmtree.machine.plan.plan_group(P, tree=tree, topology="2x2")
    order = list(plan.large_tree.ring)
    small = plan.small_tree             # the broadcast's first round goes up and down it
    for rank, got in enumerate(outs):
        first = 8 * P + 96 + 64          # broadcast's first round (the group's first: room 64)
        first *= (small.parent[rank] >= 0) + bool(small.children[rank])   # ... up and/or down
        if tree == "ring":
            assert got["allreduce"] == 2 * (P - 1) * X // P, got
        last_of_bcast = order[(order.index(1) - 1) % P]
        assert got["broadcast"] == first + (0 if rank == last_of_bcast else X), (rank, got)
        assert got["reduce"] == (0 if rank == 2 % P else X), (rank, got)
        assert got["reduce_scatter"] == (P - 1) * X // P, (rank, got)
        assert got["allgather"] == (P - 1) * (n // P) * 8, (rank, got)   # (P-1)/P of the result
        if got["chain"]:                # scan, exscan: the reduce's chain in rank order (an
            # exscan of two ranks: rank 0's input to rank 1, the exchange's, as many bytes)
            assert got["scan"] == got["exscan"] == (0 if rank == P - 1 else X), (rank, got)
    if tree == "ring" and P == 2:
        assert outs[0]["chain"], outs   # (two ranks: the ring order is the rank order)


def killed_inside_ring_algorithm(comm, which):
    import os
    import signal
    import threading
    import time

    n = 4 << 20                                      # 32 MiB of float64: many chunks
    x = np.ones(n)
    calls = {"broadcast": lambda: comm.broadcast(x, root=0),
             "reduce": lambda: comm.reduce(x, root=0),
             "reduce_scatter": lambda: comm.reduce_scatter(x),
             "allgather": lambda: comm.allgather(x[: n // comm.size]),
             "scan": lambda: comm.scan(x), "exscan": lambda: comm.exscan(x)}
    comm.barrier()
    if comm.rank == 1:                               # dies a few ms into the call
        threading.Timer(0.004, os.kill, (os.getpid(), signal.SIGKILL)).start()
    t0 = time.monotonic()
    try:
        for _ in range(50):
            calls[which]()
    except shmtree.PeerLostError:
        return "PeerLostError", time.monotonic() - t0
    return None, time.monotonic() - t0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["broadcast", "reduce", "reduce_scatter", "allgather", "scan",
                                   "exscan"])
def test_dead_peer_inside_a_ring_algorithm(which):
    """SIGKILL of a rank while the others are inside one of the engine's own algorithms: the run
    names the dead rank, and no one hangs."""
    with pytest.raises(shmtree.WorkerError) as info:
        shmtree.run(killed_inside_ring_algorithm, 3, args=(which,), tree="ring")
    assert info.value.rank == 1 and "SIGKILL" in str(info.value), info.value


def strided_out_worker(comm, n):
    outs = {}
    x = np.arange(n, dtype=np.float64) + comm.rank
    for name, call in (("reduce", lambda o: comm.reduce(x, root=1, out=o)),
                       ("allreduce", lambda o: comm.allreduce(x, out=o))):
        o = np.zeros((n, 2))[:, 0]                    # every other float64: not contiguous
        got = call(o)
        outs[name] = None if got is None else (got is o, o.tolist())
    return outs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tree", ["ring", "auto"])
@pytest.mark.parametrize("n", [5, 100001])
def test_strided_out_gets_the_result(tree, n):
    """out= that the engine cannot write directly (a strided view) is filled afterwards, also
    when reduce runs its chain to the root."""
    outs = run_ok(strided_out_worker, 3, args=(n,), tree=tree)
    want = (np.arange(n, dtype=np.float64) * 3 + 3).tolist()
    for rank, got in enumerate(outs):
        assert got["allreduce"] == (True, want), rank
        assert got["reduce"] == ((True, want) if rank == 1 else None), rank


def out_disagrees_worker(comm, which):
    """Rank 1 passes an out= that disagrees with what the call's first round said (the root's
    dtype; the rows the others send it): every rank must raise CollectiveMismatchError, and
    the group must go on."""
    P, me = comm.size, comm.rank
    if which == "scatter":
        a = np.arange(2 * P, dtype=np.float64) if me == 0 else None
        out = np.empty(2, np.float32 if me == 1 else np.float64)
        call = lambda: comm.scatter(a, root=0, out=out, axis=0)          # noqa: E731
    elif which == "gather":
        a = np.ones((me + 1, 2))
        out = np.empty((P * (P + 1) // 2 + (me == 0), 2)) if me == 0 else None
        call = lambda: comm.gather(a, root=0, out=out, axis=0)           # noqa: E731
    else:                                  # alltoall(counts=): rank 1 expects a row too many
        counts = [1] * P
        a = np.ones((P, 2))
        out = np.empty((P + (me == 1), 2))
        call = lambda: comm.alltoall(a, counts=counts, out=out)          # noqa: E731
    try:
        call()
        got = "no error"
    except Exception as exc:
        got = f"{type(exc).__name__}: {exc}"
    y = comm.allreduce(np.ones(3))
    assert np.all(y == P), y
    return got


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", ["scatter", "gather", "alltoall"])
def test_an_out_that_disagrees_is_a_mismatch_on_every_rank(which):
    got = run_ok(out_disagrees_worker, 3, args=(which,))
    for rank, text in enumerate(got):
        assert text.startswith("CollectiveMismatchError"), (rank, got)
    bad = 0 if which == "gather" else 1
    if which == "scatter":                 # (the round's claims: the same words on every rank)
        assert all("rank 1 passed out= of shape (2,) and dtype float32" in text
                   for text in got), got
        return
    assert "out has" in got[bad], got
    assert all(f"rank {bad}" in text for r, text in enumerate(got) if r != bad), got
