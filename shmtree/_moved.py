"""The old import paths of the modules that moved into the layer packages (issue 36).

Until issue 36 every module sat in shmtree/ itself (shmtree.group, shmtree.messages, ...).
Each old path still imports, for one release: importing it warns (a DeprecationWarning naming
the new path) and gives a module that forwards every name to the module, or the modules, that
now hold it (MOVED).  Those are the same objects, looked up when asked for (a name rebound in
the new module reads the same through the old path; a name set on the old path changes
nothing there: patch the new module).  Objects pickled under an old path unpickle through it.

The old paths have no files (a file left at an old path would stop git from following the
moved module across the rename when other branches' edits are merged): a finder on
sys.meta_path, installed when shmtree is imported, makes them.  Nothing inside shmtree imports
them; they go in the next release.
"""
import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

__all__ = ["MOVED"]

# old path -> the modules that hold its names now (the first one first)
MOVED = {
    "shmtree.sysfs": ("shmtree.machine.sysfs",),
    "shmtree.topology": ("shmtree.machine.topology",),
    "shmtree.schedule": ("shmtree.machine.schedule",),
    "shmtree.plan": ("shmtree.machine.plan",),
    "shmtree.liveness": ("shmtree.machine.liveness",),
    "shmtree.transport": ("shmtree.groups.transport",),
    "shmtree.group": ("shmtree.groups.group", "shmtree.groups.token"),
    "shmtree.subgroup": ("shmtree.groups.subgroup",),
    "shmtree.session": ("shmtree.groups.session",),
    "shmtree.shared": ("shmtree.groups.shared",),
    "shmtree.messages": ("shmtree.p2p.methods", "shmtree.p2p.messages", "shmtree.p2p.waiting",
                         "shmtree.p2p.matching", "shmtree.p2p.records"),
    "shmtree.inter": ("shmtree.internode.inter",),
    "shmtree.pipelines": ("shmtree.internode.pipelines",),
    "shmtree.remote": ("shmtree.internode.remote", "shmtree.internode.relay"),
    "shmtree.mailbox": ("shmtree.internode.mailbox", "shmtree.internode.proxylink"),
    "shmtree.nodes": ("shmtree.internode.nodes", "shmtree.internode.agreement"),
    "shmtree.multinode": ("shmtree.internode.multinode",),
    "shmtree.joining": ("shmtree.launching.joining",),
    "shmtree.launch": ("shmtree.launching.launch",),
    "shmtree.pool": ("shmtree.launching.pool",),
    "shmtree.calls": ("shmtree.frontend.calls",),
    "shmtree.requests": ("shmtree.frontend.requests",),
    "shmtree.persistent": ("shmtree.frontend.persistent",),
    "shmtree.front": ("shmtree.frontend.front", "shmtree.frontend.moves",
                      "shmtree.frontend.forms", "shmtree.frontend.memory"),
    "shmtree.collectives": ("shmtree.frontend.collectives", "shmtree.frontend.rounds"),
    "shmtree.communicator": ("shmtree.communicators.communicator",
                             "shmtree.communicators.quick"),
    "shmtree.subcomm": ("shmtree.communicators.subcomm",),
    "shmtree.repro": ("shmtree.frontend.repro",),
    "shmtree.accumulating": ("shmtree.frontend.accumulating",),
}


def _public(module):
    """What `from module import *` gives: its __all__, or its public names."""
    names = getattr(module, "__all__", None)
    return list(names) if names is not None else [n for n in vars(module)
                                                   if not n.startswith("_")]


class _Forwarding(importlib.abc.Loader):
    """Makes the module of an old path: it warns, and forwards every name to the new modules."""

    def create_module(self, spec):
        return None                                 # (the default module)

    def exec_module(self, module):
        old = module.__name__
        new = MOVED[old]
        modules = [importlib.import_module(name) for name in new]
        where = f"import {new[0]} instead" if len(new) == 1 else \
            f"its names are in {', '.join(new)}"
        warnings.warn(f"{old} is deprecated: {where} (the old path goes in the next release)",
                      DeprecationWarning, stacklevel=2)

        def __getattr__(name):
            if not (name.startswith("__") and name.endswith("__")):
                for part in modules:
                    try:
                        return getattr(part, name)
                    except AttributeError:
                        pass
            raise AttributeError(f"module {old!r} has no attribute {name!r}")

        def __dir__():
            return sorted(set().union(*(dir(part) for part in modules)))

        names = []
        for part in modules:
            names += [n for n in _public(part) if n not in names]
        module.__doc__ = f"Deprecated: {old} moved to {', '.join(new)} (issue 36)."
        module.__getattr__, module.__dir__, module.__all__ = __getattr__, __dir__, names


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the old paths, and nothing else: no file holds them (first on sys.meta_path, so
    that no other finder - an editable install's of another checkout - answers for them)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _LOADER, origin="shmtree._moved")


_LOADER = _Forwarding()
if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
