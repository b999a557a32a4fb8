"""The torch.distributed backend "shmtree" (shmtree/torch.py), under torch.multiprocessing.spawn
with a FileStore: every operation against its expected values, async work, DDP against gloo."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch backend's tests need torch")
dist = pytest.importorskip("torch.distributed", reason="the torch backend needs torch.distributed")
mp = pytest.importorskip("torch.multiprocessing", reason="these tests start torch's processes")


def ops_worker(rank, size, store_path, outdir):
    import torch
    import torch.distributed as dist

    import shmtree.torch  # noqa: F401  (registers the backend)

    dist.init_process_group("shmtree", store=dist.FileStore(store_path, size), rank=rank,
                            world_size=size)
    got = {}
    R = dist.ReduceOp
    for name, op in (("sum", R.SUM), ("avg", R.AVG), ("prod", R.PRODUCT), ("min", R.MIN),
                     ("max", R.MAX)):
        t = torch.arange(5, dtype=torch.float64) + rank + 1
        dist.all_reduce(t, op=op)
        got[name] = t.tolist()
    for name, op in (("band", R.BAND), ("bor", R.BOR), ("bxor", R.BXOR)):
        t = torch.tensor([rank + 1, 7, 1 << rank], dtype=torch.int32)
        dist.all_reduce(t, op=op)
        got[name] = t.tolist()
    big = torch.ones(100003) * (rank + 1)                 # the bandwidth path
    dist.all_reduce(big)
    got["big"] = float(big[0]), float(big[-1])
    view = torch.zeros(10, 4)[:, 1]                       # a non-contiguous tensor, in place
    view += rank + 1
    dist.all_reduce(view)
    got["strided"] = view.tolist()
    w = torch.ones(3, requires_grad=True)                 # used as its detach()
    dist.all_reduce(w.data)
    got["grad_param"] = w.detach().tolist()
    b = torch.full((4,), float(rank))
    dist.broadcast(b, src=size - 1)
    got["broadcast"] = b.tolist()
    x = torch.full((3,), rank + 1.0)
    dist.reduce(x, dst=size - 1)
    got["reduce"] = x.tolist() if rank == size - 1 else None
    outs = [torch.empty(2) for _ in range(size)]
    dist.all_gather(outs, torch.full((2,), rank + 0.5))
    got["all_gather"] = [o.tolist() for o in outs]
    flat = torch.empty(size * 2)
    dist.all_gather_into_tensor(flat, torch.full((2,), rank + 0.5))
    got["all_gather_into_tensor"] = flat.tolist()
    r = torch.empty(2)
    dist.reduce_scatter_tensor(r, torch.arange(2 * size, dtype=torch.float32) * (rank + 1))
    got["reduce_scatter_tensor"] = r.tolist()
    r = torch.empty(2)
    dist.reduce_scatter(r, [torch.full((2,), float(k + rank)) for k in range(size)])
    got["reduce_scatter"] = r.tolist()
    n = 70001                                             # above INLINE_BYTES: posted
    b = torch.full((n,), float(rank))
    dist.broadcast(b, src=0)
    x = torch.full((n,), rank + 1.0)
    dist.reduce(x, dst=0, op=R.AVG)
    flat = torch.empty(size * n)
    dist.all_gather_into_tensor(flat, torch.full((n,), rank + 0.5))
    r = torch.empty(n)
    dist.reduce_scatter_tensor(r, torch.ones(size * n) * (rank + 1))
    big_work = dist.all_reduce(torch.ones(n), async_op=True)
    big_work.wait()
    got["large"] = (float(b.sum()), float(x[0]) if rank == 0 else None,
                    float(flat.sum()), float(r.sum()), float(big_work.get_future().value()[0][0]))
    work = dist.all_reduce(torch.ones(2) * (rank + 1), async_op=True)
    work.wait()
    got["async"] = work.get_future().value()[0].tolist()
    h = torch.full((3,), 1.0 + rank / 128, dtype=torch.bfloat16)   # rounds in bfloat16
    dist.all_reduce(h)
    outs = [torch.empty(3, dtype=torch.bfloat16) for _ in range(size)]
    dist.all_gather(outs, h)
    got["bf16"] = (h.dtype == torch.bfloat16, h.float().tolist(),
                   [o.float().tolist() for o in outs])
    dist.barrier()
    dist.destroy_process_group()
    torch.save(got, os.path.join(outdir, f"{rank}.pt"))


def _spawn(fn, size, *args):
    mp.spawn(fn, args=(size,) + args, nprocs=size, join=True)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("size", [1, 2, 3])
def test_every_operation(tmp_path, size):
    _spawn(ops_worker, size, str(tmp_path / "store"), str(tmp_path))
    P = size
    tri = P * (P + 1) / 2
    for rank in range(P):
        got = torch.load(tmp_path / f"{rank}.pt")
        base = np.arange(5.0)
        assert got["sum"] == (base * P + tri).tolist()
        assert got["avg"] == ((base * P + tri) / P).tolist()
        assert got["prod"] == [float(np.prod([i + r + 1 for r in range(P)])) for i in range(5)]
        assert got["min"] == (base + 1).tolist() and got["max"] == (base + P).tolist()
        vals = [[r + 1, 7, 1 << r] for r in range(P)]
        assert got["band"] == [int(np.bitwise_and.reduce(c)) for c in zip(*vals)]
        assert got["bor"] == [int(np.bitwise_or.reduce(c)) for c in zip(*vals)]
        assert got["bxor"] == [int(np.bitwise_xor.reduce(c)) for c in zip(*vals)]
        assert got["big"] == (tri, tri) and got["strided"] == [tri] * 10
        assert got["grad_param"] == [float(P)] * 3
        assert got["broadcast"] == [float(P - 1)] * 4
        assert got["reduce"] == ([tri] * 3 if rank == P - 1 else None)
        assert got["all_gather"] == [[r + 0.5] * 2 for r in range(P)]
        assert got["all_gather_into_tensor"] == [r + 0.5 for r in range(P) for _ in range(2)]
        assert got["reduce_scatter_tensor"] == [float((2 * rank + i) * tri) for i in range(2)]
        assert got["reduce_scatter"] == [float(sum(rank + k for k in range(P)))] * 2
        assert got["async"] == [tri] * 2
        n = 70001
        assert got["large"] == (0.0, tri / P if rank == 0 else None,
                                n * sum(r + 0.5 for r in range(P)), n * tri, float(P))
        want = torch.tensor([sum(1.0 + r / 128 for r in range(P))] * 3).bfloat16().float()
        assert got["bf16"] == (True, want.tolist(), [want.tolist()] * P)


def ddp_worker(rank, size, store_path, outdir, backend):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import shmtree.torch  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group(backend, store=dist.FileStore(store_path, size), rank=rank,
                            world_size=size)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)          # each rank its own data
    for _ in range(20):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    torch.save([p.detach() for p in model.parameters()],
               os.path.join(outdir, f"{backend}-{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_ddp_trains_as_with_gloo(tmp_path):
    for backend in ("gloo", "shmtree"):
        _spawn(ddp_worker, 2, str(tmp_path / f"store-{backend}"), str(tmp_path), backend)
    for rank in range(2):
        ours = torch.load(tmp_path / f"shmtree-{rank}.pt")
        theirs = torch.load(tmp_path / f"gloo-{rank}.pt")
        for p, q in zip(ours, theirs):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-7)
    first = torch.load(tmp_path / "shmtree-0.pt")
    assert all(torch.equal(p, q) for p, q in zip(first, torch.load(tmp_path / "shmtree-1.pt")))


def test_non_cpu_and_non_tensor_inputs_are_refused():
    from shmtree.torch.tensors import _view
    with pytest.raises(TypeError, match="torch.Tensor"):
        _view(np.ones(2))
    with pytest.raises(ValueError, match="CPU tensors"):
        _view(torch.ones(2, device="meta"))


def tensors_worker(comm):
    import torch
    r = comm.rank
    got = {}
    t = torch.arange(5.0) + r
    res = comm.allreduce(t)
    got["new"] = (type(res).__name__, res.tolist(), t.tolist() == (torch.arange(5.0) + r).tolist())
    o = torch.zeros(5)
    got["out"] = (comm.allreduce(t, out=o) is o, o.tolist())
    p = torch.nn.Parameter(torch.ones(3))                   # requires grad: its detach()
    got["param"] = (comm.allreduce(p, out=p) is p, p.detach().tolist())
    s = torch.zeros(6)[::2]                                  # strided, in place
    s += r + 1
    comm.allreduce(s, out=s)
    got["strided"] = s.tolist()
    b = comm.broadcast(torch.full((3,), 7.0) if r == 0 else None, 0)
    got["broadcast"] = b.tolist()
    g = comm.allgather(torch.full((2,), r + 0.5))
    got["allgather"] = (type(g).__name__, g.tolist())
    got["reduce"] = None if r else comm.reduce(torch.ones(2), root=0).tolist()
    if r:
        comm.reduce(torch.ones(2), root=0)
    got["reduce_scatter"] = comm.reduce_scatter(torch.arange(4.0)).tolist()
    got["nonblocking"] = comm.iallreduce(torch.ones(2)).wait().tolist()

    class Plain:                                             # only the array interface
        def __init__(self, a):
            self._a = a
            self.__array_interface__ = a.__array_interface__
    mine = np.full(3, r + 1.0)
    got["interface"] = comm.allreduce(Plain(mine)).tolist()
    b16 = torch.full((4,), 1.0 + r / 64, dtype=torch.bfloat16)
    res = comm.allreduce(b16)
    got["bf16"] = (res.dtype == torch.bfloat16, res.float().tolist())
    comm.allreduce(b16, out=b16)
    got["bf16_inplace"] = b16.float().tolist()
    got["after"] = comm.allreduce(torch.ones(1)).tolist()
    return got


@pytest.mark.timeout(120)
def test_the_shmtree_api_takes_and_gives_torch_tensors():
    import shmtree
    from procutil import run_ok
    for got in run_ok(tensors_worker, 2):
        assert got["new"] == ("Tensor", [1.0, 3.0, 5.0, 7.0, 9.0], True)
        assert got["out"] == (True, [1.0, 3.0, 5.0, 7.0, 9.0])
        assert got["param"] == (True, [2.0] * 3) and got["strided"] == [3.0] * 3
        assert got["broadcast"] == [7.0] * 3
        assert got["allgather"] == ("Tensor", [[0.5, 0.5], [1.5, 1.5]])
        assert got["reduce_scatter"] in ([0.0, 2.0], [4.0, 6.0])
        assert got["nonblocking"] == [2.0, 2.0] and got["interface"] == [3.0] * 3
        want = torch.tensor([1.0 + 1.0 + 1 / 64] * 4).bfloat16().float().tolist()
        assert got["bf16"] == (True, want) and got["bf16_inplace"] == want
        assert got["after"] == [2.0]
    assert shmtree.arrays.is_foreign(torch.ones(1)) and not shmtree.arrays.is_foreign(np.ones(1))


def test_arrays_on_other_devices_are_refused():
    from shmtree.arrays import as_numpy
    with pytest.raises(ValueError, match="CPU memory only"):
        as_numpy(torch.ones(2, device="meta"), "allreduce")


def test_bfloat16_kernels_round_once_from_float32():
    """bfloat16 sum and prod accumulate in float32 and round once (to nearest even); min and max
    are exact; inf, nan, -0.0 and subnormals survive."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from shmtree import _kernels
    bf = ml_dtypes.bfloat16
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(10007).astype(np.float32).astype(bf) for _ in range(4)]
    wide = [x.astype(np.float32) for x in xs]
    for op, fold in (("sum", np.add), ("prod", np.multiply), ("min", np.minimum),
                     ("max", np.maximum)):
        d = np.empty(10007, bf)
        _kernels.reduce_into(d, xs, op)
        want = fold.reduce(np.stack(wide), axis=0).astype(bf)
        assert (d.view(np.uint16) == want.view(np.uint16)).all(), op
    special = np.array([np.nan, np.inf, -np.inf, 3.3e38, -0.0, 1e-40, 1.0 + 2 ** -8],
                       np.float32).astype(bf)
    d = np.empty_like(special)
    _kernels.reduce_into(d, [special, special], "sum")
    with np.errstate(over="ignore"):                # (3.3e38 * 2 is inf, as it should be)
        want = (special.astype(np.float32) * 2).astype(bf)
    assert np.array_equal(d.view(np.uint16)[1:], want.view(np.uint16)[1:]) and np.isnan(
        d[0].astype(np.float32))


def dead_rank_worker(rank, size, store_path, outdir):
    import signal
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import shmtree.torch  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group("shmtree", store=dist.FileStore(store_path, size), rank=rank,
                            world_size=size)
    ddp = DDP(torch.nn.Linear(512, 512))
    t0 = None
    try:
        for step in range(200):
            if step == 5 and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == 5:
                t0 = time.monotonic()
            ddp(torch.randn(4, 512)).sum().backward()
        outcome = "no error"
    except Exception as exc:                       # what DDP makes of the backend's failure
        outcome = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(outdir, f"dead-{rank}.txt"), "w") as f:
        f.write(f"{time.monotonic() - t0:.2f}\n{outcome}")


@pytest.mark.timeout(120)
def test_a_dead_rank_under_ddp_is_an_error_not_a_hang(tmp_path):
    ctx = mp.spawn(dead_rank_worker, args=(2, str(tmp_path / "store"), str(tmp_path)),
                   nprocs=2, join=False)        # (join would stop rank 0 when rank 1 dies)
    for p in ctx.processes:
        p.join(60)
    assert [p.exitcode for p in ctx.processes] == [0, -9]
    took, outcome = (tmp_path / "dead-0.txt").read_text().split("\n", 1)
    assert "RuntimeError" in outcome and "rank 1 died" in outcome, outcome
    assert float(took) < 10, took


TORCHRUN_SCRIPT = """
import sys, torch, torch.distributed as dist
import shmtree.torch
dist.init_process_group("shmtree")
r = dist.get_rank()
t = torch.ones(4) * (r + 1)
dist.all_reduce(t)
sums = []
for i in range(8):                        # inline and posted broadcasts from every root
    b = torch.full((1000 if i % 2 else 70001,), float(r))
    dist.broadcast(b, src=i % 4)
    sums.append(float(b.sum()) / b.numel())
with open(sys.argv[1] + f"/result-{r}.txt", "w") as f:     # (one file each: stdout interleaves)
    f.write(repr((dist.get_world_size(), t.tolist(), sums)))
dist.destroy_process_group()
"""


@pytest.mark.timeout(180)
@pytest.mark.long               # (test_torchrun_standalone_two_processes runs torchrun by default)
def test_torchrun_world_of_four(tmp_path):
    """Unrelated processes (torchrun's, rendezvous through its TCP store) form the group."""
    import socket
    import subprocess
    import sys
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT)
    with socket.socket() as s:                     # a free port for torchrun's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(shmtree_path())))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4",
                           f"--master_port={port}", str(script), str(tmp_path)], env=env,
                          cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:]
    for rank in range(4):
        got = (tmp_path / f"result-{rank}.txt").read_text()
        assert got == repr((4, [10.0] * 4, [float(i % 4) for i in range(8)])), (rank, got)


def shmtree_path():
    import shmtree
    return shmtree.__file__


STANDALONE_SCRIPT = """
import os, torch, torch.distributed as dist
import shmtree.torch
dist.init_process_group("shmtree")                  # env://, torchrun's variables
r, w = dist.get_rank(), dist.get_world_size()
assert dist.get_backend() == "shmtree", dist.get_backend()
t = torch.arange(3, dtype=torch.float32) + r
dist.all_reduce(t)
b = torch.full((70001,), float(r))                  # posted, from the last rank
dist.broadcast(b, src=w - 1)
outs = [torch.empty(2, dtype=torch.int64) for _ in range(w)]
dist.all_gather(outs, torch.tensor([r, 10 * r]))
flat = torch.empty(2 * w, dtype=torch.bfloat16)
dist.all_gather_into_tensor(flat, torch.full((2,), r + 0.5, dtype=torch.bfloat16))
line = (f"rank {r}/{w} local {os.environ['LOCAL_RANK']}: {t.tolist()} {float(b.mean())} "
        f"{[o.tolist() for o in outs]} {flat.float().tolist()}")
os.write(1, (line + "\\n").encode())        # (one write of under PIPE_BUF bytes: never interleaved)
dist.destroy_process_group()
"""


@pytest.mark.timeout(150)
def test_torchrun_standalone_two_processes(tmp_path):
    """`python -m torch.distributed.run --standalone --nproc-per-node 2 prog.py`: env:// init on
    torchrun's own rendezvous; every rank prints what it got, the job exits 0."""
    import signal
    import subprocess
    import sys
    script = tmp_path / "prog.py"
    script.write_text(STANDALONE_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(shmtree_path())))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "2", str(script)], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)       # torchrun and its workers: one session
        out, _ = proc.communicate()
        pytest.fail("torchrun did not finish in 120 s:\n" + out[-3000:])
    assert proc.returncode == 0, out[-3000:]
    lines = sorted(line for line in out.splitlines() if line.startswith("rank "))
    gathered = [[0, 0], [1, 10]]
    assert lines == [f"rank {r}/2 local {r}: [1.0, 3.0, 5.0] 1.0 {gathered} "
                     f"[0.5, 0.5, 1.5, 1.5]" for r in range(2)], out[-3000:]


def dead_sender_worker(rank, size, store_path, outdir):
    import signal
    import time
    from importlib import import_module

    import torch
    import torch.distributed as dist

    import_module("shmtree.torch")                # registers the backend
    dist.init_process_group("shmtree", store=dist.FileStore(store_path, size), rank=rank,
                            world_size=size)
    t = torch.zeros(4)
    if rank == 0:                                 # one small message each way first (rank 1
        dist.recv(t, 1)                           # dies only once rank 0 has received)
        dist.send(t, 1)
    else:
        dist.send(t + 1, 0)
        dist.recv(t, 0)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        dist.recv(t, 1)                           # a small recv, received in this thread
        outcome = "no error"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(outdir, "dead-sender.txt"), "w") as f:
        f.write(f"{time.monotonic() - t0:.2f}\n{t.tolist()}\n{outcome}")


@pytest.mark.timeout(120)
def test_a_dead_sender_makes_a_waiting_recv_raise(tmp_path):
    ctx = mp.spawn(dead_sender_worker, args=(2, str(tmp_path / "store"), str(tmp_path)),
                   nprocs=2, join=False)
    for p in ctx.processes:
        p.join(60)
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in ctx.processes] == [0, -9]
    took, values, outcome = (tmp_path / "dead-sender.txt").read_text().split("\n", 2)
    assert values == "[1.0, 1.0, 1.0, 1.0]"
    assert outcome.startswith("RuntimeError") and "rank 1 died" in outcome, outcome
    assert float(took) < 10, took


# ---- issue 34: recv from any source (item 7), all_gather of sizes that differ by rank (item 5),
# all_to_all_single's bad split sizes (item 6)


def _build_tensor(size, value):
    """torch's distributed_test._build_tensor (CPU, float)."""
    return torch.empty(size, size, size, dtype=torch.float).fill_(value)


def any_source_worker(rank, size, backend, store_path, outdir):
    """torch's distributed_test test_send_recv_any_source, ported: every rank in turn receives
    two messages from each other rank, through dist.recv (src=None: recv_anysource; the
    sender's rank returned) and dist.irecv (work._source_rank()), each tensor holding its
    sender's rank; then every rank's list of senders is gathered and each rank must appear
    2 (W-1) times.  Then ours: a large message (posted, not held back) from any source, and
    the pg-level recv_anysource with a tag."""
    import shmtree.torch  # noqa: F401  (registers the backend)

    dist.init_process_group(backend, store=dist.FileStore(store_path, size), rank=rank,
                            world_size=size, timeout=__import__("datetime").timedelta(seconds=60))
    send_recv_size = 10
    tensor = _build_tensor(send_recv_size, value=rank)
    recv_ranks, irecv_ranks, bad = [], [], []
    for dst in range(dist.get_world_size()):
        if dst == rank:
            for dst in range(dist.get_world_size()):
                if dst == rank:
                    continue
                for recv in ["recv", "irecv"]:
                    output_tensor = _build_tensor(send_recv_size, value=-1)
                    if recv == "recv":
                        sender = dist.recv(output_tensor)
                        recv_ranks.append(sender)
                    else:
                        work = dist.irecv(output_tensor)
                        work.wait()
                        sender = work._source_rank()
                        irecv_ranks.append(sender)
                    if not output_tensor.eq(sender).all():
                        bad.append((recv, sender, float(output_tensor.flatten()[0])))
        else:
            dist.send(tensor, dst)  # recv
            dist.send(tensor, dst)  # irecv
    recv_ranks_tensor = torch.cat((torch.tensor(recv_ranks), torch.tensor(irecv_ranks)), 0)
    global_recv_ranks = [torch.empty_like(recv_ranks_tensor)
                         for _ in range(dist.get_world_size())]
    dist.all_gather(global_recv_ranks, recv_ranks_tensor)
    everyone = sorted(x for t in global_recv_ranks for x in t.tolist())
    frequency = [everyone.count(r) for r in range(size)]
    # ours: large (a posted receive), and recv_anysource at the pg level with a tag
    big = []
    if rank == 0:
        for _ in range(size - 1):
            out = torch.zeros(200_000)
            work = dist.irecv(out, tag=3)
            work.wait()
            big.append((work._source_rank(), float(out[0]), float(out[-1])))
        pg = dist.group.WORLD
        out = torch.zeros(2)
        work = pg.recv_anysource([out], 4)
        work.wait()
        big.append((work._source_rank(), out.tolist()))
    else:
        dist.send(torch.full((200_000,), float(rank)), 0, tag=3)
        if rank == size - 1:
            dist.send(torch.tensor([5.0, 6.0]), 0, tag=4)
    dist.barrier()
    dist.destroy_process_group()
    torch.save({"bad": bad, "frequency": frequency, "recv": recv_ranks, "irecv": irecv_ranks,
                "big": big}, os.path.join(outdir, f"{backend}-{rank}.pt"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("size", [2, 3])
def test_send_recv_any_source_as_on_gloo(tmp_path, size):
    """Item 7: torch's test_send_recv_any_source passes on shmtree as on gloo (W=2, 3), and a
    large message and recv_anysource with a tag give the sender's rank."""
    for backend in ("gloo", "shmtree"):
        _spawn(any_source_worker, size, backend, str(tmp_path / f"store-{backend}"),
               str(tmp_path))
    for backend in ("gloo", "shmtree"):
        for rank in range(size):
            got = torch.load(tmp_path / f"{backend}-{rank}.pt")
            assert got["bad"] == [], (backend, rank, got["bad"])
            assert got["frequency"] == [2 * (size - 1)] * size, (backend, got)
            others = sorted([r for r in range(size) if r != rank] * 2)
            assert sorted(got["recv"] + got["irecv"]) == others, (backend, rank, got)
            if rank == 0:
                want = [(r, float(r), float(r)) for r in range(1, size)]
                assert sorted(got["big"][:-1]) == want, (backend, got["big"])
                assert got["big"][-1] == (size - 1, [5.0, 6.0]), (backend, got["big"])


def mismatch_worker(rank, size, backend, store_path, outdir):
    """The checks of items 5 and 6, each call timed (a hang would run into the group's 60 s)."""
    import time

    import shmtree.torch  # noqa: F401  (registers the backend)

    dist.init_process_group(backend, store=dist.FileStore(store_path, size), rank=rank,
                            world_size=size, timeout=__import__("datetime").timedelta(seconds=60))
    got = {}

    def outcome(name, call):
        t0 = time.monotonic()
        try:
            call()
            got[name] = ("ok", "", False, False, time.monotonic() - t0)
        except Exception as exc:  # noqa: BLE001
            got[name] = (type(exc).__name__, str(exc), isinstance(exc, ValueError),
                         isinstance(exc, RuntimeError), time.monotonic() - t0)
        t = torch.ones(1)
        dist.all_reduce(t)                        # the group goes on
        got[name + " after"] = float(t[0])

    # item 6, torch's test_c10d_gloo test_all_to_all_single (test_c10d_common's
    # _test_all_to_all_single, at world size 1 there): equal splits of a 2 x 2, then its
    # transpose (not contiguous)
    if size == 1:
        inp, out = torch.ones(2, 2), torch.zeros(2, 2)
        outcome("a2a equal", lambda: dist.all_to_all_single(out, inp))
        outcome("a2a transposed", lambda: dist.all_to_all_single(out, inp.t()))
    n = 2 * size + 1
    outcome("a2a splits sum", lambda: dist.all_to_all_single(
        torch.zeros(n), torch.ones(n), None, [1] * size))
    outcome("a2a out splits sum", lambda: dist.all_to_all_single(
        torch.zeros(n), torch.ones(n), [2] * size, [n - 2 * (size - 1)] + [2] * (size - 1)))
    outcome("a2a splits count", lambda: dist.all_to_all_single(
        torch.zeros(n), torch.ones(n), None, [1] * (size + 1)))
    if backend == "shmtree" and size > 1:
        # one rank's splits are wrong, the others' right (equal, then uneven splits)
        m = 2 * size
        outcome("a2a one bad", lambda: dist.all_to_all_single(
            torch.zeros(m), torch.ones(m), None, [1] * size if rank == 1 else None))
        outcome("a2a one bad uneven", lambda: dist.all_to_all_single(
            torch.zeros(m), torch.ones(m), None, [1] * size if rank == 1 else [2] * size))
        big = 300_000 * size                      # (above INLINE_BYTES: posted)
        outcome("a2a one bad large", lambda: dist.all_to_all_single(
            torch.zeros(big), torch.ones(big), None,
            [1] * size if rank == 0 else [big // size] * size))
        # item 5: all_gather of tensors whose sizes differ by rank, outputs of every rank's
        # size (every rank's check fails); outputs of one size, one rank's input larger
        outcome("ag sizes by rank", lambda: dist.all_gather(
            [torch.zeros(r + 1) for r in range(size)], torch.ones(rank + 1)))
        outcome("ag one larger", lambda: dist.all_gather(
            [torch.zeros(1) for _ in range(size)], torch.ones(2 if rank == 1 else 1)))
        outcome("ag dtype by rank", lambda: dist.group.WORLD.allgather(   # (torch's own
            [[torch.zeros(2, dtype=torch.float64 if r == 0 else torch.float32)   # check of
              for r in range(size)]],                                           # dtypes: the
            [torch.ones(2, dtype=torch.float64 if rank == 0 else torch.float32)]).wait())  # pg's
        # inputs agree, rank 0's outputs do not fit: rank 0 raises (naming the one shape),
        # the others' all_gather completes
        outcome("ag outputs wrong", lambda: dist.all_gather(
            [torch.zeros(3 if rank == 0 and r == 1 else 2) for r in range(size)],
            torch.ones(2)))
        outcome("ag into tensor", lambda: dist.all_gather_into_tensor(
            torch.zeros(size * (size + 1) // 2), torch.ones(rank + 1)))
    dist.destroy_process_group()
    torch.save(got, os.path.join(outdir, f"mm-{backend}-{size}-{rank}.pt"))


@pytest.mark.timeout(240)
def test_a2a_bad_splits_and_uneven_all_gather_are_said_on_every_rank(tmp_path):
    """Items 5 and 6.  all_to_all_single: at world size 1 torch's test_all_to_all_single
    passes as on gloo (a transposed input: ValueError "Tensors must be contiguous"), and split
    sizes that do not fit raise gloo's words as a ValueError (and RuntimeError); at W=2 and 3
    one rank's bad splits raise a ValueError on every rank at once, not a hang.  all_gather of
    sizes or dtypes that differ by rank raises on every rank, naming the dtype and every
    rank's shape; the group goes on after each."""
    _spawn(mismatch_worker, 1, "gloo", str(tmp_path / "store-gloo-1"), str(tmp_path))
    for size in (1, 2, 3):
        _spawn(mismatch_worker, size, "shmtree", str(tmp_path / f"store-{size}"),
               str(tmp_path))
    gloo = torch.load(tmp_path / "mm-gloo-1-0.pt")
    ours = torch.load(tmp_path / "mm-shmtree-1-0.pt")
    assert gloo["a2a equal"][0] == ours["a2a equal"][0] == "ok"
    assert gloo["a2a transposed"][:3] == ("ValueError", "Tensors must be contiguous", True)
    name, text, is_value, is_runtime, _ = ours["a2a transposed"]
    assert is_value and "Tensors must be contiguous" in text, ours["a2a transposed"]
    for case in ("a2a splits sum", "a2a out splits sum", "a2a splits count"):
        words = gloo[case][1]                     # gloo's RuntimeError, its words
        assert gloo[case][3] and words, (case, gloo[case])
        name, text, is_value, is_runtime, _ = ours[case]
        assert is_value and is_runtime and words in text, (case, ours[case], words)
    for size in (2, 3):
        for rank in range(size):
            got = torch.load(tmp_path / f"mm-shmtree-{size}-{rank}.pt")
            for case, value in got.items():
                if case.endswith(" after"):
                    assert value == float(size), (size, rank, case)
                    continue
                name, text, is_value, is_runtime, took = value
                assert took < 20, (size, rank, case, took)             # no hang
                if case == "ag outputs wrong" and rank != 0:
                    assert name == "ok", (size, rank, case, value)
                    continue
                assert is_value and is_runtime, (size, rank, case, value)
                if case.startswith("a2a"):
                    assert "Split sizes doesn't match total dim 0 size" in text or \
                        "Number of tensor splits not equal to group size" in text, value
                    if case.startswith("a2a one bad"):
                        bad = 0 if case.endswith("large") else 1
                        assert rank == bad or f"rank {bad} raised" in text, value
            every = [f"rank {r}: allgather(shape=({r + 1},), dtype float32" for r in range(size)]
            for case in ("ag sizes by rank", "ag into tensor"):
                text = got[case][1]
                assert all(piece in text for piece in every), (size, rank, case, text)
            text = got["ag one larger"][1]
            assert "rank 1: allgather(shape=(2,), dtype float32" in text, (size, rank, text)
            text = got["ag dtype by rank"][1]
            assert "rank 0: allgather(shape=(2,), dtype float64" in text and \
                "allgather(shape=(2,), dtype float32" in text, (size, rank, text)
            if rank == 0:
                text = got["ag outputs wrong"][1]
                assert "invalid tensor size" in text and "shape (2) and dtype torch.float32" \
                    in text, text
