"""One path per call (docs/design.md, "Layers" and "One call"): the public collectives written
once, one engine entry, the selection taken from the Plan, and a call the engine's parser
declines running the very same engine call once it is normalised."""
import inspect

import numpy as np
import pytest

import shmtree
from shmtree import _engine
from shmtree.frontend import calls, front
from shmtree.communicators.communicator import Communicator
from shmtree.groups.group import Group
from shmtree.internode.nodes import Spanning
from shmtree.machine.plan import ENGINE_ORDER, plan_group

from procutil import run_ok


def test_every_public_collective_is_written_once():
    for name in front.PUBLIC:
        for cls in (Communicator, Spanning):
            assert name not in vars(cls), f"{cls.__name__} defines {name} again"
            assert getattr(cls, name) is getattr(front.Front, name)


def test_module_functions_are_the_front_ends():
    for name in front.PUBLIC:
        fn = getattr(shmtree, name)
        method = getattr(front.Front, name)
        params = list(inspect.signature(method).parameters.values())[1:]
        assert inspect.signature(fn) == inspect.signature(method).replace(parameters=params)
        assert fn.__doc__ == method.__doc__


def test_the_engine_has_one_entry():
    methods = {n for n in dir(_engine.Engine) if not n.startswith("__")}
    assert {"call", "progress", "give_output", "cancel"} <= methods
    for old in ("begin", "begin_coll", "begin_error", "quick", "quick_allgather", "quick_reduce",
                "quick_reduce_scatter", "quick_broadcast", "quick_bcast", "resume_bcast"):
        assert old not in methods, old
    assert (_engine.ALLREDUCE, _engine.BROADCAST, _engine.REDUCE, _engine.REDUCE_SCATTER,
            _engine.ALLGATHER, _engine.BARRIER) == (calls.ALLREDUCE, calls.BROADCAST,
                                                     calls.REDUCE, calls.REDUCE_SCATTER,
                                                     calls.ALLGATHER, calls.BARRIER)


@pytest.mark.parametrize("size,tree,small", [(1, None, None), (2, None, None), (3, "ring", 4096),
                                             (5, "binary", 100), (4, "chain", 0)])
def test_selection_is_the_plans(size, tree, small):
    plan = plan_group(size, tree=tree, small_bytes=small)
    table = plan.selection()
    assert sorted(table) == list(range(len(ENGINE_ORDER)))
    for number, name in enumerate(ENGINE_ORDER):
        assert calls.COLLECTIVE_NAMES[number] == name
        limit, alg = table[number]
        assert limit == plan.small_bytes
        assert alg == plan.algorithm(name, plan.small_bytes + 1)
        if size > 1:
            assert plan.algorithm(name, plan.small_bytes) == "inline"


def _both_paths(comm, n):
    """Each collective twice: a plain array (the engine parses it) and a strided view of the
    same values (declined, normalised, then the same engine call): per collective and path
    the result, the engine calls it took and the bytes it sent."""
    P, me = comm.size, comm.rank
    base = np.arange(2 * n, dtype=np.float64).reshape(n, 2) + me
    plain = np.ascontiguousarray(base[:, 0])
    strided = base[:, 0]
    assert not strided.flags.c_contiguous
    ops = {
        "allreduce": lambda a: comm.allreduce(a),
        "reduce": lambda a: comm.reduce(a, root=P - 1),
        "reduce_scatter": lambda a: comm.reduce_scatter(a),
        "allgather": lambda a: comm.allgather(a),
        "broadcast": lambda a: comm.broadcast(a, root=0),
        "gather": lambda a: comm.gather(a, root=P - 1),
        "scan": lambda a: comm.scan(a, op="max"),
        "exscan": lambda a: comm.exscan(a),
    }
    got = {}
    for name, op in ops.items():
        for path, a in (("plain", plain), ("strided", strided)):
            before = comm.stats()
            res = op(a)
            after = comm.stats()
            got[name, path] = (None if res is None else np.array(res),
                               after["calls"] - before["calls"],
                               after["bytes_sent"] - before["bytes_sent"])
    return got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P,tree", [(2, None), (3, "ring"), (3, "binary")])
@pytest.mark.parametrize("n", [7, 40000])
def test_a_declined_call_runs_the_same_engine_call(P, tree, n):
    outs = run_ok(_both_paths, P, args=(n,), tree=tree)
    for rank, got in enumerate(outs):
        for name in ("allreduce", "reduce", "reduce_scatter", "allgather", "broadcast",
                     "gather", "scan", "exscan"):
            res_p, calls_p, sent_p = got[name, "plain"]
            res_s, calls_s, sent_s = got[name, "strided"]
            # (a large gather or scan is an exchange or two: the parsed path's alone)
            one = 1 if name not in ("gather", "scan", "exscan") or n * 8 * P <= 4096 else calls_p
            assert calls_p == calls_s == one, (rank, name, calls_p, calls_s)
            assert sent_p == sent_s, (rank, name, sent_p, sent_s)      # the same algorithm
            if res_p is None:
                assert res_s is None
            else:
                assert np.array_equal(res_p, res_s), (rank, name)


def test_group_runs_the_plans_selection():
    """The engine takes its selection from the Plan: a group whose plan keeps nothing inline
    (small_bytes=0) runs even an 8-byte reduce_scatter on its ring algorithm, whose bytes are
    the blocks' (the allreduce it would run inline sends the whole message)."""
    with Group(2, small_bytes=0, tree="ring") as group:
        assert group.plan.selection()[calls.REDUCE_SCATTER] == (0, "blocks")
    outs = run_ok(_rs_bytes, 2, small_bytes=0, tree="ring")
    assert all(sent == 8 for sent in outs), outs        # one of two 8-byte rows, each rank
    outs = run_ok(_rs_bytes, 2, tree="ring")
    assert all(sent > 8 for sent in outs), outs         # inline: the whole 16 bytes, at least


def _rs_bytes(comm):
    before = comm.stats()["bytes_sent"]
    res = comm.reduce_scatter(np.ones(2))
    assert np.array_equal(res, [comm.size])
    return comm.stats()["bytes_sent"] - before


def _mixed_paths(comm, n):
    """Rank 0 passes plain arrays (the quick paths), the others strided views of the same
    values (the parsed paths), in one call: the descriptors agree, the results are numpy's;
    then an op that differs on one rank is a mismatch on every rank."""
    P, me = comm.size, comm.rank
    base = np.arange(2 * n, dtype=np.float32).reshape(n, 2) * (me + 1)
    a = np.ascontiguousarray(base[:, 0]) if me == 0 else base[:, 0]
    everyone = [np.arange(0, 2 * n, 2, dtype=np.float32) * (r + 1) for r in range(P)]
    g = comm.gather(a, root=P - 1)
    if me == P - 1:
        assert np.array_equal(g, np.stack(everyone))
    else:
        assert g is None
    assert np.array_equal(comm.scan(a), np.add.accumulate(np.stack(everyone))[me])
    ex = comm.exscan(a, op="max")
    if me:
        assert np.array_equal(ex, np.maximum.accumulate(np.stack(everyone))[me - 1])
    try:
        comm.scan(a, op="max" if me == 1 else "sum")
        said = None
    except shmtree.CollectiveMismatchError as exc:
        said = str(exc)
    assert comm.allreduce(np.ones(1))[0] == P
    return said


@pytest.mark.timeout(60)
@pytest.mark.parametrize("P", [2, 3])
def test_quick_and_parsed_paths_meet_in_one_call(P):
    for rank, said in enumerate(run_ok(_mixed_paths, P, args=(5,))):
        assert said is not None and "max" in said and "sum" in said, (rank, said)
