"""Communication passes: bucket small all-reduces, and overlap collectives with compute.

# NOTE [Bucketing all-reduces]
A data-parallel step reduces every gradient separately (one all-reduce per parameter).
Like DDP's buckets, consecutive all-reduces over the same group, op and dtype are
merged into one on a flattened concatenation, up to ``bucket_bytes``. A bucket may only
grow while none of its results is needed yet: the merged collective is placed where
its last member was, so every member's input exists there and every member's consumer
comes after it. Ranks run the same pass on the same graph shape, so they issue the
same buckets in the same order.

# NOTE [Overlap]
Functional collectives are asynchronous until ``wait_tensor``. Tracing puts each wait
right after its collective; ``sink_waits`` moves it down to just before the first
use of the result, so the rest of the backward pass runs while gradients are reduced.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from sharded import _torch

_ALL_REDUCE = _torch.c10d_functional.all_reduce.default
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def _wait_of(node: fx.Node) -> fx.Node | None:
    for u in node.users:
        if u.target is _torch.WAIT_OP:
            return u
    return None


def bucket_all_reduces(gm: fx.GraphModule, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> fx.GraphModule:
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    bucket: list[fx.Node] = []
    key = None
    size = 0
    earliest_use = len(nodes)

    def flush():
        nonlocal bucket, size, earliest_use
        if len(bucket) > 1:
            _merge(gm, bucket)
        bucket, size, earliest_use = [], 0, len(nodes)

    for n in nodes:
        if n.op != "call_function" or n.target is not _ALL_REDUCE:
            continue
        wait = _wait_of(n)
        val = n.args[0].meta.get("val")
        if wait is None or val is None or len(n.users) != 1:
            flush()
            continue
        k = (n.args[1], n.args[2], val.dtype, val.device)
        nbytes = val.numel() * val.element_size()
        if bucket and (k != key or pos[n] >= earliest_use or size + nbytes > bucket_bytes):
            flush()
        bucket.append(n)
        key = k
        size += nbytes
        first_use = min((pos[u] for u in wait.users), default=len(nodes))
        earliest_use = min(earliest_use, first_use)
    flush()
    return gm


def _merge(gm: fx.GraphModule, bucket: list[fx.Node]) -> None:
    """One all-reduce for ``bucket``, issued where its last member was; its wait and
    the unpacking go just before the first consumer of any member's result."""
    g = gm.graph
    last = bucket[-1]
    op, group = last.args[1], last.args[2]
    vals = [n.args[0].meta["val"] for n in bucket]
    waits = [_wait_of(n) for n in bucket]
    order = {n: i for i, n in enumerate(g.nodes)}
    first_user = min((u for w in waits for u in w.users), key=order.__getitem__)
    with g.inserting_before(last):
        flats = [g.call_function(torch.ops.aten.reshape.default, (n.args[0], [-1])) for n in bucket]
        cat = g.call_function(torch.ops.aten.cat.default, (flats,))
        ar = g.call_function(_ALL_REDUCE, (cat, op, group))
    with g.inserting_before(first_user):
        wait = g.call_function(_torch.WAIT_OP, (ar,))
        parts = g.call_function(torch.ops.aten.split_with_sizes.default,
                                (wait, [v.numel() for v in vals]))
        outs = [
            g.call_function(torch.ops.aten.view.default,
                            (g.call_function(operator.getitem, (parts, i)), list(v.shape)))
            for i, v in enumerate(vals)
        ]
    # Shapes for the analyses that run after this pass (cost, fingerprint).
    cat.meta["val"] = ar.meta["val"] = wait.meta["val"] = vals[0].new_empty(sum(v.numel() for v in vals))
    for n, w, out in zip(bucket, waits, outs):
        w.replace_all_uses_with(out)
        g.erase_node(w)
        g.erase_node(n)


def sink_waits(gm: fx.GraphModule) -> fx.GraphModule:
    """Move each ``wait_tensor`` to just before the first use of its result."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    for n in nodes:
        if n.op != "call_function" or n.target is not _torch.WAIT_OP or not n.users:
            continue
        first = min(n.users, key=lambda u: pos[u])
        if first is not n.next:
            first.prepend(n)
    return gm
