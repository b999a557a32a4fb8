"""The same weights, bit for bit, at any world size: DistributedDataParallel on the shmtree
backend whose gradients are exact sums (shmtree.Accumulator).

Every rank takes its share of the same global batch.  Each sample's gradient is kept exactly
(an Accumulator per parameter, filled by hooks on the parameters), and DDP's gradient
all_reduce - a comm hook - merges the ranks' accumulators: the exact sum of every sample's
gradient, whatever the world size, the split of the batch or the order of the ranks.  So the
weights after 20 steps are the same bits at world size 2 and at world size 4.  (A float sum
of per-rank gradients, in any fixed order, would depend on how the batch was split.)

    python examples/torch_reproducible.py
"""
# needs: torch
import functools
import os
import sys
import tempfile

try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.nn.parallel import DistributedDataParallel as DDP
except ImportError:
    print("torch is not installed: skipped")
    sys.exit(0)
import numpy as np

import shmtree
import shmtree.torch  # registers the backend "shmtree"

GLOBAL_BATCH, STEPS = 8, 20


class ExactGradients:
    """Every sample's gradient of every parameter, summed exactly; DDP's comm hook."""

    def __init__(self, model):
        self.params = list(model.parameters())
        for p in self.params:
            p.register_hook(functools.partial(self._keep, p))
        self.start()

    def start(self):                                 # a new step: empty sums
        self.sums = {p: shmtree.Accumulator(tuple(p.shape), np.float32) for p in self.params}

    def _keep(self, p, grad):                        # one sample's gradient, kept exactly
        self.sums[p].add(grad.detach().numpy()[None])
        return torch.zeros_like(grad)                # (.grad waits for the comm hook)

    def hook(self, state, bucket):                   # DDP's all_reduce of a bucket
        comm = shmtree.torch.communicator()
        parts = [torch.from_numpy(comm.allreduce(self.sums[p]).result()).reshape(-1)
                 for p in bucket.parameters()]
        done = torch.futures.Future()
        done.set_result(torch.cat(parts) / GLOBAL_BATCH)      # the mean over the global batch
        return done


def train(rank, world, store_path, out_path):
    dist.init_process_group("shmtree", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 1)))
    exact = ExactGradients(model)
    model.register_comm_hook(None, exact.hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    per = GLOBAL_BATCH // world
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)     # the same global batch on every rank
        x, y = torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)
        mine = range(rank * per, (rank + 1) * per)
        opt.zero_grad()
        exact.start()
        for i in mine:                               # one sample at a time; DDP syncs last
            sync = i == mine[-1]
            with torch.enable_grad() if sync else model.no_sync():
                torch.nn.functional.mse_loss(model(x[i:i + 1]), y[i:i + 1]).backward()
        opt.step()
    if rank == 0:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        np.save(out_path, flat.numpy())
    dist.destroy_process_group()


def weights(world):
    folder = tempfile.mkdtemp()
    out = os.path.join(folder, "weights.npy")
    mp.spawn(train, args=(world, os.path.join(folder, "store"), out), nprocs=world)
    return np.load(out)


if __name__ == "__main__":
    torch.set_num_threads(1)
    two, four = weights(2), weights(4)
    print(f"weights after {STEPS} steps at world size 2 and 4: the same bits:",
          two.tobytes() == four.tobytes())

# Output:
# weights after 20 steps at world size 2 and 4: the same bits: True
