"""In-place rewriting of per-rank graphs, to save memory.

# NOTE [Reinplacing foreach ops]
The pure-functional optimizers (sharded.optim) are chains of multi-tensor ("foreach")
ops, each returning a fresh list of tensors: AdamW allocates about ten
parameter-sized lists per step where torch.optim.AdamW updates in place.
``reinplace_foreach`` rewrites ``_foreach_op(xs, ...)`` into ``_foreach_op_(xs, ...)``
where writing into ``xs`` is invisible: every tensor of ``xs`` is an intermediate of
this program (no input, no alias of an input, no output), and nothing reads it
after this op. The results are then ``xs`` themselves. (torch's
``torch.fx.passes.reinplace`` handles single-tensor ops only, and never writes into
a program's inputs either.)
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from sharded import _torch


def _storage(val):
    return _torch.storage_key(val) if isinstance(val, torch.Tensor) else None


def reinplace_foreach(gm: fx.GraphModule) -> fx.GraphModule:
    """NOTE [Reinplacing foreach ops]."""
    g = gm.graph
    nodes = list(g.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    # storages no op may write into: the inputs' and the outputs'
    protected = set()
    by_storage: dict = {}
    for n in nodes:
        vals = n.meta.get("val")
        for v in vals if isinstance(vals, (list, tuple)) else [vals]:
            key = _storage(v)
            if key is not None:
                by_storage.setdefault(key, []).append(n)
                if n.op == "placeholder":
                    protected.add(key)
    out_node = next(n for n in reversed(nodes) if n.op == "output")
    for n in out_node.all_input_nodes:
        vals = n.meta.get("val")
        for v in vals if isinstance(vals, (list, tuple)) else [vals]:
            if _storage(v) is not None:
                protected.add(_storage(v))

    def last_use(n: fx.Node) -> int:
        users = [u for alias in by_storage.get(_storage(n.meta.get("val")), [n]) for u in alias.users]
        return max((pos[u] for u in users), default=pos[n])

    for n in nodes:
        inplace = _inplace_foreach(n)
        if inplace is None:
            continue
        xs = n.args[0]
        if not xs or not all(isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor) for x in xs):
            continue
        outs = n.meta.get("val")
        if not isinstance(outs, (list, tuple)) or len(outs) != len(xs):
            continue
        if any(_storage(x.meta["val"]) in protected or last_use(x) > pos[n]
               or x.meta["val"].shape != o.shape or x.meta["val"].dtype != o.dtype
               or x.meta["val"].stride() != o.stride() for x, o in zip(xs, outs)):
            continue
        if len({_storage(x.meta["val"]) for x in xs}) != len(xs) or any(
                x in n.args[1:] or (isinstance(a, (list, tuple)) and x in a) for x in xs for a in n.args[1:]):
            continue      # aliasing inside the op: leave it functional
        with g.inserting_before(n):
            new = g.call_function(inplace, n.args, n.kwargs)
        new.meta["val"] = None
        for u in list(n.users):
            if u.target is operator.getitem:
                u.replace_all_uses_with(xs[u.args[1]])
                g.erase_node(u)
        if n.users:        # the list itself is read: rebuild it
            with g.inserting_after(new):
                lst = g.call_function(_identity_list, (list(xs), new))
            n.replace_all_uses_with(lst)
        g.erase_node(n)
        pos = {m: i for i, m in enumerate(g.nodes)}    # after a rewrite only
    return gm


def _identity_list(xs, _after):
    """``xs``, read after the in-place op ``_after`` (keeps the order in the graph)."""
    return xs


def _inplace_foreach(n: fx.Node):
    if n.op != "call_function" or not isinstance(n.target, _torch.OpOverload):
        return None
    name = n.target.overloadpacket.__name__
    if not name.startswith("_foreach_") or name.endswith("_"):
        return None
    packet = getattr(torch.ops.aten, name + "_", None)
    if packet is None:
        return None
    return getattr(packet, n.target._overloadname, None)
