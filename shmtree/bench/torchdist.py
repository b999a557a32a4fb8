"""shmtree-bench torch: torch.distributed's backend "shmtree" beside "gloo", in the same run.

P processes (torch.multiprocessing.spawn, default 2) make one gloo and one shmtree process
group over all of them (new_group, the default group being gloo's) and measure both in the same
processes, in alternating rounds (--rounds, default 3; the first backend alternates), each figure
the best round's of the slowest rank's median (a busy machine slows both alike):

- every operation at each size, float32, a size being the whole buffer as in nccl-tests
  (all_gather_into_tensor's output, reduce_scatter_tensor's and all_to_all_single's input,
  gather's and scatter's list of P blocks): all_reduce, broadcast (root 0), reduce (root 0),
  all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, gather, scatter, and
  send_recv (ranks 0 and 1: half a ping-pong's round trip); each call timed alone after a
  barrier of its group;
- a training step of a small MLP under FSDP (fully_shard on each Linear and the model, on a
  DeviceMesh of the backend's group) and under DDP (its allreduce timed too, from DDP's comm hook
  to its future's completion), one intra-op thread per process; the two backends' losses (FSDP)
  and final parameters (DDP) compared;
- bfloat16 all_reduce's element rate over float32's (the same element count: --bf16-size bytes of
  float32, half of them of bfloat16).

bench/torch_bench.py runs this command.  Needs torch (`pip install "shmtree[torch]"`).
"""
import json
import os
import tempfile
import time
import warnings
from importlib import import_module

from .harness import BenchError
from .units import format_size, parse_size, parse_sizes

OPS = ("all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
       "all_to_all_single", "gather", "scatter", "send_recv")
BLOCKED = {"all_gather_into_tensor", "reduce_scatter_tensor", "gather", "scatter"}
BACKENDS = ("gloo", "shmtree")
DEFAULT_SIZES = "8,32K,2M,16M,64M"
DEFAULT_BF16 = 16 << 20
REP_BYTES = 256 << 20          # timed calls per size: about this many bytes, 5..MAX_REPS calls
MAX_REPS = 400
FSDP_SHAPE = (8, 512, 4)       # FSDP: batch, width, Linear layers
DDP_SHAPE = (64, 1024)         # DDP: batch, width (Linear(w, w) - ReLU - Linear(w, 10))


def reps_for(nbytes, fixed=None):
    return fixed or max(5, min(MAX_REPS, REP_BYTES // max(nbytes, 1)))


def _call(dist, torch, op, nbytes, group, rank, size, dtype=None):
    """A function that runs `op` once on buffers of `nbytes` (the whole) in `group`."""
    dtype = dtype or torch.float32
    n = max(1, nbytes // torch.tensor([], dtype=dtype).element_size())
    if op in BLOCKED:
        m = max(1, n // size)
        whole, block = torch.zeros(m * size, dtype=dtype), torch.zeros(m, dtype=dtype)
    if op == "all_reduce":
        t = torch.zeros(n, dtype=dtype)
        return lambda: dist.all_reduce(t, group=group)
    if op == "broadcast":
        t = torch.zeros(n, dtype=dtype)
        return lambda: dist.broadcast(t, src=0, group=group)
    if op == "reduce":
        t = torch.zeros(n, dtype=dtype)
        return lambda: dist.reduce(t, dst=0, group=group)
    if op == "all_gather_into_tensor":
        return lambda: dist.all_gather_into_tensor(whole, block, group=group)
    if op == "reduce_scatter_tensor":
        return lambda: dist.reduce_scatter_tensor(block, whole, group=group)
    if op == "all_to_all_single":
        m = max(1, n // size) * size
        a, b = torch.zeros(m, dtype=dtype), torch.empty(m, dtype=dtype)
        return lambda: dist.all_to_all_single(b, a, group=group)
    if op == "gather":
        blocks = list(whole.chunk(size)) if rank == 0 else None
        return lambda: dist.gather(block, blocks, dst=0, group=group)
    if op == "scatter":
        blocks = list(whole.chunk(size)) if rank == 0 else None
        return lambda: dist.scatter(block, blocks, src=0, group=group)
    if op == "send_recv":
        t = torch.zeros(n, dtype=dtype)
        if rank == 0:
            return lambda: (dist.send(t, 1, group=group), dist.recv(t, 1, group=group))
        if rank == 1:
            return lambda: (dist.recv(t, 0, group=group), dist.send(t, 0, group=group))
        return lambda: None
    raise ValueError(op)


def _median(xs):
    xs = sorted(xs)
    k = len(xs) // 2
    return xs[k] if len(xs) % 2 else (xs[k - 1] + xs[k]) / 2


def _timed(dist, call, group, reps):
    """The median seconds of `reps` calls, each after a barrier of `group` (3 untimed first)."""
    for _ in range(min(3, reps)):
        call()
    times = []
    for _ in range(reps):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return _median(times)


def _fsdp(torch, mesh, cfg, rank):
    from torch.distributed.fsdp import fully_shard
    batch, width, layers = cfg["fsdp"]
    torch.manual_seed(0)
    mods = []
    for _ in range(layers - 1):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*mods, torch.nn.Linear(width, 10))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(100 + rank)
    state = {"losses": [], "times": []}

    def step():
        x, y = torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        state["times"].append(time.perf_counter() - t0)
        state["losses"].append(loss.item())
    return step, state


def _ddp(torch, dist, group, cfg, rank, size):
    from torch.nn.parallel import DistributedDataParallel as DDP
    batch, width = DDP_SHAPE
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 10))
    ddp = DDP(model, process_group=group)
    state = {"times": [], "comm": [], "model": model}

    def timed_hook(_, bucket):
        t0 = time.perf_counter()
        buf = bucket.buffer().div_(size)
        fut = dist.all_reduce(buf, group=group, async_op=True).get_future()

        def done(f):
            state["comm"].append(time.perf_counter() - t0)
            return f.value()[0]
        return fut.then(done)
    ddp.register_comm_hook(None, timed_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(100 + rank)

    def step():
        x, y = torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        state["times"].append(time.perf_counter() - t0)
    return step, state


def worker(rank, size, store_path, cfg, outdir):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"   # gloo's sockets on the loopback device only
    warnings.filterwarnings("ignore", category=FutureWarning)   # (all_gather_into_tensor's name)
    warnings.filterwarnings("ignore", category=UserWarning)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    import_module("shmtree.torch")            # registers the backend
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, size), rank=rank,
                            world_size=size)
    groups = {b: dist.new_group(backend=b) for b in BACKENDS}
    rounds = cfg["rounds"]

    def order(k):
        return BACKENDS if k % 2 == 0 else BACKENDS[::-1]
    out = {"ops": {}, "bf16": {}}
    for op in cfg["ops"]:
        for nbytes in cfg["sizes"]:
            calls = {b: _call(dist, torch, op, nbytes, groups[b], rank, size) for b in BACKENDS}
            reps = reps_for(nbytes, cfg["reps"])
            got = {b: [] for b in BACKENDS}
            for k in range(rounds):
                for b in order(k):
                    got[b].append(_timed(dist, calls[b], groups[b], reps))
            out["ops"][f"{op} {nbytes}"] = None if op == "send_recv" and rank else got
            del calls
    n = cfg["bf16_bytes"]
    for b in BACKENDS:
        out["bf16"][b] = {}
    for k in range(rounds):
        for b in order(k):
            for name, dt, nb in (("float32", torch.float32, n), ("bfloat16", torch.bfloat16,
                                                                  n // 2)):
                call = _call(dist, torch, "all_reduce", nb, groups[b], rank, size, dt)
                out["bf16"][b].setdefault(name, []).append(
                    _timed(dist, call, groups[b], reps_for(nb, cfg["reps"])))
    for what in ("fsdp", "ddp"):
        if not cfg["steps"]:
            continue
        steps, states = {}, {}
        for b in BACKENDS:
            if what == "fsdp":
                steps[b], states[b] = _fsdp(torch, DeviceMesh.from_group(groups[b], "cpu"),
                                            cfg, rank)
            else:
                steps[b], states[b] = _ddp(torch, dist, groups[b], cfg, rank, size)
        per_round = max(1, -(-cfg["steps"] // rounds))
        for k in range(rounds):
            for b in order(k):
                for _ in range(per_round + (k == 0)):     # (round 0: one untimed step first)
                    steps[b]()
                if k == 0:
                    states[b]["times"].pop(0)
        res = {}
        for b in BACKENDS:
            st = states[b]
            res[b] = {"step_ms": _median(st["times"]) * 1e3}
            if what == "ddp":
                res[b]["comm_ms"] = _median(st["comm"]) * 1e3
                res[b]["params"] = [p.detach().flatten().tolist()
                                    for p in st["model"].parameters()]
            else:
                res[b]["losses"] = st["losses"]
        out[what] = res
    dist.barrier()
    for g in groups.values():
        dist.destroy_process_group(g)
    dist.destroy_process_group()
    with open(os.path.join(outdir, f"{rank}.json"), "w") as f:
        json.dump(out, f)


def run(cfg, nprocs, timeout=1800):
    """The workers' results, one dict per rank; BenchError if one failed or time ran out."""
    import shutil

    import torch.multiprocessing as mp
    outdir = tempfile.mkdtemp(prefix="shmtree-bench-torch-")
    try:
        ctx = mp.start_processes(worker, args=(nprocs, os.path.join(outdir, "store"), cfg,
                                               outdir), nprocs=nprocs, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    raise BenchError(f"the torch workers did not finish in {timeout} s")
        except mp.ProcessRaisedException as exc:
            raise BenchError(f"a torch worker failed: {str(exc).strip()[-2000:]}") from None
        except mp.ProcessExitedException as exc:
            raise BenchError(f"a torch worker died: {exc}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join(10)
        per = []
        for r in range(nprocs):
            with open(os.path.join(outdir, f"{r}.json")) as f:
                per.append(json.load(f))
        return per
    finally:
        shutil.rmtree(outdir, ignore_errors=True)


def summarize(per, cfg):
    """{"ops": {(op, nbytes): {backend: seconds}}, "bf16": ..., "fsdp": ..., "ddp": ...}: each
    figure the best round's of the slowest rank's median."""
    ops = {}
    for op in cfg["ops"]:
        for nbytes in cfg["sizes"]:
            ranks = [p["ops"][f"{op} {nbytes}"] for p in per if p["ops"][f"{op} {nbytes}"]]
            ops[(op, nbytes)] = {b: min(max(r[b][k] for r in ranks)
                                        for k in range(cfg["rounds"])) for b in BACKENDS}
    bf16 = {b: {dt: min(max(p["bf16"][b][dt][k] for p in per) for k in range(cfg["rounds"]))
                for dt in ("float32", "bfloat16")} for b in BACKENDS}
    out = {"ops": ops, "bf16": bf16}
    for what in ("fsdp", "ddp"):
        if what in per[0]:
            out[what] = {b: {key: max(p[what][b][key] for p in per)
                             for key in per[0][what][b] if key.endswith("_ms")}
                         for b in BACKENDS}
    if "fsdp" in per[0]:
        diff = max(abs(x - y) for p in per
                   for x, y in zip(p["fsdp"]["gloo"]["losses"], p["fsdp"]["shmtree"]["losses"]))
        out["fsdp_loss_diff"] = diff
    if "ddp" in per[0]:
        out["ddp_param_diff"] = max(abs(x - y) for p in per
                                    for a, b in zip(p["ddp"]["gloo"]["params"],
                                                    p["ddp"]["shmtree"]["params"])
                                    for x, y in zip(a, b))
    return out


def table(s, cfg, nprocs, torch_version):
    lines = [f"# shmtree-bench torch: torch {torch_version}, {nprocs} processes, one intra-op "
             f"thread each; best of {cfg['rounds']} alternating round(s) of the slowest rank's "
             "median",
             f"{'op':<24}{'size':>9}{'gloo (us)':>12}{'shmtree (us)':>14}{'shmtree/gloo':>14}"]
    for (op, nbytes), t in s["ops"].items():
        g, m = t["gloo"] * 1e6, t["shmtree"] * 1e6
        lines.append(f"{op:<24}{format_size(nbytes):>9}{g:12.1f}{m:14.1f}{m / g:14.2f}")
    n = cfg["bf16_bytes"] // 4
    lines.append(f"bfloat16/float32 all_reduce element rate ({n} elements, "
                 f"{format_size(cfg['bf16_bytes'])} of float32): " + ", ".join(
                     f"{b} {s['bf16'][b]['float32'] / s['bf16'][b]['bfloat16']:.2f}x "
                     f"({s['bf16'][b]['float32'] * 1e3:.2f} / "
                     f"{s['bf16'][b]['bfloat16'] * 1e3:.2f} ms)" for b in BACKENDS))
    batch, width, layers = cfg["fsdp"]
    for what, label in (("fsdp", f"FSDP step ({layers} x Linear({width}), batch {batch})"),
                        ("ddp", f"DDP step (Linear({DDP_SHAPE[1]}) x 2, batch {DDP_SHAPE[0]})"),
                        ):
        if what not in s:
            continue
        for key, name in (("step_ms", label), ("comm_ms", "  its allreduce")):
            if key in s[what]["gloo"]:
                g, m = s[what]["gloo"][key], s[what]["shmtree"][key]
                lines.append(f"{name:<44} ms: gloo {g:8.2f}, shmtree {m:8.2f} "
                             f"(gloo/shmtree {g / m:.2f})")
    if "fsdp_loss_diff" in s:
        lines.append(f"FSDP losses, shmtree vs gloo: max |difference| {s['fsdp_loss_diff']:.3g}")
    if "ddp_param_diff" in s:
        lines.append(f"DDP final parameters, shmtree vs gloo: max |difference| "
                     f"{s['ddp_param_diff']:.3g}")
    return "\n".join(lines)


def cmd_torch(args):
    try:
        import torch
        import torch.distributed  # noqa: F401
    except ImportError as exc:
        raise BenchError(f"shmtree-bench torch needs torch ({exc}): pip install "
                         "\"shmtree[torch]\"") from None
    ops = [] if args.ops == "none" else args.ops.split(",") if args.ops else list(OPS)
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise BenchError(f"unknown op(s) {','.join(unknown)}: choose among {','.join(OPS)}")
    if "send_recv" in ops and args.nprocs < 2:
        raise BenchError("send_recv needs at least 2 processes")
    cfg = {"ops": ops, "sizes": args.sizes, "rounds": args.rounds, "reps": args.reps,
           "steps": args.steps, "bf16_bytes": args.bf16_size,
           "fsdp": (FSDP_SHAPE[0], args.fsdp_width, FSDP_SHAPE[2])}
    per = run(cfg, args.nprocs)
    s = summarize(per, cfg)
    print(table(s, cfg, args.nprocs, torch.__version__), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nprocs": args.nprocs, "torch": torch.__version__, "rounds": args.rounds,
                       "ops": [{"op": op, "bytes": n, **t} for (op, n), t in s["ops"].items()],
                       **{k: v for k, v in s.items() if k != "ops"}}, f, indent=1)
    ok = s.get("fsdp_loss_diff", 0) <= 1e-6 and s.get("ddp_param_diff", 0) <= 1e-5
    return 0 if ok else 1


def add_parser(sub, arg, positive):
    p = sub.add_parser(
        "torch", help="torch.distributed: backend shmtree beside gloo (every op, FSDP, DDP, "
                      "bfloat16)",
        description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("-n", "--nprocs", type=arg(positive), default=2, help="processes (default 2)")
    p.add_argument("--sizes", type=arg(parse_sizes), default=parse_sizes(DEFAULT_SIZES),
                   help=f"bytes per operation (default {DEFAULT_SIZES})")
    p.add_argument("--ops", help=f"comma-separated subset of {','.join(OPS)} (default: all; "
                                 "none: only the training steps and bfloat16)")
    p.add_argument("--rounds", type=arg(positive), default=3,
                   help="alternating rounds of gloo and shmtree; the best of each (default 3)")
    p.add_argument("--reps", type=arg(positive),
                   help=f"timed calls per op, size and round (default: about "
                        f"{format_size(REP_BYTES)} of data, 5 to {MAX_REPS} calls)")
    p.add_argument("--steps", type=int, default=30,
                   help="timed FSDP and DDP training steps per backend (default 30; 0: none)")
    p.add_argument("--bf16-size", type=arg(parse_size), default=DEFAULT_BF16,
                   help="float32 bytes of the bfloat16/float32 all_reduce (default 16M)")
    p.add_argument("--fsdp-width", type=arg(positive), default=FSDP_SHAPE[1],
                   help=f"the FSDP model's Linear(w, w) width (default {FSDP_SHAPE[1]})")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    return p
