"""shmtree's bench tool: ``shmtree-bench`` / ``python -m shmtree.bench``.

Layout (one job per module):

- ``cli``: the command line (parsing, dispatch);
- ``commands``: the commands' bodies (``cmd_<name>``) and the helpers they share;
- ``scaling``: shmtree beside MPI over P, collectives, sizes, private and shared arrays;
- ``measure``: the timing protocol every column uses, buffers (warm or cache-cold), checks;
- ``sweep``: shmtree's allreduce measured in ``shmtree.run`` workers;
- ``copylimit``: the concurrent memory-copy floor;
- ``harness``: forked processes for everything that is not shmtree, with cleanup on error;
- ``baselines``: the numpy + shared_memory loop and the Pipe loop;
- ``mpi`` / ``mpi_worker``: mpi4py's Allreduce under mpiexec, any MPI, any interpreter;
- ``gloo``: torch.distributed's gloo allreduce;
- ``compare``: all of the above side by side;
- ``numa``: the node x node copy matrix and shmtree's placement knobs;
- ``machine``: what machine the numbers come from;
- ``report`` / ``plot``: tables, JSON, CSV, progress, PNG plots.

Nothing here imports shmtree's compiled parts at import time: the parts that do not need the
library (baselines, copy limit, NUMA matrix, parsing, output) work without it.

The top layer of shmtree (tests/test_import_graph.py): it may import every layer below it, and
nothing in shmtree imports it.  The scripts that reproduce the docs' tables are the top-level
bench/ folder's (bench/README.md); this package is the tool they run (README.md here).
"""
__all__ = ["main"]


def main(argv=None):
    """Run shmtree-bench with argv (default: sys.argv[1:]); returns the exit status."""
    from .cli import main as cli_main  # imported on use: ``-m shmtree.bench.mpi_worker`` stays lean
    return cli_main(argv)
