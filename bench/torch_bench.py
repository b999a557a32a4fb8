#!/usr/bin/env python
"""torch.distributed: backend "shmtree" beside "gloo", in one run, P processes (default 2).

    python bench/torch_bench.py                 # all_reduce latency and a DDP training step
    python bench/torch_bench.py --sizes 64K,32M --steps 50 -n 2

For each backend, under torch.multiprocessing.spawn with a FileStore:
- all_reduce of a float32 tensor of each size (median over repeated calls, the slowest rank);
- DDP training of an MLP (Linear(1024, 1024) - ReLU - Linear(1024, 10), batch 64, SGD), one
  intra-op thread per process: the median step, the median time of the allreduce part (DDP's
  comm hook, timed around the future it returns: from the hook's start, the bucket's div_ by the
  size included, to the future's completion), and whether the final parameters agree with the
  other backend's (rtol 1e-5).  Two parts of that allreduce time are printed under it: the
  div_ (torch's, the same work for either backend) and the all_reduce(async_op=True) call
  itself (until the backend has posted the operation and returned its Work).
Needs torch (`pip install "shmtree[torch]"`).
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

try:
    import shmtree  # noqa: F401
except ImportError:                      # run from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from shmtree.bench.units import parse_size as _parse_size  # noqa: E402


def worker(rank, size, backend, store_path, sizes, steps, outdir):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import shmtree.torch  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group(backend, store=dist.FileStore(store_path, size), rank=rank,
                            world_size=size)
    out = {"allreduce_us": {}}
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4))
        reps = max(5, min(2000, int(2e8 // max(nbytes, 1))))
        for _ in range(3):
            dist.all_reduce(t)
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        out["allreduce_us"][nbytes] = float(np.median(times)) * 1e6
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 10))
    ddp = DDP(model)
    comm_times, div_times, call_times = [], [], []

    def timed_hook(state, bucket):
        t0 = time.perf_counter()
        buf = bucket.buffer().div_(size)
        t1 = time.perf_counter()
        fut = dist.all_reduce(buf, async_op=True).get_future()
        div_times.append(t1 - t0)
        call_times.append(time.perf_counter() - t1)

        def done(f):
            comm_times.append(time.perf_counter() - t0)
            return f.value()[0]
        return fut.then(done)
    ddp.register_comm_hook(None, timed_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(100 + rank)
    steps_s = []
    for _ in range(steps):
        x, y = torch.randn(64, 1024, generator=g), torch.randint(0, 10, (64,), generator=g)
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        steps_s.append(time.perf_counter() - t0)
    out["step_ms"] = float(np.median(steps_s)) * 1e3
    out["comm_ms"] = float(np.median(comm_times)) * 1e3
    out["div_ms"] = float(np.median(div_times)) * 1e3
    out["call_ms"] = float(np.median(call_times)) * 1e3
    torch.save({"out": out, "params": [p.detach() for p in model.parameters()]},
               os.path.join(outdir, f"{backend}-{rank}.pt"))
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--nprocs", type=int, default=2)
    ap.add_argument("--sizes", default="8,64K,32M", help="all_reduce sizes (default 8,64K,32M)")
    ap.add_argument("--steps", type=int, default=30, help="DDP steps (default 30)")
    args = ap.parse_args(argv)
    import torch
    import torch.multiprocessing as mp
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    outdir = tempfile.mkdtemp()
    res = {}
    for backend in ("gloo", "shmtree"):
        mp.spawn(worker, args=(args.nprocs, backend, os.path.join(outdir, f"store-{backend}"),
                               sizes, args.steps, outdir), nprocs=args.nprocs)
        per = [torch.load(os.path.join(outdir, f"{backend}-{r}.pt")) for r in range(args.nprocs)]
        res[backend] = per
    print(f"# torch {torch.__version__}, {args.nprocs} processes, one intra-op thread each; "
          "the slowest rank's median")
    print(f"{'all_reduce':>12}  {'gloo (us)':>10}  {'shmtree (us)':>12}  {'gloo/shmtree':>12}")
    for nbytes in sizes:
        g = max(p["out"]["allreduce_us"][nbytes] for p in res["gloo"])
        s = max(p["out"]["allreduce_us"][nbytes] for p in res["shmtree"])
        print(f"{nbytes:>12}  {g:10.1f}  {s:12.1f}  {g / s:12.2f}")
    for key, label in (("step_ms", "DDP step (ms)"), ("comm_ms", "its allreduce (ms)"),
                       ("div_ms", "of which div_ (ms)"), ("call_ms", "and all_reduce() (ms)")):
        g = max(p["out"][key] for p in res["gloo"])
        s = max(p["out"][key] for p in res["shmtree"])
        print(f"{label:>22}: gloo {g:.2f}, shmtree {s:.2f} (gloo/shmtree {g / s:.2f})")
    same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-7)
               for r in range(args.nprocs)
               for a, b in zip(res["gloo"][r]["params"], res["shmtree"][r]["params"]))
    print(f"final parameters allclose to gloo's (rtol 1e-5): {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
