"""The byte recorder of the probes that ask a framework which memory-bound passes it runs over parameter-sized
tensors besides the GEMMs (tests/deepspeed_engine_probe.py, tests/fsdp2_accumulation_probe.py): a
``TorchDispatchMode`` that sees every ATen operation the framework issues, as torch dispatches it. Imported inside
each probe's rank process (torch is imported there, after the probe set its environment)."""

from __future__ import annotations


def recorder(numel: int, skipped, *, write_only=(), full_names: bool = True, dtypes: bool = True):
    """A fresh recorder (``with recorder(...) as rec:``, then ``rec.bytes``) of the bytes each operation reads and
    writes on tensors whose size is a multiple of ``numel`` (a weight or its shard); smaller tensors (scales, losses,
    activations of other sizes) are left out. Per operation: one named in ``write_only`` (``zero_``, ``fill_``) writes
    its operands and reads nothing; with ``out=``, the other inputs are read and ``out`` written; ``copy_`` reads its
    source and writes its destination; any other in-place operation (name ending in ``_``) reads its operands and
    writes the first; otherwise inputs are read and outputs written. Names in ``skipped`` (views, GEMMs,
    allocations, whatever the probe sets apart) are not recorded. ``rec.bytes`` maps the operation's schema name
    (``aten::add_``; with ``full_names`` False the part after ``::``) to ``(read, written)`` bytes, with the set of
    dtypes touched as a third item when ``dtypes``."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    def sized(x) -> list:
        return [a for a in tree_flatten(x)[0] if isinstance(a, torch.Tensor) and a.numel() and a.numel() % numel == 0]

    def nbytes(tensors: list) -> int:
        return sum(a.numel() * a.element_size() for a in tensors)

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes: dict = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = func._schema.name
            short = name.split("::")[-1]
            if short in skipped:
                return out
            if short in write_only:
                read, written = [], sized((args, kwargs))
            elif "out" in kwargs:
                read, written = sized((args, {k: v for k, v in kwargs.items() if k != "out"})), sized(kwargs["out"])
            elif short == "copy_":
                read, written = sized(args[1:]), sized(args[:1])
            elif short.endswith("_"):
                ins = sized((args, kwargs))
                read, written = ins, ins[:1]
            else:
                read, written = sized((args, kwargs)), sized(out)
            if not (read or written):
                return out
            key = name if full_names else short
            if dtypes:
                r, w, seen = self.bytes.get(key, (0, 0, set()))
                self.bytes[key] = (r + nbytes(read), w + nbytes(written),
                                   seen | {str(a.dtype).split(".")[-1] for a in read + written})
            else:
                r, w = self.bytes.get(key, (0, 0))
                self.bytes[key] = (r + nbytes(read), w + nbytes(written))
            return out

    return Recorder()
