"""Loss rewrites. They change the program, not a value's layout (no sharding rule):

- ``mean_losses_as_sums`` on the global program, before it is partitioned (every
  mode, the forward and the backward program alike): a mean over a split batch
  becomes the sum of the losses over their count (NOTE [A mean over a split batch]);
- ``count_targets_early`` on this rank's program, one of the modes' passes (NOTE
  [Pass order] in sharded/modes/base.py): a mean cross-entropy's count of targets is
  computed from the targets, so its all-reduce is issued halfway through the forward.

# NOTE [A mean over a split batch]
A loss op with ``reduction="mean"`` divides by a count that the batch split changes:
torch's kernel divides each rank's shard by the rank's own count. Two silent wrong
results came from DTensor's strategies for them, in every mode:

- ``F.cross_entropy`` / ``F.nll_loss`` trace to ``nll_loss_forward(x, target,
  weight, Mean, ignore_index)``, the loss ``sum(-w[t] * x[t]) / total_weight`` over
  the counted targets. DTensor's strategy gives a ``Partial("avg")`` of each rank's
  local mean: the mean of the ranks' means, the global mean only when every rank
  counts the same number of targets. With ``ignore_index`` targets (padding) or
  class weights spread unevenly over the ranks, the loss was wrong (its gradient was
  right: ``nll_loss_backward`` divides by the all-reduced ``total_weight``).
- ``F.mse_loss``, ``smooth_l1_loss``, ``huber_loss``, ``soft_margin_loss`` and
  ``binary_cross_entropy`` trace to one aten op each, and their gradients to a
  ``*_backward(grad, x, target, ..., Mean)`` op that DTensor runs shard by shard as
  if it were pointwise: each rank divided by its shard's element count, so every
  gradient through the loss came out world-size times too large (the loss itself, a
  ``Partial("avg")`` of equal shards, was right; Adam's scale invariance hid it).

``mean_losses_as_sums`` rewrites the program before it is partitioned (every mode,
the forward and the backward program alike), so that no op divides by a local count:

- ``nll_loss_forward(..., Mean, ...)`` becomes ``nll_loss_forward(..., Sum, ...)``
  divided by its own ``total_weight`` (torch's kernel computes the mean as that sum
  over that weight: the same bits on one device). Split, both are pending sums and
  the loss is their quotient after both are reduced.
- Every other mean loss op becomes its Sum form divided by its count, a number read
  off the global shapes at trace time (the elements of the broadcast input and
  target; the frames of a multi-margin loss), and its backward op becomes the Sum
  form of the backward fed ``grad / count`` (the input's elements there, as torch's
  backward kernels count). Split, the Sum forms are a pending sum and a pointwise
  op: correct on every rank.

One table (op -> where its reduction and input are, what its Mean divides by) and
one rewrite serve both kinds. A float16 loss is computed in float32 and each output
cast back to the dtype torch gives it (a Sum may overflow where the mean would not;
nll_loss's total weight goes back to float16 for its backward op, which reads it in
its own dtype).

``tests/test_losses.py`` checks the rewrite on one device and every loss of
``torch.nn.functional`` against one device on real ranks in every mode; it also
fails when torch gains an op with a ``reduction`` argument that the tables here do
not know of.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from sharded import _torch
from sharded.passes.bucketing import move_before

aten = torch.ops.aten
MEAN, SUM = 1, 2            # torch's Reduction enum (nll_loss_forward's 4th argument)


def _elements(x, target) -> int:
    """The terms of an elementwise loss: its broadcast input and target's elements."""
    return torch.Size(torch.broadcast_shapes(x.shape, target.shape)).numel()


def _input_elements(x, target) -> int:
    """The terms of an elementwise loss's backward: torch's kernels divide by the
    input's elements (not the broadcast ones: aten's own, on one device)."""
    return x.numel()


def _frames(x, target) -> int:
    """The terms of a multi-margin loss: its frames (rows), one for a 1-D input."""
    return 1 if x.dim() <= 1 else x.shape[0]


def _total_weight(x, target) -> None:
    """The terms of nll_loss: None, for its own second output (the total weight of the
    counted targets, known only when it runs)."""
    return None


# op -> (the position of its `reduction` argument, the position of its input, the
# number of terms that Mean divides by, from the input's and the target's values); a
# backward op's input follows its grad_output, which is argument 0
_COUNTED: dict = {
    aten.nll_loss_forward.default: (3, 0, _total_weight),
    aten.nll_loss2d_forward.default: (3, 0, _total_weight),
    aten.mse_loss.default: (2, 0, _elements),
    aten.smooth_l1_loss.default: (2, 0, _elements),
    aten.huber_loss.default: (2, 0, _elements),
    aten.soft_margin_loss.default: (2, 0, _elements),
    aten.binary_cross_entropy.default: (3, 0, _elements),
    aten.binary_cross_entropy_with_logits.default: (4, 0, _elements),
    aten.multi_margin_loss.default: (5, 0, _frames),
    aten.multilabel_margin_loss_forward.default: (2, 0, _frames),
}
_COUNTED_BACKWARD: dict = {
    aten.mse_loss_backward.default: (3, 1, _input_elements),
    aten.smooth_l1_loss_backward.default: (3, 1, _input_elements),
    aten.huber_loss_backward.default: (3, 1, _input_elements),
    aten.soft_margin_loss_backward.default: (3, 1, _input_elements),
    aten.binary_cross_entropy_backward.default: (4, 1, _input_elements),
    aten.multi_margin_loss_backward.default: (6, 1, _frames),
    aten.multilabel_margin_loss_backward.default: (3, 1, _frames),
}
# ops with a `reduction` argument whose Mean is right split as it is: the backward of
# nll_loss divides by the total_weight it is given (reduced by then)
MEAN_IS_GLOBAL = (aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
COUNTED_OPS = tuple(_COUNTED) + tuple(_COUNTED_BACKWARD)


def mean_losses_as_sums(gm: fx.GraphModule) -> int:
    """NOTE [A mean over a split batch]; returns the number of ops rewritten (then
    ``gm.recompile()`` has been called)."""
    g = gm.graph
    count = 0
    for n in list(g.nodes):
        if n.op == "call_function" and (n.target in _COUNTED or n.target in _COUNTED_BACKWARD):
            count += _counted_as_sum(g, n)
    if count:
        g.lint()
        gm.recompile()
    return count


def _positional(n: fx.Node, upto: int) -> tuple[list, dict] | None:
    """``n``'s arguments as positional ones up to index ``upto`` (defaults filled in
    from the op's schema) and the keyword arguments left; None where an argument is
    missing and has no default. ``n`` itself is not changed."""
    op = n.target
    assert isinstance(op, _torch.OpOverload)
    args, kwargs = list(n.args), dict(n.kwargs)
    for name, default in _torch.op_arg_defaults(op)[len(args):upto + 1]:
        if name in kwargs:
            args.append(kwargs.pop(name))
        elif default is not _torch.NO_DEFAULT:
            args.append(default)
        else:
            return None
    return args, kwargs


def _counted_as_sum(g: fx.Graph, n: fx.Node) -> int:
    """A loss op (or its backward) that divides by a count under Mean: its Sum form,
    divided by (fed the grad over) the global count. 1 if rewritten. A float16 loss
    (or gradient) is computed in float32 and each of its outputs cast back: its Sum
    may overflow where its mean would not."""
    op = n.target
    assert isinstance(op, _torch.OpOverload)
    backward = op in _COUNTED_BACKWARD
    at, src, count_of = (_COUNTED_BACKWARD if backward else _COUNTED)[op]
    normalized = _positional(n, at)
    if normalized is None or normalized[0][at] != MEAN:
        return 0
    args, kwargs = normalized
    x, target = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in args[src:src + 2])
    if not isinstance(x, torch.Tensor) or not isinstance(target, torch.Tensor):
        return 0
    vals = n.meta.get("val")
    if vals is None:
        return 0
    args[at] = SUM
    tuple_out = isinstance(vals, (list, tuple))
    result = vals[0] if tuple_out else vals
    low = isinstance(result, torch.Tensor) and result.dtype == torch.float16
    count = count_of(x, target)
    with g.inserting_before(n):
        if low:
            args = [_cast(g, a, torch.float32) if _is_half(a) else a for a in args]
        if backward:
            args[0] = _node(g, aten.div.Tensor, (args[0], count), args[0])
    n.args, n.kwargs = tuple(args), kwargs
    # the outputs, (node, is the loss): a tuple's are its getitems, the loss [0]
    outs = [(u, u.args[1] == 0) for u in n.users if u.target is operator.getitem] if tuple_out \
        else [(n, True)]
    if count is None:                            # nll_loss: over its total weight
        with g.inserting_after(n):
            count = g.call_function(operator.getitem, (n, 1))
        count.meta["val"] = vals[1].to(torch.float32) if low else vals[1]
    for r, is_loss in outs:
        users = list(r.users)
        half = low and _is_half(r)
        if half:
            r.meta["val"] = r.meta["val"].to(torch.float32)     # (computed in float32 now)
        out = r
        if is_loss and not backward:
            with g.inserting_after(out):
                out = _node(g, aten.div.Tensor, (r, count), r)
        if half:
            with g.inserting_after(out):
                out = _cast(g, out, torch.float16)
        for u in users:
            u.replace_input_with(r, out)
    return 1


def _is_half(a) -> bool:
    return isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor) \
        and a.meta["val"].dtype == torch.float16


def _node(g: fx.Graph, op, args: tuple, like) -> fx.Node:
    """A new node computing ``op(*args)``, with ``like``'s value metadata."""
    out = g.call_function(op, args)
    val = like.meta.get("val") if isinstance(like, fx.Node) else None
    if isinstance(val, torch.Tensor):
        out.meta["val"] = val
    return out


def _cast(g: fx.Graph, a: fx.Node, dtype: torch.dtype) -> fx.Node:
    out = g.call_function(aten._to_copy.default, (a,), {"dtype": dtype})
    val = a.meta.get("val")
    if isinstance(val, torch.Tensor):
        out.meta["val"] = val.to(dtype)
    return out


_NLL_FORWARD = aten.nll_loss_forward.default


def count_targets_early(gm: fx.GraphModule) -> fx.GraphModule:
    """A mean cross-entropy over a split batch divides by the number of counted
    targets on every rank (``nll_loss_forward``'s second result, all-reduced; NOTE [A
    mean over a split batch]): its backward cannot start before that all-reduce is
    back, and computed by the loss it is issued only at the end of the forward, a
    wait on the other rank in the middle of every step. Without class weights it is the number of targets other than
    ``ignore_index``, so it is computed from the targets themselves:
    ``(target != ignore_index).sum()`` in the loss's dtype, the same count (exact in
    float32 below 2**24), halfway between where the targets exist and where the loss
    reads it, and ``hoist_reductions`` issues its all-reduce there: the second half
    of the forward overlaps it, and the first half the call's agreement, which pjit
    checks before the program's first collective (NOTE [The agreement overlaps the
    program]; at the program's start the check waited for it at once: gpt-tiny's
    step read 1.11-1.13x DDP's time there against 0.92-1.09x halfway, three runs
    each). Run before ``hoist_reductions``."""
    g = gm.graph
    nodes = list(g.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    for n in nodes:
        if n.op != "call_function" or n.target is not _NLL_FORWARD or len(n.args) != 5:
            continue
        x, target, weight, reduction, ignore = n.args
        counts = [u for u in n.users if u.target is operator.getitem and u.args[1] == 1]
        tval = target.meta.get("val") if isinstance(target, fx.Node) else None
        cval = counts[0].meta.get("val") if counts else None
        if weight is not None or reduction not in (MEAN, SUM) or len(counts) != 1 \
                or not isinstance(tval, torch.Tensor) or not isinstance(cval, torch.Tensor) \
                or not any(u.target in _torch.COLLECTIVE_OPS for u in counts[0].users):
            continue
        # the targets as early as they can be (moved up with the views that make them
        # from an input), the count halfway from there to the loss
        start = inputs[-1].next if inputs else nodes[0]
        where = start if move_before(target, start) else target.next
        order = {m: i for i, m in enumerate(g.nodes)}
        where = max(where, list(g.nodes)[(order[where] + order[n]) // 2], key=order.__getitem__)
        with g.inserting_before(where):
            kept = g.call_function(aten.ne.Scalar, (target, ignore))
            total = g.call_function(aten.sum.default, (kept,))
            count = g.call_function(aten._to_copy.default, (total,), {"dtype": cval.dtype})
        kept.meta["val"] = tval.new_empty(tval.shape, dtype=torch.bool)
        total.meta["val"] = tval.new_empty((), dtype=torch.int64)
        count.meta["val"] = torch.empty_like(cval)     # a tensor of its own
        counts[0].replace_all_uses_with(count)
        g.erase_node(counts[0])
        for u in list(count.users):      # its all-reduce right after it (hoist_reductions leaves it)
            if u.target in _torch.COLLECTIVE_OPS:
                count.append(u)
    return gm
