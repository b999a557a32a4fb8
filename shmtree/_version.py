"""The one place that holds shmtree's version."""

__version__ = "0.1.0"
