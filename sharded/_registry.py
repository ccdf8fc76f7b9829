"""What the layers of sharded look up by op, and the keys they leave on graph nodes.

The lowest layer: it imports nothing of sharded, so every module may import it.

# NOTE [One registry of primitives]
A ``sharded::`` primitive (a collective, a random draw in a shard_map body, a
sharding constraint, a plan's layout, a shard_map region) is defined in one module,
and several layers below or beside it need to know things about it: the manual-region
tracker its varying-axes rule, the region interpreter its lowering and its
differentiable form, the passes and the fingerprint whether it is a collective, the
expander its handler. Each primitive fills its entry here, where it is defined
(``define``); the layers that use an entry read it here (``rule``, ``lowering``, ...)
and never import the module that defines the op. So a lower layer never calls up into
a higher one, and no table is written from afar: the registry is the one table.

An entry exists once its defining module is imported; a graph can hold the op only
after that, so a lookup by a node's target always finds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch


@dataclass
class Primitive:
    """Everything looked up per op. Each field is None where it does not apply."""

    op: Any
    # (mesh, *args) -> this rank's result: what a region's interpreter runs for it
    lower: Callable | None = None
    # (args, kwargs) -> frozenset of mesh axes the result varies over (NOTE [Varying
    # manual axes] in sharded/_manual.py)
    vma: Callable | None = None
    # (*args) -> the op as a differentiable call (its autograd.Function), for
    # interpreting a region's graph under torch.func
    autograd: Callable | None = None
    # torch.func.vmap rule (registered with torch.library when defined)
    vmap: Callable | None = None
    # its kind as a collective ("all_reduce", "ppermute", ...), for the passes and the
    # cross-rank fingerprint; None: not a collective
    collective: str | None = None
    # (expander, node, args, kwargs) -> its value in the expanded program: the ops that
    # every mode meets and that DTensor knows nothing of (sharded/modes/_expand.py)
    expand: Callable | None = None


_PRIMITIVES: dict[Any, Primitive] = {}


def define(op, **fields) -> Primitive:
    """Fill (or add to) ``op``'s entry. A field is set once: defining it again is a
    programming error (two modules claiming one op)."""
    entry = _PRIMITIVES.get(op)
    if entry is None:
        entry = _PRIMITIVES[op] = Primitive(op)
    for name, value in fields.items():
        if not hasattr(entry, name) or name == "op":
            raise TypeError(f"define({op}): unknown field {name!r}.")
        if getattr(entry, name) is not None and getattr(entry, name) is not value:
            raise ValueError(f"define({op}): field {name!r} is already set.")
        setattr(entry, name, value)
    if fields.get("vmap") is not None:
        torch.library.register_vmap(op, fields["vmap"])
    return entry


def get(op) -> Primitive | None:
    return _PRIMITIVES.get(op)


class _Field(Mapping):
    """A read-only view of one field: op -> value, for the ops that have one."""

    def __init__(self, name: str):
        self._name = name

    def __getitem__(self, op):
        entry = _PRIMITIVES.get(op)
        value = None if entry is None else getattr(entry, self._name)
        if value is None:
            raise KeyError(op)
        return value

    def get(self, op, default=None):
        entry = _PRIMITIVES.get(op)
        value = None if entry is None else getattr(entry, self._name)
        return default if value is None else value

    def __contains__(self, op) -> bool:
        entry = _PRIMITIVES.get(op)
        return entry is not None and getattr(entry, self._name) is not None

    def __iter__(self) -> Iterator:
        return (op for op, e in list(_PRIMITIVES.items()) if getattr(e, self._name) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self):
        return f"<registry field {self._name!r}: {dict(self)!r}>"


LOWERINGS: Mapping = _Field("lower")
VMA_RULES: Mapping = _Field("vma")
AUTOGRAD: Mapping = _Field("autograd")
COLLECTIVES: Mapping = _Field("collective")
EXPAND: Mapping = _Field("expand")


# -- node meta keys -------------------------------------------------------------------------
# The keys sharded leaves in ``fx.Node.meta`` for later steps of the lowering. Declared
# here, the one place, so that every reader and writer names the same constant.

# The pytree path of a program input or output ("params['w']"), for messages and for
# grouping gradients by module (bucketing).
META_PATH = "sharded_path"
# What a program input is to the data-parallel mode: "batch" or "state".
META_KIND = "sharded_kind"
# A donated input of the per-rank program (donate_argnums): the program may write
# its storage in place.
META_DONATED = "sharded_donated"
# "forward" / "backward": the half of a joint graph a node belongs to (the split of
# the joint graph into the forward and backward programs reads it).
META_PHASE = "sharded_phase"
# The node of the per-rank program where the cross-rank agreement runs.
META_AGREEMENT = "sharded_agreement"
