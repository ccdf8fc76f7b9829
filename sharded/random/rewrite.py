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

from sharded import _manual, _registry, _torch
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


# -- draws inside shard_map bodies (NOTE [Random numbers in a body], sharded/_region.py) --

@torch.library.custom_op("sharded::rng_state", mutates_args=(),
                         tags=(torch.Tag.nondeterministic_seeded,))
def _rng_state(n_draws: int, device: torch.device) -> torch.Tensor:
    raise RuntimeError("sharded::rng_state is rewritten by pjit before the program runs.")


@_rng_state.register_fake
def _(n_draws, device):
    return torch.empty(2, dtype=torch.int64, device=device)


RNG_STATE_OP = torch.ops.sharded.rng_state.default


@torch.library.custom_op("sharded::rng_local", mutates_args=())
def _rng_local(state: torch.Tensor, draw: int, shape: list[int], kind: str, a: float, b: float,
               dtype: torch.dtype, axes: str, p: torch.Tensor | None = None) -> torch.Tensor:
    mesh = _manual.current("a random op").mesh
    with _manual.untracked():
        return lower_rng_local(mesh, state, draw, shape, kind, a, b, dtype, axes, p)


@_rng_local.register_fake
def _(state, draw, shape, kind, a, b, dtype, axes, p=None):
    return torch.empty(shape, dtype=dtype, device=state.device)


RNG_LOCAL_OP = torch.ops.sharded.rng_local.default


def lower_rng_local(mesh, state, draw, shape, kind, a, b, dtype, axes, p=None):
    """This rank's values of a body's draw: element i has global index c * numel + i,
    c = this rank's index along the draw's varying axes (mesh order)."""
    names = [x for x in axes.split(",") if x]
    coord = mesh.coordinate()
    v, c = 1, 0
    for name in names:
        k = mesh.axis_names.index(name)
        v, c = v * mesh.shape[k], c * mesh.shape[k] + coord[k]
    region = ((v, *shape), (1, *shape), (c, *([0] * len(shape))), state.device)
    return sample(state[0], state[1] + draw, region, kind, a, b, dtype, p).reshape(shape)


# A body's draw varies over the axes its ``axes`` argument names (NOTE [One registry of
# primitives] in sharded/_registry.py).
_registry.define(RNG_LOCAL_OP, lower=lower_rng_local,
                 vma=lambda args, kwargs: frozenset(x for x in args[7].split(",") if x))


def is_random_call(func, args, kwargs) -> bool:
    """Does a live aten call draw random numbers (see ``is_random``)?"""
    if not isinstance(func, _torch.OpOverload) or func.namespace == "sharded":
        return False
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    names = _torch.op_arg_names(func)
    if "dropout_p" in names:
        i = names.index("dropout_p")
        p = args[i] if len(args) > i else kwargs.get("dropout_p", 0.0)
        return p != 0.0
    return True


def describe_call(func, args, kwargs):
    """(kind, a, b, shape, dtype, device, p, dst) of a live random call, or None."""
    t = func

    def arg(i, name, default):
        return args[i] if len(args) > i else kwargs.get(name, default)

    def like(x, kind, a=0.0, b=1.0, dst=None, p=None):
        return kind, a, b, tuple(x.shape), kwargs.get("dtype") or x.dtype, x.device, p, dst

    def fresh(kind, shape, a=0.0, b=1.0, dtype=None):
        device = kwargs.get("device") or torch.device("cpu")
        return kind, a, b, tuple(shape), dtype or kwargs.get("dtype") or torch.get_default_dtype(), \
            torch.device(device), None, None

    if t is aten.rand.default:
        return fresh("uniform", args[0])
    if t is aten.randn.default:
        return fresh("normal", args[0])
    if t is aten.rand_like.default:
        return like(args[0], "uniform")
    if t is aten.randn_like.default:
        return like(args[0], "normal")
    if t is aten.uniform_.default:
        return like(args[0], "uniform", float(arg(1, "from", 0.0)), float(arg(2, "to", 1.0)), dst=args[0])
    if t is aten.normal_.default:
        return like(args[0], "normal", float(arg(1, "mean", 0.0)), float(arg(2, "std", 1.0)), dst=args[0])
    if t is aten.bernoulli_.float:
        return like(args[0], "bernoulli", float(arg(1, "p", 0.5)), 0.0, dst=args[0])
    if t is aten.bernoulli_.Tensor:
        return like(args[0], "bernoulli", 0.0, 0.0, dst=args[0], p=args[1].expand(args[0].shape))
    if t is aten.bernoulli.default:
        return like(args[0], "bernoulli", 0.0, 0.0, p=args[0])
    if t is aten.bernoulli.p:
        return like(args[0], "bernoulli", float(arg(1, "p", 0.5)), 0.0)
    if t is aten.randint.low:
        return fresh("randint", args[2], float(args[0]), float(args[1]), kwargs.get("dtype") or torch.int64)
    if t is aten.randint.default:
        return fresh("randint", args[1], 0.0, float(args[0]), kwargs.get("dtype") or torch.int64)
    if t is aten.randint_like.default:
        return like(args[0], "randint", 0.0, float(args[1]))
    if t is aten.randint_like.low_dtype:
        return like(args[0], "randint", float(args[1]), float(args[2]))
    return None


def draw_in_region(ctx, func, args, kwargs):
    """A random op met in a shard_map body (by the dispatch-level tracker): the same
    values from the counter-based generator (NOTE [Random numbers in a body])."""
    set_vma, vma_of = _manual.set_vma, _manual.vma_of
    tensors = [x for x in _manual._leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    axes = frozenset().union(*(vma_of(t) for t in tensors))
    if func is aten.native_dropout.default:
        x, p = args[0], float(args[1])
        train = args[2] if len(args) > 2 else kwargs.get("train")
        if train is False:
            return x.clone(), torch.ones_like(x, dtype=torch.bool)
        keep = _draw(ctx, "bernoulli", 1.0 - p, 0.0, tuple(x.shape), x.dtype, x.device, None, axes)
        out = x * keep * (0.0 if p >= 1.0 else 1.0 / (1.0 - p))
        mask = keep.to(torch.bool)
        for r in (out, mask):
            set_vma(r, axes)
        return out, mask
    desc = describe_call(func, args, kwargs)
    if desc is None:
        raise NotImplementedError(
            f"{ctx.api}: random op {func} has no counter-based rewrite yet, so its values "
            f"would differ between the forward and its recomputation. Supported: rand, "
            f"randn, randint and their _like forms, bernoulli, dropout, uniform_, normal_."
        )
    kind, a, b, shape, dtype, device, p, dst = desc
    out = _draw(ctx, kind, a, b, shape, dtype, device, p, axes)
    if dst is not None:
        dst.copy_(out)
        set_vma(dst, axes)
        return dst
    return out


def _draw(ctx, kind, a, b, shape, dtype, device, p, axes):
    state, draw = ctx.next_draw(device)
    out = RNG_LOCAL_OP(state, draw, list(shape), kind, float(a), float(b), dtype,
                       ",".join(_manual._ordered(ctx.mesh, axes)), p)
    _manual.set_vma(out, axes)
    return out


# The manual-region tracker's draw hook (NOTE [Hooks of the manual layer] in
# sharded/_manual.py): random calls in a shard_map body draw here.
_manual.set_draw_hooks(is_random_call, draw_in_region)


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
    with g.inserting_after(seed):     # (each insertion after one anchor lands before the last)
        offset = g.placeholder("rng_offset")
    device = placeholders[0].meta["val"].device if placeholders else torch.device("cpu")
    for meta_node in (seed, offset):
        meta_node.meta["val"] = torch.empty((), dtype=torch.int64, device=device)
    draw = 0
    for n in randoms:
        if n.target is RNG_STATE_OP:       # a shard_map region's (seed, offset): its draws
            with g.inserting_before(n):
                off = g.call_function(aten.add.Scalar, (offset, draw))
                off.meta["val"] = offset.meta["val"]
                state = g.call_function(aten.stack.default, ([seed, off],))
            state.meta = dict(n.meta)
            n.replace_all_uses_with(state)
            draw += int(n.args[0])
            g.erase_node(n)
            continue
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
        draw += 1
    g.lint()
    gm.recompile()
    return draw
