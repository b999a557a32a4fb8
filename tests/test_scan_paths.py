"""scan and exscan on their one engine call (Engine.call's SCAN and EXSCAN: engine/msg.pxi,
msg_scan - one allgather of the inputs into the engine's own stack, the rows this rank needs
folded in C when the call ends, engine/scan.pxi) and the transpose scheme beyond scan_gathers
(Executors._scan, its fold _engine.fold): against numpy's accumulate for every dtype and op,
sizes 0, 1, 7, 4099 and around the inline limit and scan_gathers' threshold, P = 1..5; every
way in (plain, out=, in place, strided input or out=, timeout=, the i-forms, the *_init forms)
making that one engine call; mismatches raised on every rank, the group usable after.

Every rank's input is rebuilt in the parent from (case, rank) (test_complete_set.scan_input:
min and max of floats meet NaN, -0.0 and +0.0, infinities), so the expected values are computed
here."""
import tracemalloc

import numpy as np
import pytest

import shmtree
from shmtree import _engine
from shmtree.frontend import calls, collectives
from shmtree.ops import reduction_codes

from procutil import run_ok
from test_collectives import unwire, wire
from test_complete_set import (SCANNED, UFUNC, dt, identity, ml_dtypes, ops_for, scan_expected,
                               scan_input, textbook_cprod)


# ---------------------------------------------------------------------------------------------
# the rule and the numbers


def test_the_engine_numbers_scan_as_calls_does_and_holds_the_one_rule():
    assert (_engine.SCAN, _engine.EXSCAN) == (calls.SCAN, calls.EXSCAN)
    assert collectives.scan_gathers is _engine.scan_gathers
    limit = _engine.SCAN_GATHER_BYTES
    assert limit == collectives.SCAN_GATHER_BYTES == 256 << 10
    for P in (2, 3, 5):
        n = limit // P
        assert _engine.scan_gathers(n, P, 4096) and not _engine.scan_gathers(n + 1, P, 4096)
        assert _engine.scan_gathers(n + 1, P, P * (n + 1))        # (small_bytes above it)
    assert _engine.scan_gathers(1 << 40, 1, 4096)                 # (one rank: no round)


# ---------------------------------------------------------------------------------------------
# the fold itself (no processes): numpy's accumulate, bit for bit


def _values(d, op, rng, shape):
    """Rows with what tells the rules apart: for min and max of floats NaNs (of either sign,
    two payloads), -0.0, +0.0, infinities; for sum and prod signed zeros and ordinary values
    (where two NaNs meet, numpy's loops pick one or the other by dtype: compared by value
    below)."""
    if d.kind == "f" or d == _BF16:
        if op in ("min", "max"):
            pool = np.array([0.0, -0.0, 1.0, -1.5, np.inf, -np.inf, np.nan, 3.25, -0.0],
                            np.float32).astype(d)
            bits = pool.view(np.uint16 if d.itemsize == 2 else
                             np.uint32 if d.itemsize == 4 else np.uint64).copy()
            nan = bits[6]
            pool = np.concatenate([pool, np.array([nan | 1, nan | (1 << (8 * d.itemsize - 1))],
                                                  bits.dtype).view(d)])
        else:
            pool = np.concatenate([np.array([0.0, -0.0], d),
                                   rng.uniform(0.5, 1.5, 20).astype(np.float32).astype(d)])
        return pool[rng.integers(0, len(pool), shape)]
    if d.kind == "c":
        lo, hi = (0.5, 1.2) if op == "prod" else (-1.0, 1.0)
        return (rng.uniform(lo, hi, shape) + 1j * rng.uniform(lo, hi, shape)).astype(d)
    if d.kind == "b":
        return rng.random(shape) < 0.5
    if op == "prod":
        return rng.choice([1, 2, 3], size=shape).astype(d)
    info = np.iinfo(d)
    return rng.integers(info.min, info.max, size=shape, dtype=d, endpoint=True)


_BF16 = np.dtype(ml_dtypes.bfloat16) if ml_dtypes else None


def _accumulate(rows, op):
    d = rows.dtype
    if op == "prod" and d.kind == "c":
        return textbook_cprod(rows)
    return UFUNC[op].accumulate(rows, axis=0, dtype=d)


@pytest.mark.parametrize("dtype", SCANNED)
def test_fold_is_numpys_accumulate_bit_for_bit(dtype):
    d = dt(dtype)
    rng = np.random.default_rng(len(dtype))
    for op in ops_for(dtype):
        opc = reduction_codes(op, d)[0]
        for P in (1, 2, 3, 5):
            rows = _values(d, op, rng, (P, 37))
            want = _accumulate(rows, op)
            got = _engine.fold(rows, opc, np.empty_like(rows))
            assert got.tobytes() == want.tobytes(), (dtype, op, P)
            inplace = rows.copy()
            assert _engine.fold(inplace, opc, inplace) is inplace
            assert inplace.tobytes() == want.tobytes(), (dtype, op, P, "in place")
            ex = _engine.fold(rows, opc, np.empty_like(rows), True)
            first = identity(op, d, rows.shape[1:])
            assert first.tobytes() == collectives._identity(opc, d, (37,)).tobytes()
            assert ex.tobytes() == np.concatenate([first[None], want[:-1]]).tobytes(), \
                (dtype, op, P, "exclusive")
            # collectives._fold (nodes.py's): any layout, into a new array or out=
            assert collectives._fold(rows[:, ::-1], opc).tobytes() == \
                _accumulate(np.ascontiguousarray(rows[:, ::-1]), op).tobytes()


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "complex64"]
                         + (["bfloat16"] if ml_dtypes else []))
def test_fold_of_nans_in_sum_and_prod_is_nan_where_numpys_is(dtype):
    d = dt(dtype)
    rng = np.random.default_rng(7)
    pool = np.array([np.nan, -np.nan, np.inf, -np.inf, 1.0, -0.0], np.float32)
    if d.kind == "c":       # (test_complete_set.textbook_cprod's re + 1j * im: no infinities)
        pool = np.array([np.nan, -np.nan, 1.0, -0.0, 0.5], np.float32)
    for op in ("sum", "prod"):
        rows = pool[rng.integers(0, len(pool), (4, 64))].astype(d)
        if d.kind == "c":
            rows = (rows + 1j * pool[rng.integers(0, len(pool), (4, 64))]).astype(d)
        with np.errstate(all="ignore"):
            want = _accumulate(rows, op)
            got = _engine.fold(rows, reduction_codes(op, d)[0], np.empty_like(rows))
        if d.kind == "c":                                 # (part by part)
            got, want = got.view(got.real.dtype), want.view(want.real.dtype)
        assert np.array_equal(got.astype(np.float64), want.astype(np.float64),
                              equal_nan=True), (dtype, op)


def test_fold_refuses_what_it_cannot_take():
    x = np.ones((3, 4))
    opc = reduction_codes("sum", x.dtype)[0]
    with pytest.raises(ValueError):
        _engine.fold(x, opc, np.ones((3, 5)))
    with pytest.raises(ValueError):
        _engine.fold(x[:, ::2], opc, np.ones((3, 2)))
    with pytest.raises(ValueError):
        _engine.fold(x, opc, x, True)                     # (exclusive: not in place)
    with pytest.raises(TypeError):
        _engine.fold(x.astype(complex), reduction_codes("max", np.dtype("f8"))[0],
                     np.ones((3, 4), complex))


# ---------------------------------------------------------------------------------------------
# every way in, against numpy, on every rank


class _Recorder:
    """The communicator's engine, with the collectives of the calls it took noted (Engine.call's
    coll numbers; a call it declines runs nothing): which engine calls each way in makes."""

    def __init__(self, eng):
        self._eng = eng
        self.colls = []

    def call(self, coll, *args):
        got = self._eng.call(coll, *args)
        if got is not None:
            self.colls.append(coll)
        return got

    def __getattr__(self, name):
        return getattr(self._eng, name)


def _size(comm, where, d):
    """A case's items: a number, or just below / at / above the inline limit (the plan's
    small_bytes, P rows in all) or scan_gathers' threshold."""
    if isinstance(where, int):
        return where
    what, delta = where
    if what == "chain":             # (the chain's least bytes per rank, or else scan_gathers')
        least = comm._engine.scan_chain_from()
        if least and least * comm.size > _engine.SCAN_GATHER_BYTES:
            return max(0, least // d.itemsize + delta)
        what = "gather"
    limit = comm._plan.small_bytes if what == "inline" else _engine.SCAN_GATHER_BYTES
    return max(0, limit // (comm.size * d.itemsize) + delta)


def scan_worker(comm, cases):
    r = comm.rank
    rec = comm._engine = _Recorder(comm._engine)
    out = []
    for i, (dtype, op, where, exclusive, how) in enumerate(cases):
        n = _size(comm, where, dt(dtype))
        x = scan_input(dtype, op, n, r, i)
        fn = comm.exscan if exclusive else comm.scan
        init = comm.exscan_init if exclusive else comm.scan_init
        before = len(rec.colls)
        if how == "plain":
            got = fn(x, op=op)
        elif how == "out":
            o = np.empty_like(x)
            got = fn(x, op=op, out=o, timeout=60)       # (the bench's call)
            assert got is o
        elif how == "inplace":
            got = fn(x, op=op, out=x)
            assert got is x
        elif how == "strided":
            got = fn(np.repeat(x, 2)[::2], op=op)
        elif how == "strided_out":
            o = np.zeros(2 * n, x.dtype)[::2]
            got = fn(x, op=op, out=o)
            assert got is o
        elif how == "2d":
            got = fn(x.reshape(-1, 1, 1), op=op).reshape(-1)
        elif how == "timeout":
            got = fn(x, op=op, timeout=60)
        elif how == "i":
            got = (comm.iexscan if exclusive else comm.iscan)(x, op=op).wait()
        elif how == "init":
            held = np.zeros_like(x)
            p = init(held, op=op)
            before = len(rec.colls)
            held[...] = x                              # (the bound input's contents change)
            got = p().copy()
            first = len(rec.colls)
            assert p() is p()
            del rec.colls[first:]                      # (the calls of the first p() alone)
        elif how == "init_out":
            o = np.empty_like(x)
            p = init(x, op=op, out=o, timeout=60)
            before = len(rec.colls)
            got = p()
            assert got is o
        elif how == "start":
            p = init(x, op=op)
            before = len(rec.colls)
            got = p.start().wait()
        elif how == "overlap":                         # (out= overlaps the input, shifted)
            z = np.zeros(n + 3, x.dtype)
            z[:n] = x
            got = fn(z[:n], op=op, out=z[3:])
        else:
            raise AssertionError(how)
        out.append((n, wire(np.asarray(got)), rec.colls[before:],
                    rec.scan_takes(n * x.dtype.itemsize, exclusive)))
    return comm._plan.small_bytes, out


BASE = [(d, op, n, ex, "plain") for d in SCANNED for op in ops_for(d)
        for n in (0, 1, 7, 4099) for ex in (False, True)]
EDGES = [(d, op, (what, delta), ex, "plain")
         for d, op in (("float32", "sum"), ("float16", "min"), ("int8", "bxor"),
                       ("complex128", "prod"), ("float64", "max"))
         for what in ("inline", "gather") for delta in (-1, 0, 1) for ex in (False, True)]
WAYS = [(d, op, n, ex, how) for d, op in (("float32", "sum"), ("float64", "min"),
                                          ("uint16", "band"))
        for n in (0, 7, ("inline", 1), ("gather", 1))
        for ex in (False, True)
        for how in ("out", "inplace", "strided", "strided_out", "2d", "timeout", "i", "init",
                    "init_out", "start")]
# the reduce's chain (engine/alg_chain.pxi: from its least size on, when the ring order is the
# rank order): odd sizes around it, every op of a float and an int, in place and overlapping
CHAIN = [(d, op, ("chain", delta), ex, how)
         for d, op in (("float32", "sum"), ("float64", "min"), ("float32", "max"),
                       ("int16", "prod"), ("uint8", "bxor"), ("complex64", "prod"),
                       ("float16", "sum"), ("bool", "band"))
         for delta in (0, 1, 4099) for ex in (False, True) for how in ("plain", "inplace")]
CHAIN += [("float64", "sum", ("chain", 7), ex, how) for ex in (False, True)
          for how in ("overlap", "strided", "init", "i", "out")]
if ml_dtypes:
    EDGES += [("bfloat16", "max", ("inline", 1), ex, "plain") for ex in (False, True)]
    CHAIN += [("bfloat16", "min", ("chain", 1), ex, "plain") for ex in (False, True)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("P", [1, 2, 3, 4, 5])
def test_scan_and_exscan_every_way_in(P):
    cases = BASE + EDGES + WAYS + CHAIN
    outs = run_ok(scan_worker, P, args=(cases,), stall_timeout=None)
    small = outs[0][0]
    chained = 0
    for i, (dtype, op, where, ex, how) in enumerate(cases):
        d = dt(dtype)
        n = outs[0][1][i][0]
        what_case = (dtype, op, where, n, ex, how)
        want = scan_expected(P, dtype, op, n, i, ex)
        takes = outs[0][1][i][3]
        if _engine.scan_gathers(n * d.itemsize, P, small):
            assert takes, what_case
        for rank in range(P):
            got_n, got, colls, _ = outs[rank][1][i]
            assert got_n == n
            got = unwire(got)
            what = (dtype, op, where, n, ex, how, rank)
            assert got.dtype == d and got.shape == want[rank].shape, what
            assert got.tobytes() == want[rank].tobytes(), what
            # the one engine call (the fold in C), or the transpose scheme's two exchanges
            # the one engine call (gathered and folded in C, or the chain), or the transpose
            # scheme's two exchanges
            assert colls == ([_engine.EXSCAN if ex else _engine.SCAN] if takes else
                             [_engine.ALLTOALL] * 2), (what, colls)
        chained += takes and not _engine.scan_gathers(n * d.itemsize, P, small)
    if P == 2:                      # (the ring order is the rank order at P = 2: the chain runs)
        assert chained >= len(CHAIN)


# ---------------------------------------------------------------------------------------------
# no fresh pages per call


def alloc_worker(comm, n):
    x = np.arange(n, dtype=np.float32) + comm.rank
    o = np.empty_like(x)
    for _ in range(3):                                  # (the engine's stack made once)
        comm.scan(x, out=o)
        comm.exscan(x, out=o)
    peaks = []
    tracemalloc.start()
    try:
        for _ in range(5):          # (the least of 5: a call that outlasts its time slice on a
            tracemalloc.reset_peak()        # loaded machine runs the Python checks, which
            base = tracemalloc.get_traced_memory()[0]       # allocate)
            for _ in range(20):
                comm.scan(x, out=o)
                comm.exscan(x, out=o)
            peaks.append(tracemalloc.get_traced_memory()[1] - base)
    finally:
        tracemalloc.stop()
    peak = min(peaks)
    want = np.sum([np.arange(n, dtype=np.float32) + r for r in range(comm.rank)], axis=0,
                  dtype=np.float32) if comm.rank else np.zeros(n, np.float32)
    assert o.tobytes() == np.asarray(want, np.float32).tobytes()
    return peak


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [512, 8192])
def test_scans_reuse_the_engines_stack(n):
    """2 KiB and 32 KiB per rank at P = 2 (inline, and past the inline limit): calls with
    out= allocate no array: the engine keeps its stack from call to call (a fresh one of P
    rows would be traced here, its pages faulted in on every call)."""
    for peak in run_ok(alloc_worker, 2, args=(n,)):
        assert peak < 1024, peak


# ---------------------------------------------------------------------------------------------
# mismatches: raised on every rank, the group usable after


def _mixed(comm, what):
    P, me = comm.size, comm.rank
    last = me == P - 1
    x = np.ones(3)
    if what == "scan_vs_exscan":
        return (comm.exscan if last else comm.scan)(x)
    if what == "dtype":
        return comm.scan(x.astype(np.float32) if last else x)
    if what == "same_bytes_other_dtype":
        return comm.scan(np.ones(4, np.int32 if last else np.float32))
    if what == "op_quick_vs_parsed":
        return comm.scan(np.repeat(x, 2)[::2] if me == 0 else x, op="max" if last else "sum")
    if what == "small_vs_large":
        n = _engine.SCAN_GATHER_BYTES // (P * 8)
        return comm.scan(np.ones(n + (1 if last else 0)))
    if what == "i_vs_init":
        return comm.iscan(x).wait() if last else comm.exscan_init(x)()
    if what == "scan_vs_allgather":
        return comm.allgather(x) if last else comm.scan(x)
    raise AssertionError(what)


MISMATCHES = {"scan_vs_exscan": ["scan", "exscan"], "dtype": ["float32", "float64"],
              "same_bytes_other_dtype": ["int32", "float32"],
              "op_quick_vs_parsed": ["'max'", "'sum'"], "small_vs_large": ["scan"],
              "i_vs_init": ["scan", "exscan"], "scan_vs_allgather": ["scan", "allgather"]}


def mismatch_worker(comm, names):
    out = []
    for name in names:
        try:
            _mixed(comm, name)
            out.append((name, None, ""))
        except Exception as exc:
            out.append((name, type(exc).__name__, str(exc)))
        got = comm.allreduce(np.array([1.0]), timeout=60)         # in step, usable
        out.append(("after", float(got[0]), ""))
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("P", [2, 3])
def test_mismatch_on_every_rank_then_usable(P):
    names = list(MISMATCHES)
    outs = run_ok(mismatch_worker, P, args=(names,), stall_timeout=None)
    for rank, res in enumerate(outs):
        for k, name in enumerate(names):
            got, what, msg = res[2 * k]
            assert got == name
            assert what == "CollectiveMismatchError", (rank, name, what, msg)
            for word in MISMATCHES[name]:
                assert word in msg, (rank, name, word, msg)
            assert res[2 * k + 1] == ("after", float(P), "")


# ---------------------------------------------------------------------------------------------
# a peer that never comes: the timeout, on the quick path with out= (the bench's call)


def late_worker(comm):
    import time
    x = np.ones(2, np.float32)
    o = np.empty_like(x)
    if comm.rank == 1:
        time.sleep(1.0)
    try:
        comm.exscan(x, out=o, timeout=0.3)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None, ""


@pytest.mark.timeout(60)
def test_a_scan_whose_peer_never_comes_times_out_then_every_rank_raises():
    outs = run_ok(late_worker, 2, stall_timeout=None)
    assert outs[0][0] == "CollectiveTimeoutError" and "exscan" in outs[0][1], outs
    assert outs[1][0] == "PeerLostError", outs


# ---------------------------------------------------------------------------------------------
# exscan of two ranks past the single copy's sizes: rank 0's input, received whole


def pair_worker(comm, cases):
    eng = comm._engine
    eng.cma_bytes, eng.cma_total = 4096, 0      # (every exscan past the chain's least size)
    return scan_worker(comm, cases), eng.cma_counts(), eng.cma_state


PAIR = [(d, op, ("chain", delta), True, how)
        for d, op in (("float64", "max"), ("int16", "prod"), ("complex64", "sum"),
                      ("float16", "min"))
        for delta in (0, 4099) for how in ("plain", "inplace", "overlap", "out")]
PAIR += [("float32", "sum", ("chain", 1), False, "plain")]   # (a scan keeps the chain)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cma", [True, False])
def test_exscan_of_two_ranks_receives_rank_0s_input_whole(cma, monkeypatch):
    """msg_scan's pair (_scan_pair_begin): rank 1's exscan is rank 0's input, moved by the
    exchange (cross-memory attach where allowed: one copy) into its output; rank 0's the
    op's identity.  Against numpy, in place and with out= overlapping the input, the single
    copy allowed and forced off."""
    if cma:
        monkeypatch.delenv("SHMTREE_CMA", raising=False)
    else:
        monkeypatch.setenv("SHMTREE_CMA", "0")
    outs = run_ok(pair_worker, 2, args=(PAIR,), stall_timeout=None)
    for i, (dtype, op, where, ex, how) in enumerate(PAIR):
        n = outs[0][0][1][i][0]
        want = scan_expected(2, dtype, op, n, i, ex)
        for rank in range(2):
            got_n, got, colls, takes = outs[rank][0][1][i]
            got = unwire(got)
            assert takes and colls == [_engine.EXSCAN if ex else _engine.SCAN]
            assert got.tobytes() == want[rank].tobytes(), (dtype, op, n, ex, how, rank)
    counts, state = outs[1][1], outs[1][2]
    if cma and state == "yes":      # (rank 1 read rank 0's inputs: the exscans but the scan,
        # and the first where a peer had not published its probe word when it began)
        assert counts["calls"] >= len(PAIR) - 2 and counts["bytes"] > 0, counts
    else:
        assert counts["calls"] == 0, counts
