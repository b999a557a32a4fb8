"""Errors of allreduce and run (docs/design.md, "Errors").

- local errors (bad dtype, op, out): TypeError / ValueError raised before any communication,
  identically on every rank that made it, leaving the group usable;
- mismatched shape / dtype / op across ranks: every rank raises CollectiveMismatchError (a
  ValueError) saying which ranks passed what;
- a worker that raises: run raises WorkerError with rank, message and remote_traceback.

Every collective here that could hang if the library got it wrong carries a timeout, so that a
bug shows up as an error report rather than as the test's own timeout.
"""
import array
import time

import numpy as np
import pytest

import shmtree

GOOD_N = 5


def good_call(comm):
    """A valid allreduce after an error: the group must still work."""
    y = comm.allreduce(np.full(GOOD_N, comm.rank + 1.0), timeout=30)
    expected = comm.size * (comm.size + 1) / 2
    return bool(np.array_equal(y, np.full(GOOD_N, expected)))


def bad_call(name):
    """(args, kwargs, expected exception name) of one invalid allreduce."""
    x = np.arange(6, dtype=np.float64)
    ro = np.empty(6)
    ro.flags.writeable = False
    table = {
        # min/max of complex
        "complex64_min": ((np.ones(4, np.complex64),), dict(op="min"), "TypeError"),
        "complex128_max": ((np.ones(4, np.complex128),), dict(op="max"), "TypeError"),
        "complex128_np_maximum": ((np.ones(3, np.complex128),), dict(op=np.maximum),
                                  "TypeError"),
        "complex64_np_minimum_0d": ((np.array(1 + 1j, np.complex64),), dict(op=np.minimum),
                                    "TypeError"),
        # unsupported dtypes
        "object": ((np.array([1, 2, 3], dtype=object),), {}, "TypeError"),
        "str": ((np.array(["a", "bc"]),), {}, "TypeError"),
        "bytes": ((np.array([b"a", b"bc"]),), {}, "TypeError"),
        "float128": ((np.ones(4, dtype=np.longdouble),), {}, "TypeError"),
        "complex256": ((np.ones(4, dtype=np.clongdouble),), {}, "TypeError"),
        "datetime64": ((np.array(["2020-01-01"], dtype="datetime64[D]"),), {}, "TypeError"),
        "structured": ((np.zeros(3, dtype=[("a", "i4"), ("b", "f8")]),), {}, "TypeError"),
        "float128_max": ((np.ones(4, dtype=np.longdouble),), dict(op="max"), "TypeError"),
        # unknown ops
        "op_mean": ((x,), dict(op="mean"), "ValueError"),
        "op_bogus": ((x,), dict(op="bogus"), "ValueError"),
        "op_empty": ((x,), dict(op=""), "ValueError"),
        "op_np_subtract": ((x,), dict(op=np.subtract), "ValueError"),
        # mismatched out
        "out_short": ((x,), dict(out=np.empty(5)), "ValueError"),
        "out_long": ((x,), dict(out=np.empty(7)), "ValueError"),
        "out_float32": ((x,), dict(out=np.empty(6, np.float32)), "ValueError"),
        "out_int64_same_itemsize": ((x,), dict(out=np.empty(6, np.int64)), "ValueError"),
        "out_readonly": ((x,), dict(out=ro), "ValueError"),
        "out_2d_wrong_shape": ((np.ones((2, 3)),), dict(out=np.empty((3, 2))), "ValueError"),
        "out_array_wrong_type": ((x,), dict(out=array.array("f", [0.0] * 6)), "ValueError"),
        "out_array_same_size_wrong_type": ((x,), dict(out=array.array("q", [0] * 6)),
                                           "ValueError"),
        "out_array_wrong_length": ((x,), dict(out=array.array("d", [0.0] * 5)), "ValueError"),
        "out_bytearray": ((x,), dict(out=bytearray(48)), "ValueError"),
    }
    return table[name]


BAD_CALLS = ["complex64_min", "complex128_max", "complex128_np_maximum",
             "complex64_np_minimum_0d", "object", "str", "bytes", "float128", "complex256",
             "datetime64", "structured", "float128_max", "op_mean", "op_bogus", "op_empty",
             "op_np_subtract", "out_short", "out_long", "out_float32", "out_int64_same_itemsize",
             "out_readonly", "out_2d_wrong_shape", "out_array_wrong_type",
             "out_array_same_size_wrong_type", "out_array_wrong_length", "out_bytearray"]


LOCAL_RAISE_S = 10.0        # a local check waits for no peer; a bad call that did wait for its
                            # peers would wait forever (no timeout is given), so this bound is
                            # about a hang, not speed: generous for a loaded machine


def local_error_worker(comm, names, who):
    """For each bad call: the ranks in ``who`` (all if None) make it; then every rank makes a
    valid call.  Returns, per bad call, (exception name or None, message, isinstance checks,
    seconds taken, the valid call's result was right)."""
    reports = []
    for name in names:
        args, kwargs, _ = bad_call(name)
        rep = dict(name=name, raised=None, msg="", seconds=0.0)
        if who is None or comm.rank in who:
            t0 = time.monotonic()
            try:
                comm.allreduce(*args, **kwargs)
                rep["raised"] = None
            except Exception as e:
                rep.update(raised=type(e).__name__, msg=str(e),
                           is_type=isinstance(e, TypeError), is_value=isinstance(e, ValueError),
                           is_peer_lost=isinstance(e, shmtree.PeerLostError))
            rep["seconds"] = time.monotonic() - t0
            if rep.get("is_peer_lost"):
                reports.append(rep)
                return reports                      # the group is gone: stop here
        try:
            rep["good_after"] = good_call(comm)
        except Exception as e:
            rep["good_after"] = f"{type(e).__name__}: {e}"
            reports.append(rep)
            return reports
        reports.append(rep)
    return reports


def run_ok(fn, nprocs, **kw):
    try:
        return shmtree.run(fn, nprocs, **kw)
    except shmtree.WorkerError as e:
        pytest.fail(f"{e}\n--- remote traceback ---\n{getattr(e, 'remote_traceback', None)}")


def check_local_errors(results, makers):
    failures = []
    for i, name in enumerate(BAD_CALLS):
        want = bad_call(name)[2]
        reps = {}
        for rank, res in enumerate(results):
            if i >= len(res):
                failures.append(f"{name}: rank {rank} stopped before this case")
                continue
            rep = res[i]
            reps[rank] = rep
            if rep["good_after"] is not True:
                failures.append(f"{name}: rank {rank}: the valid call after it gave "
                                f"{rep['good_after']!r}")
            if rank not in makers:
                continue
            flag = {"TypeError": "is_type", "ValueError": "is_value"}[want]
            if rep["raised"] is None:
                failures.append(f"{name}: rank {rank}: no exception (wanted {want})")
            elif not rep.get(flag):
                failures.append(f"{name}: rank {rank}: raised {rep['raised']}: {rep['msg']} "
                                f"(wanted a {want})")
            elif rep["seconds"] > LOCAL_RAISE_S:
                failures.append(f"{name}: rank {rank}: took {rep['seconds']:.2f} s to raise")
        made = {(reps[r]["raised"], reps[r]["msg"]) for r in makers if r in reps}
        if len(made) > 1:
            failures.append(f"{name}: ranks raised different errors: {sorted(made, key=str)}")
        if any(i >= len(res) for res in results):
            break
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P", [1, 3])
def test_local_errors_on_every_rank(P):
    """Every rank makes the same bad call, then a valid one."""
    check_local_errors(run_ok(local_error_worker, P, args=(BAD_CALLS, None)), range(P))


@pytest.mark.timeout(120)
def test_local_errors_on_one_rank():
    """Only rank 2 makes the bad call: it must fail before communicating, so that its next
    (valid) call meets the other ranks' valid call."""
    check_local_errors(run_ok(local_error_worker, 3, args=(BAD_CALLS, (2,))), (2,))


@pytest.mark.timeout(120)
def test_local_errors_then_big_allreduce():
    """After the local errors a large allreduce (many chunks) still works."""
    results = run_ok(local_errors_then_big_worker, 4, chunk_bytes=4096)
    assert results == [True] * 4


def local_errors_then_big_worker(comm):
    for name in ("complex64_min", "object", "op_mean", "out_short"):
        args, kwargs, _ = bad_call(name)
        try:
            comm.allreduce(*args, **kwargs)
        except (TypeError, ValueError):
            pass
    x = np.arange(300_001, dtype=np.int64) * (comm.rank + 1)
    y = comm.allreduce(x, timeout=60)
    return bool(np.array_equal(y, np.arange(300_001, dtype=np.int64) * 10))


# ---------------------------------------------------------------------------------------------
# mismatches across ranks

def mismatch_args(kind, rank):
    """(array, op) passed by ``rank`` in a mismatch scenario."""
    if kind == "shape_length":
        return np.ones(17 if rank == 1 else 13), "sum"
    if kind == "shape_same_size":
        return np.ones((3, 4) if rank == 2 else (2, 6), dtype=np.int32), "sum"
    if kind == "dtype_same_nbytes":
        return (np.ones(8, np.float32) if rank == 0 else np.ones(4, np.float64)), "sum"
    if kind == "dtype_same_itemsize":
        return np.ones(64, np.int64 if rank == 1 else np.float64), "max"
    if kind == "op":
        return np.ones(10), "max" if rank == 1 else "sum"
    if kind == "op_ufunc_halves":
        return np.ones(10), np.multiply if rank < 2 else np.minimum
    if kind == "empty_shapes":
        return np.ones((0, 5) if rank == 1 else (0,)), "sum"
    if kind == "zero_d_vs_one":
        return (np.array(1.0) if rank == 0 else np.ones(1)), "sum"
    if kind == "big_shape":
        return np.ones(300_007 if rank == 3 else 300_001), "sum"
    raise KeyError(kind)


# what the message must mention (any one of each group)
MISMATCH_WORDS = {
    "shape_length": [["13"], ["17"]],
    "shape_same_size": [["(3, 4)", "(3,4)", "3x4", "[3, 4]"], ["(2, 6)", "(2,6)", "2x6", "[2, 6]"]],
    "dtype_same_nbytes": [["float32"], ["float64"]],
    "dtype_same_itemsize": [["int64"], ["float64"]],
    "op": [["max", "maximum"], ["sum", "add"]],
    "op_ufunc_halves": [["prod", "multiply"], ["min", "minimum"]],
    "big_shape": [["300007"], ["300001"]],
    "empty_shapes": [["(0, 5)", "(0,5)", "0x5", "[0, 5]"], ["(0,)", "[0]"]],
    "zero_d_vs_one": [["()", "[]", "0-d"], ["(1,)", "[1]"]],
}


def mismatch_worker(comm, kind):
    x, op = mismatch_args(kind, comm.rank)
    t0 = time.monotonic()
    try:
        comm.allreduce(x, op=op, timeout=30)
        return dict(raised=None, seconds=time.monotonic() - t0)
    except Exception as e:
        return dict(raised=type(e).__name__, msg=str(e), seconds=time.monotonic() - t0,
                    is_mismatch=isinstance(e, shmtree.CollectiveMismatchError),
                    is_value=isinstance(e, ValueError))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind,P", [("shape_length", 3), ("shape_same_size", 3),
                                    ("dtype_same_nbytes", 3), ("dtype_same_itemsize", 2),
                                    ("op", 3), ("op_ufunc_halves", 4), ("big_shape", 4),
                                    ("empty_shapes", 3), ("zero_d_vs_one", 2)])
def test_mismatch_raises_on_every_rank(kind, P):
    results = run_ok(mismatch_worker, P, args=(kind,))
    failures = []
    for rank, rep in enumerate(results):
        if not rep.get("is_mismatch") or not rep.get("is_value"):
            failures.append(f"rank {rank}: raised {rep['raised']}: {rep.get('msg')} after "
                            f"{rep['seconds']:.2f} s (wanted CollectiveMismatchError)")
            continue
        msg = rep["msg"]
        if "rank" not in msg.lower():
            failures.append(f"rank {rank}: message does not mention ranks: {msg!r}")
        for group in MISMATCH_WORDS[kind]:
            if not any(w in msg for w in group):
                failures.append(f"rank {rank}: message lacks any of {group}: {msg!r}")
        if rep["seconds"] > 10:
            failures.append(f"rank {rank}: took {rep['seconds']:.1f} s")
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------------------------
# a worker that raises

def raising_worker(comm, bad_rank, before_first_call):
    x = np.ones(1000)
    if not before_first_call:
        comm.allreduce(x)
    if comm.rank == bad_rank:
        raise ValueError("boom from the test, code 4242")
    while True:                                     # others stay in collectives until stopped
        comm.allreduce(x)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("P,bad_rank,before_first_call,start_method",
                         [(3, 2, False, None), (4, 0, True, None), (2, 1, False, "spawn")])
def test_worker_raises_value_error(P, bad_rank, before_first_call, start_method):
    kw = {} if start_method is None else dict(start_method=start_method)
    t0 = time.monotonic()
    with pytest.raises(shmtree.WorkerError) as info:
        shmtree.run(raising_worker, P, args=(bad_rank, before_first_call), **kw)
    elapsed = time.monotonic() - t0
    err = info.value
    assert isinstance(err, shmtree.ShmtreeError)
    assert err.rank == bad_rank
    assert str(err).startswith(f"rank {bad_rank} failed:"), str(err)
    assert "ValueError" in str(err) and "boom from the test, code 4242" in str(err), str(err)
    tb = err.remote_traceback
    assert "ValueError" in tb and "boom from the test, code 4242" in tb, tb
    assert "raising_worker" in tb, tb
    assert elapsed < 30, f"run took {elapsed:.1f} s to report the failure"


def return_value_worker(comm):
    return {"rank": comm.rank, "array": np.arange(3) * comm.rank}


@pytest.mark.timeout(60)
def test_run_returns_arbitrary_picklable_values():
    results = run_ok(return_value_worker, 3)
    for r, res in enumerate(results):
        assert res["rank"] == r and res["array"].tolist() == [0, r, 2 * r]


# ---------------------------------------------------------------------------------------------
# issue 21, item 16: a user's first mistakes get messages that say what to do


@pytest.mark.parametrize("op", ["band", "bor", "bxor", np.bitwise_and])
@pytest.mark.parametrize("dtype", [np.complex64, np.complex128, np.float32])
def test_bitwise_op_on_complex_or_float_names_the_dtypes_it_takes(op, dtype):
    """A bitwise op on complex said "complex numbers have no order" (the min/max reason)."""
    with shmtree.Group(1, pin=False) as group:
        comm = group.join(0)
        try:
            with pytest.raises(TypeError, match="bitwise ops take integer and bool dtypes") \
                    as info:
                comm.allreduce(np.ones(4, dtype), op=op)
            assert "order" not in str(info.value), str(info.value)
            with pytest.raises(TypeError, match="complex numbers have no order"):
                comm.allreduce(np.ones(4, np.complex64), op="max")
        finally:
            comm.close()


def never_called(comm, *args, **kwargs):
    raise AssertionError("run started workers for a call it should have refused")


def _refused_before_any_process(monkeypatch):
    """Make starting a group fail loudly: run must refuse before it creates one."""
    import shmtree.launching.launch

    def no_group(*args, **kwargs):
        raise AssertionError("run created a group for a call it should have refused")
    monkeypatch.setattr(shmtree.launching.launch, "Group", no_group)


@pytest.mark.parametrize("options,match", [
    (dict(chunk_byte=4096), r"unknown option 'chunk_byte' \(did you mean 'chunk_bytes'\?\); "
                            r"valid options: args, kwargs, start_method, topology, tree, "
                            r"chunk_bytes"),
    (dict(arg=(1,)), r"unknown option 'arg' \(did you mean 'args'\?\)"),
    (dict(startmethod="fork"), r"did you mean 'start_method'\?"),
    (dict(bogus=1, tre="flat"), r"unknown options 'bogus', 'tre' \(did you mean 'tree'\?\)"),
])
def test_run_refuses_unknown_options_naming_the_valid_ones(monkeypatch, options, match):
    _refused_before_any_process(monkeypatch)
    with pytest.raises(TypeError, match=match) as info:
        shmtree.run(never_called, 2, **options)
    assert str(info.value).startswith("shmtree.run: "), str(info.value)
    assert "__init__" not in str(info.value)


@pytest.mark.parametrize("kw,match", [
    (dict(args=5), r"shmtree.run: args must be a tuple of positional arguments, got int 5; "
                   r"for a single argument write args=\(5,\)"),
    (dict(args="abc"), r"args must be a tuple .* got str"),
    (dict(kwargs=[1, 2]), r"shmtree.run: kwargs must be a dict of keyword arguments, got list"),
    (dict(kwargs={1: 2}), r"keys of kwargs must be strings"),
])
def test_run_checks_args_and_kwargs_in_the_caller(monkeypatch, kw, match):
    """run(fn, 2, args=5) failed only inside the workers (a WorkerError per rank)."""
    _refused_before_any_process(monkeypatch)
    with pytest.raises(TypeError, match=match):
        shmtree.run(never_called, 2, **kw)


def test_run_refuses_a_function_that_is_not_callable(monkeypatch):
    _refused_before_any_process(monkeypatch)
    with pytest.raises(TypeError, match="shmtree.run: fn must be callable, got 42"):
        shmtree.run(42, 2)


def args_back(comm, *args, **kwargs):
    return args, kwargs


@pytest.mark.timeout(60)
def test_run_still_takes_a_list_of_args():
    assert run_ok(args_back, 1, args=[1, 2], kwargs=dict(k=3)) == [((1, 2), {"k": 3})]


@pytest.mark.parametrize("kw,match", [
    (dict(chunk_byte=4096), r"shmtree.Pool: unknown option 'chunk_byte' \(did you mean "
                            r"'chunk_bytes'\?\); valid options: processes, initializer, "
                            r"initargs, context, topology"),
    (dict(initializr=print), r"did you mean 'initializer'\?"),
    (dict(initializer=print, initargs=5), r"shmtree.Pool: initargs must be a tuple of "
                                          r"positional arguments, got int 5"),
])
def test_pool_checks_its_arguments_before_starting_workers(monkeypatch, kw, match):
    import shmtree.launching.pool

    def no_group(*args, **kwargs):
        raise AssertionError("Pool created a group for a call it should have refused")
    monkeypatch.setattr(shmtree.launching.pool, "Group", no_group)
    with pytest.raises(TypeError, match=match):
        shmtree.Pool(2, **kw)


def pool_size(comm):
    return comm.size


@pytest.mark.timeout(90)
def test_pool_refuses_a_task_that_is_not_callable_in_the_caller():
    with shmtree.Pool(2) as pool:
        with pytest.raises(TypeError, match="shmtree.Pool: a task must be callable, got 5"):
            pool.map(5, range(2))
        with pytest.raises(TypeError, match="shmtree.Pool.run: fn must be callable, got 5"):
            pool.run(5)
        assert pool.run(pool_size) == [2, 2]              # the pool is still whole
