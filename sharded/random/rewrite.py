"""Random ops in traced programs: the ``sharded::rng`` op and the graph rewrite that
turns torch's random ops into it.

# NOTE [Random numbers that do not depend on the mesh]
torch's random ops draw from a per-process generator, so under partitioning every
shard would draw the same numbers (or numbers that depend on the layout). pjit
rewrites each random op of the global (single-device) graph into
``sharded::rng(seed, offset, draw, shape, kind, ...)``: draw number ``draw`` of the
program, whose element with global linear index ``i`` is Philox(seed, offset + draw,
i). ``seed`` and ``offset`` are graph inputs fed by the tracker, which advances the
offset by the program's number of draws per call. The partitioner computes only the
block this rank holds, from the global indices of its elements: the values are
those of the single-device program whatever the mesh and the layout.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from sharded import _torch
from sharded.random import philox

aten = torch.ops.aten

KINDS = ("uniform", "normal", "bernoulli", "randint")


@torch.library.custom_op("sharded::rng", mutates_args=())
def _rng(seed: torch.Tensor, offset: torch.Tensor, draw: int, shape: list[int], kind: str,
         a: float, b: float, dtype: torch.dtype, like: torch.Tensor | None = None,
         p: torch.Tensor | None = None) -> torch.Tensor:
    region = (tuple(shape), tuple(shape), (0,) * len(shape), seed.device)
    return sample(seed, offset + draw, region, kind, a, b, dtype, p)


@_rng.register_fake
def _(seed, offset, draw, shape, kind, a, b, dtype, like=None, p=None):
    return torch.empty(shape, dtype=dtype, device=seed.device)


RNG_OP = torch.ops.sharded.rng.default


def sample(seed, offset, where, kind: str, a: float, b: float, dtype, p=None):
    """The values of the elements ``where`` (global indices, or a region ``(shape,
    sizes, starts, device)``) of one draw."""
    if kind == "uniform":
        u = philox.uniform(seed, offset, where, dtype)
        return u if (a, b) == (0.0, 1.0) else u * (b - a) + a
    if kind == "normal":
        z = philox.normal(seed, offset, where, dtype)
        return z if (a, b) == (0.0, 1.0) else z * b + a
    if kind == "bernoulli":
        if p is not None:   # elementwise probabilities (torch.bernoulli(p))
            u = philox.uniform(seed, offset, where, torch.float64)
            return (u < p).to(dtype)
        return philox.bernoulli(seed, offset, where, a).to(dtype)
    if kind == "randint":
        return philox.randint(seed, offset, where, int(a), int(b), dtype=dtype)
    raise ValueError(f"unknown random kind {kind!r}")


# -- the rewrite -------------------------------------------------------------------------

def _meta(n):
    return n.meta["val"]


def _float_dtype(val, kw):
    return kw.get("dtype") or (val.dtype if val is not None else torch.get_default_dtype())


def _describe(n: fx.Node):
    """(kind, a, b, like, p) for a random node, or None if it is not one."""
    t, args, kw = n.target, n.args, n.kwargs
    if t in (aten.rand.default, aten.rand_like.default):
        return "uniform", 0.0, 1.0, (args[0] if t is aten.rand_like.default else None), None
    if t in (aten.randn.default, aten.randn_like.default):
        return "normal", 0.0, 1.0, (args[0] if t is aten.randn_like.default else None), None
    if t is aten.uniform.default:
        return "uniform", float(_arg(args, kw, 1, "from", 0.0)), float(_arg(args, kw, 2, "to", 1.0)), args[0], None
    if t is aten.normal_functional.default:
        return "normal", float(_arg(args, kw, 1, "mean", 0.0)), float(_arg(args, kw, 2, "std", 1.0)), args[0], None
    if t is aten.bernoulli.p:
        return "bernoulli", float(_arg(args, kw, 1, "p", 0.5)), 0.0, args[0], None
    if t is aten.bernoulli.default:
        return "bernoulli", 0.0, 0.0, None, args[0]
    if t is aten.randint.low:
        return "randint", float(args[0]), float(args[1]), None, None
    if t is aten.randint.default:
        return "randint", 0.0, float(args[0]), None, None
    if t is aten.randint_like.low_dtype:
        return "randint", float(args[1]), float(args[2]), args[0], None
    if t is aten.randint_like.default:
        return "randint", 0.0, float(args[1]), args[0], None
    return None


def _arg(args, kwargs, i, name, default):
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def is_random(node: fx.Node) -> bool:
    """Does the node draw random numbers? (Ops tagged nondeterministic_seeded that
    take a ``dropout_p``, such as the attention kernels, draw only when it is > 0.)"""
    if node.op != "call_function" or not isinstance(node.target, _torch.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded not in node.target.tags:
        return False
    names = _torch.op_arg_names(node.target)
    if "dropout_p" in names:
        i = names.index("dropout_p")
        p = node.args[i] if len(node.args) > i else node.kwargs.get("dropout_p", 0.0)
        return p != 0.0
    return True


def _expand_native_dropout(gm: fx.GraphModule) -> None:
    """``native_dropout(x, p, train)`` (what dropout traces to on CUDA) as
    ``mask = bernoulli(1 - p)``, ``out = x * mask / (1 - p)``: ops the rewrite covers."""
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not aten.native_dropout.default:
            continue
        x, p = n.args[0], float(n.args[1])
        train = n.args[2] if len(n.args) > 2 else n.kwargs.get("train")
        out_val, mask_val = n.meta["val"]

        def add(target, args, val, kwargs=None):
            node = g.call_function(target, args, kwargs or {})
            node.meta["val"] = val
            return node

        with g.inserting_before(n):
            if train is False:
                out, mask = x, add(aten.ones_like.default, (x,), mask_val, {"dtype": torch.bool})
            else:
                keep = add(aten.bernoulli.p, (add(aten.empty_like.default, (x,), out_val), 1.0 - p), out_val)
                mask = add(aten.to.dtype, (keep, torch.bool), mask_val)
                scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
                out = add(aten.mul.Tensor, (add(aten.mul.Tensor, (x, keep), out_val), scale), out_val)
        for user in list(n.users):          # the two outputs are read through getitem
            user.replace_all_uses_with(out if user.args[1] == 0 else mask)
            g.erase_node(user)
        g.erase_node(n)


def rewrite_random_ops(gm: fx.GraphModule, api: str) -> int:
    """Replace every random op of ``gm`` with ``sharded::rng`` on two new inputs (seed,
    offset), appended after the existing placeholders. Returns the number of draws
    (0: the graph is unchanged)."""
    _expand_native_dropout(gm)
    randoms = [n for n in gm.graph.nodes if is_random(n)]
    if not randoms:
        return 0
    g = gm.graph
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    anchor = g.inserting_after(placeholders[-1]) if placeholders else \
        g.inserting_before(next(iter(g.nodes)))
    with anchor:
        seed = g.placeholder("rng_seed")
        offset = g.placeholder("rng_offset")
    device = placeholders[0].meta["val"].device if placeholders else torch.device("cpu")
    for meta_node in (seed, offset):
        meta_node.meta["val"] = torch.empty((), dtype=torch.int64, device=device)
    for draw, n in enumerate(randoms):
        desc = _describe(n)
        if desc is None and "dropout_p" in _torch.op_arg_names(n.target):
            raise NotImplementedError(
                f"{api}: {n.target} with dropout_p > 0 (attention dropout) has no "
                f"counter-based rewrite yet, so its values would depend on the mesh; apply "
                f"F.dropout to the attention output or weights instead."
            )
        if desc is None:
            raise NotImplementedError(
                f"{api}: random op {n.target} has no counter-based rewrite yet, so its "
                f"values would depend on the mesh. Supported: rand, randn, randint and "
                f"their _like forms, bernoulli, dropout, uniform_, normal_."
            )
        kind, a, b, like, p = desc
        val = _meta(n)
        with g.inserting_before(n):
            new = g.call_function(RNG_OP, (seed, offset, draw, list(val.shape), kind, a, b, val.dtype),
                                  {"like": like, "p": p})
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        g.erase_node(n)
    g.lint()
    gm.recompile()
    return len(randoms)
