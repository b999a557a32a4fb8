"""The rendezvous token of a group (Group.rendezvous_token, Group.from_token): plain data -
the plan, the creator's pid and descriptor, the nonce, the size - written as JSON, and parsed
and checked field by field (never unpickled: a token may come from anywhere)."""
from __future__ import annotations

import json

from ..machine import plan as _plan
from ..errors import ShmtreeError
from ..machine.plan import Plan

_TOKEN_FORMAT = "shmtree-rendezvous"
_TOKEN_VERSION = 1
_TOKEN_MAX_BYTES = 64 << 20             # (a plan of MAX_RANKS ranks on a large machine: < 2 MiB)


def _plan_to_data(plan):
    """A Plan as JSON-ready data (the inverse of _plan_from_data)."""
    def tree(t):
        return {"kind": t.kind, "size": t.size, "root": t.root, "parent": list(t.parent),
                "children": [list(c) for c in t.children]}
    return {"size": plan.size, "topology": plan.topology.to_dict(), "tree_kind": plan.tree_kind,
            "placement": plan.placement, "ncpus": plan.ncpus, "small_tree": tree(plan.small_tree),
            "large_tree": tree(plan.large_tree), "large_schedule": plan.large_schedule,
            "chunk_bytes": plan.chunk_bytes, "slots": plan.slots,
            "small_bytes": plan.small_bytes, "nt_bytes": plan.nt_bytes, "spin_ns": plan.spin_ns,
            "pin": plan.pin, "cpu_of": list(plan.cpu_of), "node_of": list(plan.node_of),
            "numa": plan.numa, "stall_timeout": plan.stall_timeout}


class _BadToken(ValueError):
    pass


def _field(data, key, check, what):
    if not isinstance(data, dict) or key not in data:
        raise _BadToken(f"no {key!r}")
    value = data[key]
    if not check(value):
        raise _BadToken(f"{key!r} must be {what}, got {value!r:.80}")
    return value


def _is_int(v, low=0, high=None):
    return type(v) is int and v >= low and (high is None or v <= high)


def _ints(v, n, low=-1, none=False):
    return (type(v) is list and len(v) == n
            and all((none and x is None) or _is_int(x, low, _plan.MAX_RANKS << 8) for x in v))


def _plan_from_data(data):
    """The Plan of a token's data, every field checked for its type and range (the trees are
    validated, the topology goes through Topology.from_dict; the header's plan digest is
    compared later, in _attach)."""
    from ..machine.schedule import Tree, parse_tree_kind
    from ..machine.topology import Topology
    size = _field(data, "size", lambda v: _is_int(v, 1, _plan.MAX_RANKS),
                  f"an int in 1..{_plan.MAX_RANKS}")

    def tree(key):
        t = _field(data, key, lambda v: isinstance(v, dict), "a tree")
        try:
            made = Tree(_field(t, "kind", lambda v: isinstance(v, str) and 0 < len(v) < 64,
                               "a name"),
                        _field(t, "size", lambda v: v == size, f"the group's size {size}"),
                        _field(t, "root", lambda v: _is_int(v, 0, size - 1), "a rank"),
                        _field(t, "parent", lambda v: _ints(v, size), "a list of ranks"),
                        _field(t, "children", lambda v: type(v) is list and len(v) == size
                               and all(type(c) is list and _ints(c, len(c), 0) for c in v),
                               "lists of ranks"))
            return made.validate()
        except AssertionError as exc:
            raise _BadToken(f"{key}: {exc}") from None

    def kind(v):
        try:
            return type(v) in (str, int) and parse_tree_kind(v) == v
        except ValueError:
            return False
    topo = _field(data, "topology", lambda v: isinstance(v, dict), "a topology")
    try:
        topology = Topology.from_dict(topo)
    except (ValueError, TypeError, KeyError) as exc:
        raise _BadToken(f"topology: {exc}") from None
    return Plan(
        size=size, topology=topology,
        tree_kind=_field(data, "tree_kind", kind, "a tree kind"),
        placement=_field(data, "placement", lambda v: v in ("compact", "spread"), "a placement"),
        ncpus=_field(data, "ncpus", lambda v: _is_int(v, 1), "an int >= 1"),
        small_tree=tree("small_tree"), large_tree=tree("large_tree"),
        large_schedule=_field(data, "large_schedule", lambda v: v in ("tree", "ring"),
                              "'tree' or 'ring'"),
        chunk_bytes=_field(data, "chunk_bytes", lambda v: _is_int(v, 64, 1 << 40), "bytes"),
        slots=_field(data, "slots", lambda v: _is_int(v, 1, 1 << 16), "an int >= 1"),
        small_bytes=_field(data, "small_bytes", lambda v: _is_int(v, 0, 1 << 40), "bytes"),
        nt_bytes=_field(data, "nt_bytes", lambda v: _is_int(v, 0), "bytes"),
        spin_ns=_field(data, "spin_ns", lambda v: _is_int(v, 0), "an int >= 0"),
        pin=_field(data, "pin", lambda v: type(v) is bool, "a bool"),
        cpu_of=tuple(_field(data, "cpu_of", lambda v: _ints(v, size, 0, none=True),
                            "a core (or null) per rank")),
        node_of=tuple(_field(data, "node_of", lambda v: _ints(v, size, 0), "a node per rank")),
        numa=_field(data, "numa", lambda v: v in (None, "consumer", "producer", "interleave"),
                    "a NUMA policy or null"),
        stall_timeout=_field(data, "stall_timeout",
                             lambda v: v is None or (type(v) is float and v > 0),
                             "null or seconds > 0"))


def _parse_token(token):
    """(plan, pid, fd, nonce, total) of a rendezvous token, or ShmtreeError naming what is
    wrong with it."""
    try:
        if not isinstance(token, (bytes, bytearray, memoryview, str)):
            raise _BadToken(f"a token is bytes, got {type(token).__name__}")
        if len(token) > _TOKEN_MAX_BYTES:
            raise _BadToken(f"{len(token)} bytes is too large for one")
        try:
            data = json.loads(bytes(token) if not isinstance(token, str) else token)
        except (ValueError, RecursionError):
            raise _BadToken("it is not JSON") from None
        _field(data, "format", lambda v: v == _TOKEN_FORMAT, repr(_TOKEN_FORMAT))
        _field(data, "version", lambda v: v == _TOKEN_VERSION,
               f"{_TOKEN_VERSION} (this shmtree's; the creator's shmtree differs)")
        pid = _field(data, "pid", lambda v: _is_int(v, 1), "a process id")
        fd = _field(data, "fd", lambda v: _is_int(v, 0), "a descriptor number")
        nonce = bytes.fromhex(_field(data, "nonce", lambda v: isinstance(v, str)
                                     and len(v) == 32 and all(c in "0123456789abcdef"
                                                              for c in v), "32 hex digits"))
        total = _field(data, "total", lambda v: _is_int(v, 1), "a size in bytes")
        plan = _plan_from_data(_field(data, "plan", lambda v: isinstance(v, dict), "a plan"))
    except _BadToken as exc:
        raise ShmtreeError(f"shmtree: not a valid rendezvous token ({exc}); pass what "
                           "Group.rendezvous_token() of the same shmtree version returned") \
            from None
    return plan, pid, fd, nonce, total


