"""Decoded tables that write in-place changes back into the compressed table they came from.

TorchRec's state_dict() hands out its live weights: code (TorchRec's own tests among
it) fills a model by copying into them, ``sd[key].copy_(...)`` or
``shard.tensor.copy_(...)``. An IBP table holds no raw tensor to alias, so its
state_dict() entries are WriteBackTensors: the decoded values, whose in-place changes
re-compress the table (or table shard) they were decoded from.
"""
import weakref

import torch

# In-place methods without a trailing underscore.
_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}


def _mutates(func) -> bool:
    name = getattr(func, "__name__", "")
    return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))


class WriteBackTensor(torch.Tensor):
    """A tensor of decoded table values; an in-place operation on it (copy_, fill_,
    zero_, uniform_, ``x[i] = ...``, ``x += ...``) also calls
    ``getattr(owner, method)(*args, values)``, which re-compresses them into the table
    (the owner is held weakly: a kept state_dict does not keep the model alive). Changes made through views of it
    (``x[0].copy_(...)``, ``x.narrow(...)``) are not written back; load_state_dict is
    the general way in. Copies, pickles and results of other operations are plain
    tensors."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, owner, method: str, *args):
        t = torch.Tensor._make_subclass(cls, data)
        t._write_back = _weak_call(owner, method, args)
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        target = args[0] if args else None
        if isinstance(target, WriteBackTensor) and _mutates(func):
            target._write_back(target.as_subclass(torch.Tensor))
        return out

    def __reduce_ex__(self, protocol):
        return self.as_subclass(torch.Tensor).clone().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return self.as_subclass(torch.Tensor).clone()


def _weak_call(owner, method: str, args: tuple):
    ref = weakref.ref(owner)

    def call(values: torch.Tensor) -> None:
        obj = ref()
        if obj is None:
            raise RuntimeError("the table this state_dict entry came from no longer exists")
        getattr(obj, method)(*args, values)
    return call
