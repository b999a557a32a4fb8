"""``python -m shmtree.bench``: the same command as ``shmtree-bench``."""
import sys

from .cli import main as _main


def main(argv=None):
    """The console script's entry point: run the bench and return its exit status."""
    return _main(argv)


if __name__ == "__main__":
    sys.exit(main())
