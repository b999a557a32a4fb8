"""The torch backend does not lie (issue 21, items 4, 5, 6, 14): a failed posted operation fails
its Work and its future; outputs of any layout are written; ReduceOp.AVG of integer tensors is
refused before anything is touched, with gloo's error; an operation the backend does not offer
says so, naming shmtree and the operation.  Under torch.multiprocessing.spawn with FileStores."""
import os
import signal

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch backend's tests need torch")
dist = pytest.importorskip("torch.distributed", reason="the torch backend needs torch.distributed")
mp = pytest.importorskip("torch.multiprocessing", reason="these tests start torch's processes")

N = 131072                    # 512 KiB of float32: above INLINE_BYTES, the posted path

# each operation of a posted-failure pair: rank 0 posts it, then rank 1 dies (it never joins)
POSTED = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
          "reduce_scatter", "reduce_scatter_tensor")


def _post(name, rank):
    """Post operation `name` (async_op) on 512 KiB tensors; rank 0 needs rank 1's part."""
    t = torch.full((N,), rank + 1.0)
    if name == "all_reduce":
        return dist.all_reduce(t, async_op=True)
    if name == "broadcast":
        return dist.broadcast(t, src=1, async_op=True)
    if name == "reduce":
        return dist.reduce(t, dst=0, async_op=True)
    if name == "all_gather":
        return dist.all_gather([torch.empty(N) for _ in range(2)], t, async_op=True)
    if name == "all_gather_into_tensor":
        return dist.all_gather_into_tensor(torch.empty(2 * N), t, async_op=True)
    if name == "reduce_scatter":
        return dist.reduce_scatter(torch.empty(N), [t, t.clone()], async_op=True)
    return dist.reduce_scatter_tensor(torch.empty(N // 2), t, async_op=True)


def _outcome(fn):
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def posted_failure_worker(rank, store_path, outdir):
    import torch.distributed as dist

    import shmtree.torch  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("shmtree", store=store, rank=rank, world_size=2)
    if rank == 1:
        store.get("die")                       # once rank 0 has posted its operations
        os.kill(os.getpid(), signal.SIGKILL)
    works = {name: _post(name, rank) for name in POSTED}   # the first in flight, the rest queued
    pending = {name: not w.is_completed() for name, w in works.items()}  # (they need rank 1)
    store.set("die", "1")
    got = {}
    for name, work in works.items():
        got[name] = {"pending": pending[name],
                     "wait": _outcome(work.wait),
                     "future": _outcome(lambda: work.get_future().wait()),
                     "value": _outcome(lambda: work.get_future().value()),
                     "success": work.is_success()}
    got["next"] = _outcome(lambda: dist.all_reduce(torch.ones(2)))
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    torch.save(got, os.path.join(outdir, "posted.pt"))


@pytest.mark.timeout(180)
def test_a_failed_posted_operation_fails_its_work_and_future(tmp_path):
    """Item 4: rank 0 posts a 512 KiB operation of each kind, then rank 1 dies without joining
    them: each one's wait() raises, its future fails (wait and value), and the next operation
    raises too."""
    ctx = mp.start_processes(posted_failure_worker,
                             args=(str(tmp_path / "store"), str(tmp_path)),
                             nprocs=2, join=False, start_method="spawn")
    try:
        for p in ctx.processes:
            p.join(120)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in ctx.processes] == [0, -signal.SIGKILL]
    got = torch.load(tmp_path / "posted.pt")
    assert got["next"].startswith("RuntimeError") and "shmtree" in got["next"], got["next"]
    for name in POSTED:
        assert got[name]["pending"] and got[name]["success"] is False, (name, got[name])
        for how in ("wait", "future", "value"):
            outcome = got[name][how]
            assert outcome.startswith("RuntimeError") and "rank 1 died" in outcome \
                and "shmtree" in outcome, (name, how, outcome)


def checks_worker(rank, size, store_path, outdir, backend):
    """Items 5, 6 and 14 in one world (run under gloo too, for its errors)."""
    import torch.distributed as dist

    import shmtree.torch  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group(backend, store=dist.FileStore(store_path, size), rank=rank,
                            world_size=size)
    R = dist.ReduceOp
    got = {}

    # item 6: AVG of integer (and bool) tensors, small (inline) and large (posted)
    def avg_cases():
        yield "all_reduce int32", torch.arange(4, dtype=torch.int32) + rank, \
            lambda t: dist.all_reduce(t, op=R.AVG)
        yield "all_reduce int64 large", torch.arange(100003, dtype=torch.int64) + rank, \
            lambda t: dist.all_reduce(t, op=R.AVG)
        yield "all_reduce bool", torch.tensor([True, False, rank == 0]), \
            lambda t: dist.all_reduce(t, op=R.AVG)
        yield "reduce int16", torch.arange(5, dtype=torch.int16) + rank, \
            lambda t: dist.reduce(t, dst=0, op=R.AVG)
        yield "reduce_scatter_tensor int32", torch.zeros(3, dtype=torch.int32), \
            lambda t: dist.reduce_scatter_tensor(
                t, torch.arange(3 * size, dtype=torch.int32) + rank, op=R.AVG)
        yield "reduce_scatter uint8", torch.zeros(70000, dtype=torch.uint8), \
            lambda t: dist.reduce_scatter(
                t, [torch.full((70000,), k + rank, dtype=torch.uint8) for k in range(size)],
                op=R.AVG)
    for name, t, call in avg_cases():
        if backend == "gloo" and "scatter" in name:
            continue                            # (gloo's fails later, in its next operation)
        before = t.clone()
        outcome = _outcome(lambda: call(t))
        got["avg " + name] = (outcome, torch.equal(t, before))
    t = torch.full((3,), rank + 1.0)
    dist.all_reduce(t, op=R.AVG)
    got["avg after"] = t.tolist()

    if backend == "shmtree":
        got["layouts"] = layouts(rank, size)
        got["unsupported"] = unsupported(rank, size)
        got["coalesced"] = coalesced(rank, size)
        t = torch.ones(2)
        dist.all_reduce(t)
        got["after"] = t.tolist()
    dist.barrier()
    dist.destroy_process_group()
    torch.save(got, os.path.join(outdir, f"{backend}-{rank}.pt"))


def layouts(rank, size):
    """Item 5: every operation into outputs that are not contiguous (transposed: no view of the
    shape the operation writes), at an inline and a posted size; the outputs as lists."""
    got = {}
    for m in (3, 20000):
        # all_reduce / broadcast / reduce in place on a transposed tensor
        t = (torch.arange(2 * m, dtype=torch.float32).reshape(2, m) + rank).t()
        dist.all_reduce(t)
        got[("all_reduce", m)] = t.reshape(-1).tolist()
        t = (torch.arange(2 * m, dtype=torch.float32).reshape(2, m) * (rank + 1)).t()
        dist.broadcast(t, src=size - 1)
        got[("broadcast", m)] = t.reshape(-1).tolist()
        t = (torch.arange(2 * m, dtype=torch.float32).reshape(2, m) + rank).t()
        dist.reduce(t, dst=0)
        got[("reduce", m)] = t.reshape(-1).tolist() if rank == 0 else None
        # all_gather into transposed outputs
        outs = [torch.zeros(2, m).t() for _ in range(size)]
        dist.all_gather(outs, torch.arange(2 * m, dtype=torch.float32).reshape(m, 2) + 10 * rank)
        got[("all_gather", m)] = [o.reshape(-1).tolist() for o in outs]
        # all_gather_into_tensor: a (2*size*m, 2) transposed output for inputs of 4m
        out = torch.zeros(2, 2 * size * m).t()
        dist.all_gather_into_tensor(out, torch.arange(4 * m, dtype=torch.float32) + 1000 * rank)
        got[("all_gather_into_tensor", m)] = out.reshape(-1).tolist()
        # reduce_scatter: a transposed (m, 2) output
        out = torch.zeros(2, m).t()
        parts = [torch.arange(2 * m, dtype=torch.float32).reshape(m, 2) + 10 * k + 100 * rank
                 for k in range(size)]
        dist.reduce_scatter(out, parts)
        got[("reduce_scatter", m)] = out.reshape(-1).tolist()
        # reduce_scatter_tensor: a (2m, 2) transposed output for blocks of 4m; SUM and AVG
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            out = torch.zeros(2, 2 * m).t()
            dist.reduce_scatter_tensor(
                out, torch.arange(4 * m * size, dtype=torch.float32) * (rank + 1), op=op)
            got[("reduce_scatter_tensor", m, str(op))] = out.reshape(-1).tolist()
    return got


def unsupported(rank, size):
    """Item 14: every operation the backend does not offer, and an unsupported ReduceOp."""
    # (gather, scatter, all_to_all, send / recv and the object forms are supported since
    # issue 25, recv from any source since issue 34: tests/test_torch_ops.py, test_torch.py)
    calls = {
        "premul_sum": lambda: dist.all_reduce(torch.ones(2),
                                              op=dist._make_nccl_premul_sum(2.0)),
    }
    return {name: _outcome(call) for name, call in calls.items()}


def coalesced(rank, size):
    """The coalesced forms, unsupported before issue 25: all_reduce_coalesced,
    all_gather_coalesced, and all_reduce under torch's coalescing manager."""
    from torch.distributed.distributed_c10d import _coalescing_manager
    got = {}
    ts = [torch.ones(2) * (rank + 1), torch.ones(3)]
    dist.all_reduce_coalesced(ts)
    got["all_reduce_coalesced"] = [t.tolist() for t in ts]
    outs = [[torch.zeros(2)] for _ in range(size)]
    dist.all_gather_coalesced(outs, [torch.ones(2) * rank])
    got["all_gather_coalesced"] = [o[0].tolist() for o in outs]
    a, b = torch.ones(2) * (rank + 1), torch.ones(3)
    with _coalescing_manager():
        dist.all_reduce(a)
        dist.all_reduce(b)
    got["coalescing_manager"] = [a.tolist(), b.tolist()]
    return got


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """The checks worker's findings under gloo and under shmtree, {backend: [per rank]}."""
    out = tmp_path_factory.mktemp("torch-checks")
    found = {}
    for backend in ("gloo", "shmtree"):
        mp.spawn(checks_worker, args=(2, str(out / f"store-{backend}"), str(out), backend),
                 nprocs=2, join=True)
        found[backend] = [torch.load(out / f"{backend}-{r}.pt") for r in range(2)]
    return found


@pytest.mark.timeout(300)
def test_avg_of_integer_tensors_is_refused_before_any_call(checks):
    """Item 6: gloo's RuntimeError and words; the tensor untouched (gloo's is summed before
    its division fails); the group goes on."""
    for rank in range(2):
        ours, gloos = checks["shmtree"][rank], checks["gloo"][rank]
        names = [k for k in ours if k.startswith("avg ") and k != "avg after"]
        assert len(names) == 6
        for name in names:
            outcome, untouched = ours[name]
            assert outcome.startswith("RuntimeError: shmtree:") and "ReduceOp.AVG" in outcome \
                and "result type Float can't be cast to the desired output type" in outcome, \
                (name, outcome)
            assert untouched, name
            theirs = gloos[name][0] if name in gloos else ""
            if theirs.startswith("RuntimeError: result type"):     # gloo's own words
                assert theirs.split(": ", 1)[1] in outcome, (name, theirs, outcome)
        assert gloos["avg all_reduce int32"][0].startswith("RuntimeError")
        assert ours["avg after"] == gloos["avg after"] == [1.5] * 3


@pytest.mark.timeout(300)
def test_outputs_that_are_not_contiguous_are_written(checks):
    """Item 5: every operation writes outputs that have no view of the shape it writes."""
    P = 2
    for rank in range(P):
        got = checks["shmtree"][rank]["layouts"]
        for m in (3, 20000):
            base = np.arange(2 * m, dtype=np.float32).reshape(2, m)

            def flat(a):                      # a tensor's logical order (t.reshape(-1))
                return np.asarray(a, np.float32).reshape(-1).tolist()
            assert got[("all_reduce", m)] == flat(sum(base + r for r in range(P)).T), m
            assert got[("broadcast", m)] == flat((base * P).T), m
            assert got[("reduce", m)] == (flat(sum(base + r for r in range(P)).T)
                                         if rank == 0 else None), m
            mine = np.arange(2 * m, dtype=np.float32).reshape(m, 2)
            assert got[("all_gather", m)] == [flat(mine + 10 * r) for r in range(P)], m
            want = np.concatenate([np.arange(4 * m, dtype=np.float32) + 1000 * r
                                   for r in range(P)])
            assert got[("all_gather_into_tensor", m)] == want.tolist(), m
            want = sum(mine + 10 * rank + 100 * r for r in range(P))
            assert got[("reduce_scatter", m)] == flat(want), m
            whole = sum(np.arange(4 * m * P, dtype=np.float32) * (r + 1) for r in range(P))
            block = whole[rank * 4 * m:(rank + 1) * 4 * m]
            sums = got[("reduce_scatter_tensor", m, str(dist.ReduceOp.SUM))]
            avgs = got[("reduce_scatter_tensor", m, str(dist.ReduceOp.AVG))]
            assert sums == block.tolist(), m
            assert avgs == (block / P).tolist(), m


@pytest.mark.timeout(300)
def test_unsupported_operations_name_shmtree_and_the_operation(checks):
    """Item 14: NotImplementedError (a RuntimeError) naming shmtree and the operation, never
    "No backend type associated with device type cpu"; a ReduceOp by its name; the group stays
    usable."""
    for rank in range(2):
        got = checks["shmtree"][rank]["unsupported"]
        for name, outcome in got.items():
            assert outcome.startswith("NotImplementedError: shmtree: "), (name, outcome)
            assert "No backend type" not in outcome and "object at 0x" not in outcome, outcome
        words = {"premul_sum": "ReduceOp.PREMUL_SUM is not supported"}
        assert sorted(words) == sorted(got)
        for name, word in words.items():
            assert word in got[name], (name, got[name])
        assert checks["shmtree"][rank]["after"] == [2.0, 2.0]
        assert checks["shmtree"][rank]["coalesced"] == {
            "all_reduce_coalesced": [[3.0, 3.0], [2.0, 2.0, 2.0]],
            "all_gather_coalesced": [[0.0, 0.0], [1.0, 1.0]],
            "coalescing_manager": [[3.0, 3.0], [2.0, 2.0, 2.0]]}
        assert issubclass(NotImplementedError, RuntimeError)   # (gloo's error type)


def value_after_wait_worker(rank, store_path, outdir):
    import time

    import torch.distributed as dist

    import shmtree.torch.backend as st           # (its _work makes the futures' values)

    settle = st._settle

    def slow_settle(source):                   # making the future's value takes a while
        time.sleep(0.05)
        return settle(source)

    st._settle = slow_settle
    torch.set_num_threads(1)
    dist.init_process_group("shmtree", store=dist.FileStore(store_path, 2), rank=rank,
                            world_size=2)
    got = []
    for i in range(5):
        work = dist.all_reduce(torch.full((N,), rank + 1.0 + i), async_op=True)
        work.wait()
        try:
            value = work.get_future().value()[0][0].item()
        except Exception as exc:
            value = f"{type(exc).__name__}: {exc}"
        got.append((work.is_completed(), value))
    dist.destroy_process_group()
    torch.save(got, os.path.join(outdir, f"value-{rank}.pt"))


@pytest.mark.timeout(180)
def test_the_futures_value_is_there_when_wait_returns(tmp_path):
    """Work.wait() returns once the future's value is made (a then() of the completion, run in
    the thread that completed it): reading it at once never finds it unset (torch's 'completed()
    INTERNAL ASSERT FAILED', seen once in CI)."""
    mp.start_processes(value_after_wait_worker, args=(str(tmp_path / "store"), str(tmp_path)),
                       nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        got = torch.load(tmp_path / f"value-{rank}.pt")
        assert got == [(True, 3.0 + 2 * i) for i in range(5)], got
