"""FSDP (torch.distributed.fsdp.fully_shard) and torchrun on the backend "shmtree", beside gloo.

FSDP trains a small MLP for 3 steps at world size 2 under torch.multiprocessing.spawn, once on
gloo and once on shmtree, in the same processes (one spawn: the default process group is
destroyed and made again), with the same seed and data: the losses and the final parameters
agree.  The layers' sizes are odd (17, 33, 5), so FSDP pads its shards; a second model keeps its
parameters in bfloat16 for the forward and backward (MixedPrecisionPolicy, float32 gradient
reduction), so all_gather_into_tensor moves bfloat16 and reduce_scatter_tensor float32.
"""
import os

import pytest

torch = pytest.importorskip("torch", reason="the torch backend's tests need torch")
dist = pytest.importorskip("torch.distributed", reason="the torch backend needs torch.distributed")
mp = pytest.importorskip("torch.multiprocessing", reason="these tests start torch's processes")
fsdp = pytest.importorskip("torch.distributed.fsdp", reason="FSDP's fully_shard")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("torch.distributed.fsdp.fully_shard: torch >= 2.6", allow_module_level=True)

STEPS = 3


def fsdp_train(rank, size, mixed):
    """The losses of STEPS steps of a fully_shard MLP, and its full parameters after them."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(17, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mixed else MixedPrecisionPolicy())
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)           # each rank its own data
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(8, 17, generator=g), torch.randint(0, 5, (8,), generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    full = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    return losses, full


def fsdp_worker(rank, size, folder):
    from importlib import import_module

    import torch
    import torch.distributed as dist

    import_module("shmtree.torch")                          # registers the backend
    torch.set_num_threads(1)
    got = {}
    for backend in ("gloo", "shmtree"):
        dist.init_process_group(backend, store=dist.FileStore(
            os.path.join(folder, f"store-{backend}"), size), rank=rank, world_size=size)
        assert dist.get_backend() == backend
        got[backend] = [fsdp_train(rank, size, mixed) for mixed in (False, True)]
        dist.destroy_process_group()
    torch.save(got, os.path.join(folder, f"{rank}.pt"))


@pytest.mark.timeout(180)
def test_fsdp_trains_as_with_gloo(tmp_path):
    mp.spawn(fsdp_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"{rank}.pt")
        for (ours, ours_p), (theirs, theirs_p) in zip(got["shmtree"], got["gloo"]):
            assert len(ours) == STEPS
            assert all(abs(a - b) <= 1e-6 for a, b in zip(ours, theirs)), (ours, theirs)
            assert ours_p.keys() == theirs_p.keys()
            for k in ours_p:
                assert ours_p[k].dtype == theirs_p[k].dtype
                assert torch.allclose(ours_p[k], theirs_p[k], rtol=1e-6, atol=1e-7), k
    first, second = torch.load(tmp_path / "0.pt"), torch.load(tmp_path / "1.pt")
    for (_, p0), (_, p1) in zip(first["shmtree"], second["shmtree"]):
        assert all(torch.equal(p0[k], p1[k]) for k in p0)      # every rank: the same model
    assert first["shmtree"][0][0] != second["shmtree"][0][0]   # (from different data)
