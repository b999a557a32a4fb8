"""ProcessGroupShmtree's coalesced forms (a mixin of the backend class, backend.py)."""
from __future__ import annotations

import torch

from ..frontend import calls
from .options import (_AllreduceCoalescedOptions, _OP, _ReduceScatterOptions, _TIMEOUT, _check_avg,
                      _form, _invalid, _op, _seconds)
from .tensors import (_STRIDED, _check_dense, _check_pairs, _flat, _layout_name, _packed,
                      _size_text, _tensor_lists, _tensors, _unpacked, _view)
from .works import _call


class _Coalesced:
    """ProcessGroupShmtree's coalesced forms: one collective for the whole list."""

    # ---- the coalesced forms: one collective for the whole list ----

    def allreduce_coalesced(self, tensors, opts=None):
        """Each tensor reduced over the ranks (elementwise, each on its own: not together as
        allreduce's list), as one collective."""
        what = "allreduce_coalesced"
        if type(opts) is not _AllreduceCoalescedOptions:
            opts = _form(opts, (), {}, _AllreduceCoalescedOptions, what, (_OP, _TIMEOUT))
        tensors = _tensors(tensors, what)
        if not tensors:
            raise _invalid(what, "requires non-empty tensor list")
        for i, t in enumerate(tensors):
            if t.layout != tensors[0].layout:
                raise _invalid(what, f"invalid tensor layout at index {i} (expected "
                                     f"{_layout_name(tensors[0])}, got {_layout_name(t)})")
        if any(t.dtype != tensors[0].dtype for t in tensors):
            raise _invalid(what, "tensors must all have the same type")
        if tensors[0].layout != _STRIDED:
            raise _invalid(what, "unsupported layout")
        red = _op(opts.reduceOp)
        _check_avg(red, tensors, "all_reduce_coalesced")
        for t in tensors:
            _view(t)
        flat = torch.cat([_flat(t) for t in tensors])
        a = _view(flat)

        def finish():
            if red == "avg":
                flat.div_(self._comm.size)
            for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
                t.detach().copy_(piece.view(t.shape))
            return tensors
        secs = _seconds(opts.timeout, self._timeout)
        if self._exact(red, a):
            return self._summed(a, secs, finish)
        return self._work([_call(calls.allreduce, self._comm, a, "sum" if red == "avg" else red,
                                 out=a, timeout=secs, **self._reproducibly(red))], a.nbytes,
                          finish)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """output_lists[r][j] gets rank r's input_list[j]: one allgather of their bytes."""
        what = "allgather_coalesced"
        output_lists = _tensor_lists(output_lists, what, "output_lists")
        inputs = _tensors(input_list, what, "input_list")
        size = self._comm.size
        if not inputs:
            raise _invalid(what, "requires non-empty input tensor list")
        if len(output_lists) != size:
            raise _invalid(what, "output lists should be equal to world size")
        for outs in output_lists:
            if len(outs) != len(inputs):
                raise _invalid(what, f"invalid output size: (expected length {len(inputs)}, "
                                     f"got {len(outs)})")
            for i, (o, t) in enumerate(zip(outs, inputs)):
                if o.dtype != t.dtype:
                    raise _invalid(what, f"invalid tensor type at index {i} (expected "
                                         f"{t.dtype}, got {o.dtype})")
                if o.shape != t.shape:
                    raise _invalid(what, f"invalid size of output tensor at index {i} "
                                         f"(expected length {_size_text(t)}, got "
                                         f"{_size_text(o)})")
        _check_dense(what, inputs)
        for t in inputs:
            _view(t)

        def place(gathered, pieces):
            for r, outs in enumerate(output_lists):
                for o, (off, nb) in zip(outs, pieces):
                    o.detach().copy_(_unpacked(gathered[r], off, nb, o))
            return output_lists
        return self._gather_bytes(inputs, place, getattr(opts, "timeout", None))

    def _gather_bytes(self, inputs, place, timeout):
        """One allgather of the inputs' bytes (any dtypes, packed); place(gathered, pieces)
        writes the outputs from the (size, nbytes) uint8 result and gives the value."""
        blob, pieces = _packed(inputs)
        gathered = torch.empty((self._comm.size, blob.numel()), dtype=torch.uint8)
        g = _view(gathered)
        return self._work([_call(calls.allgather, self._comm, _view(blob), out=g,
                                 timeout=_seconds(timeout, self._timeout))], g.nbytes,
                          lambda: place(gathered, pieces))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        """all_gather_into_tensor of each pair, as one allgather."""
        what = "allgather_into_tensor_coalesced"
        outputs, inputs = _tensors(outputs, what, "outputs"), _tensors(inputs, what, "inputs")
        size = self._comm.size
        _check_pairs(what, outputs, inputs, size, True)
        for t in inputs + outputs:
            _view(t)

        def place(gathered, pieces):
            for o, t, (off, nb) in zip(outputs, inputs, pieces):
                whole = torch.stack([_unpacked(gathered[r], off, nb, t) for r in range(size)])
                o.detach().copy_(whole.view(o.shape))
            return [[o.chunk(size)[r] if o.dim() else o for o in outputs] for r in range(size)]
        return self._gather_bytes(inputs, place, getattr(opts, "timeout", None))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        """reduce_scatter_tensor of each pair: one reduce_scatter per dtype."""
        what = "reduce_scatter_tensor_coalesced"
        if type(opts) is not _ReduceScatterOptions:
            opts = _form(opts, (), {}, _ReduceScatterOptions, what, (_OP, _TIMEOUT))
        outputs, inputs = _tensors(outputs, what, "outputs"), _tensors(inputs, what, "inputs")
        comm, size = self._comm, self._comm.size
        _check_pairs(what, outputs, inputs, size, False)
        red = _op(opts.reduceOp)
        _check_avg(red, outputs, what)
        for t in inputs + outputs:
            _view(t)
        secs = _seconds(opts.timeout, self._timeout)
        groups = {}
        for i, o in enumerate(outputs):
            groups.setdefault(o.dtype, []).append(i)
        made, blocks, nbytes = [], [], 0
        for dtype, which in groups.items():
            whole = torch.cat([inputs[i].detach().reshape(size, -1) for i in which], dim=1)
            block = torch.empty((1, whole.shape[1]), dtype=dtype)
            blocks.append((which, block))
            w = _view(whole)
            nbytes += w.nbytes
            made.append(_call(calls.reduce_scatter, comm, w, "sum" if red == "avg" else red,
                              out=_view(block), timeout=secs, **self._reproducibly(red)))

        def finish():
            for which, block in blocks:
                pieces = block[0].split([outputs[i].numel() for i in which])
                for i, piece in zip(which, pieces):
                    outputs[i].detach().copy_(piece.view(outputs[i].shape))
            return self._divide(outputs, red)
        return self._work(made, nbytes, finish)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
