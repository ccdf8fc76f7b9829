"""The lowering pipeline: from the traced single-device program to the program one
rank runs. One pipeline serves pjit's forward, its backward and shard_map's ``.lower``
(a shard_map lowers through pjit):

    trace            sharded/_trace.py          make_fx of the function (joint, under grad)
    rewrites         sharded/random/rewrite.py  random ops -> counter-based draws
                     sharded/rewrites/losses.py    a mean over a split batch -> sum / count
                     sharded/rewrites/algebra.py   x + 0 -> x
    decide + apply   sharded/modes/             the mode lays out every value and expands
                                                the graph for this rank (``partition``)
    passes           sharded/modes/             the mode's declared pass list
    finalize         here                       unalias outputs, the agreement point

``lower_graph`` runs the steps from the rewrites on; ``build_forward`` and
``build_backward`` add what a pjit call's programs need around it (the tensor inputs,
donation, the fingerprint) and return the program types of sharded/_program.py.
"""

from __future__ import annotations

import operator
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from sharded import _torch, _tree, sync
from sharded._registry import META_AGREEMENT, META_DONATED, META_KIND, META_PATH
from sharded._arguments import Arguments, Signature, tensor_inputs
from sharded._fingerprint import ambient_text, fmt_meta, program_lines, stable_repr
from sharded._program import Backward, Forward
from sharded._region import mutated_inputs
from sharded._trace import trace_global
from sharded.auto._decide import AutoRequest, decide, lower_decided
from sharded.mesh import mesh_device
from sharded.modes import ParallelMode
from sharded.modes.base import run_passes
from sharded.passes import fingerprint, unalias_outputs
from sharded.pipelining._lower import build_pipelined, is_pipelined
from sharded.random.rewrite import rewrite_random_ops
from sharded._remat import rematerialize_program
from sharded.rewrites.algebra import drop_zero_additions
from sharded.rewrites.losses import mean_losses_as_sums
from sharded.spec import P, from_placements, to_placements


@dataclass
class LocalProgram:
    """What the pipeline makes of one global program."""

    graph: fx.GraphModule          # this rank's program
    in_placements: list | None     # per input, rng last, when the mode chose them
    out_placements: list           # per output
    layouts: dict | None           # the mode's report (Lowered.layouts)
    n_draws: int                   # random draws per call (the seed and offset inputs)
    times: dict = field(default_factory=dict)   # seconds: partition, passes
    auto: dict | None = None       # AUTO specs: the solver's report (sharded/auto/)
    out_specs: list | None = None  # ... the out_specs with AUTO decided


def lower_graph(gm: fx.GraphModule, mode: ParallelMode, mesh, in_placements: list,
                out_specs: list, *, name: str, n_out: int | None = None,
                donated: Sequence[int] = (), agreement_point: bool = False,
                passes: bool = True, auto: AutoRequest | None = None) -> LocalProgram:
    """Rewrite, partition and pass ``gm`` (placeholders named by ``meta[META_PATH]``).
    ``out_specs``: a P or None per output (None: the mode decides); ``n_out``: the
    outputs that are the user's (the rest are residuals for a backward); ``donated``:
    indices of the inputs whose storage the program may write (NOTE [Donation] in
    sharded/_program.py); ``agreement_point``: check the call's asynchronous agreement
    inside the program (NOTE [The agreement overlaps the program] in sharded/sync.py);
    ``passes=False``: stop after the partition (a pipelined step runs the passes on
    each of its pieces: sharded/pipelining/_lower.py); ``auto``: some input
    placements are None and some out_specs AUTO: the solver decides them (the decide
    step, sharded/auto/), after the rewrites and before the partition."""
    # -- rewrites (pre-partition: they change the global program) ----------------
    n_draws = rewrite_random_ops(gm, name)
    # after the random rewrite: a recomputed draw is the same draw (sharded/_remat.py)
    rematerialize_program(gm)
    mean_losses_as_sums(gm)                 # NOTE [A mean over a split batch]
    drop_zero_additions(gm)                 # NOTE [Adding zero]
    rng = [to_placements(P(), mesh)] * 2 if n_draws else []     # seed, offset
    placeholders = gm.graph.find_nodes(op="placeholder")
    for node, path in zip(placeholders[len(placeholders) - len(rng):], ["rng seed", "rng offset"]):
        node.meta[META_PATH] = path
    out_vals = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    n_saved = len(out_vals) - len(out_specs)

    # -- decide and apply layouts (the solver for AUTO specs, then the mode) ----------
    t0 = time.perf_counter()
    decision = None
    if auto is not None:
        decision = decide(gm, mesh, list(in_placements) + rng, list(out_specs) + [None] * n_saved,
                          auto)
        in_placements = decision.in_placements[:len(in_placements)]
        out_specs = decision.out_specs[:len(out_specs)]
    times: dict = {}

    def apply_and_pass(g: fx.GraphModule) -> _Applied:
        t1 = time.perf_counter()
        part = mode.partition(g, list(in_placements) + rng, list(out_specs) + [None] * n_saved, mesh)
        if n_saved:
            res_specs = _plain_residual_specs(part.out_placements[-n_saved:], out_vals[-n_saved:], mesh)
            if res_specs is not None:       # NOTE [Residual layouts]
                part = mode.partition(g, list(in_placements) + rng, list(out_specs) + res_specs, mesh)
        local_placeholders = part.graph.graph.find_nodes(op="placeholder")
        for k in donated:                   # NOTE [Writing into donated inputs]
            local_placeholders[k].meta[META_DONATED] = True
        t2 = time.perf_counter()
        local = passes_and_finalize(part.graph, mode, mesh, n_out, agreement_point) if passes \
            else part.graph
        times["partition"] = times.get("partition", 0.0) + t2 - t1
        times["passes"] = times.get("passes", 0.0) + time.perf_counter() - t2
        return _Applied(part, local)

    if decision is None:
        done = apply_and_pass(gm)
    else:                                   # NOTE [Two candidates] in sharded/auto/_decide.py
        times["decide"] = time.perf_counter() - t0
        done = lower_decided(gm, decision, mesh, apply_and_pass)
    part, local = done.part, done.graph
    got = list(part.in_placements) if part.in_placements is not None else None
    layouts = part.layouts
    if decision is not None:
        got = list(in_placements) + rng
        layouts = {"inputs": decision.report["inputs"], "outputs": decision.report["outputs"]}
    return LocalProgram(local, got, list(part.out_placements), layouts, n_draws, times,
                        auto=decision.report if decision is not None else None,
                        out_specs=list(out_specs))


@dataclass
class _Applied:
    part: Any                  # the mode's Partitioned
    graph: fx.GraphModule      # this rank's program after the passes


def passes_and_finalize(graph: fx.GraphModule, mode: ParallelMode, mesh, n_out: int | None,
                        agreement_point: bool) -> fx.GraphModule:
    """The mode's passes, then finalize: no two of the first ``n_out`` outputs share
    storage, and the agreement point. The program's code is generated once, here, at
    the end (NOTE [Code generated once] in _torch.py), whether the mode declares a
    pass list or overrides ``transform_and_compile`` (whose ``recompile()`` of the
    partition's lazy module only marks its code stale)."""
    declared = type(mode).transform_and_compile is ParallelMode.transform_and_compile
    if declared:
        local = run_passes(graph, mode.passes, mode, recompile=False)
    else:
        local = mode.transform_and_compile(graph, mesh)
    changed = unalias_outputs(local, n_out)     # (residuals are not the user's)
    if agreement_point:
        _agreement_point(local)
    # the partition's module generated no code (NOTE [Code generated once] in _torch.py)
    _torch.generate_code(local, stale=declared or changed or agreement_point)
    return local


# ---------------------------------------------------------------------------
# A pjit call's programs
# ---------------------------------------------------------------------------

def build_forward(arguments: Arguments, mode: ParallelMode, sig: Signature, args: tuple,
                  run_state) -> Forward:
    """Trace ``arguments.fn`` for the call ``sig`` and lower it (with its backward
    when the call is differentiable). ``run_state(suffix)``: the RunState of the
    program key with ``suffix`` (NOTE [Runners])."""
    name, mesh = arguments.name, sig.mesh
    inp = tensor_inputs(arguments, sig, args)
    paths = inp.leaf_paths
    tensor_leaf = [isinstance(x, torch.Tensor) for x in sig.leaves]

    out_info: dict[str, Any] = {}
    flat_fn = mode.traced_function(arguments.flat_fn(sig, out_info))   # (mixed precision)
    described = [f"{p}: {fmt_meta(m)}" for p, m in zip(inp.paths, inp.metas)]
    t0 = time.perf_counter()
    global_gm = trace_global(flat_fn, inp.metas, name, fn=arguments.fn, inputs=described,
                             requires_grad=sig.grad)
    trace_s = time.perf_counter() - t0
    mutated = [i for i in mutated_inputs(global_gm) if i < len(inp.paths)]
    if mutated:
        raise ValueError(
            f"{name}: the function mutates its input {inp.paths[mutated[0]]} "
            f"in place; pjit functions must be pure. Return the new value instead "
            f"(e.g. `w = w - lr * g` rather than `w.sub_(lr * g)`). A module that updates "
            f"its buffers in place (BatchNorm) needs them cloned inside the function "
            f"and returned (docs/concepts.md, 'Module state')."
        )
    if arguments.auto and (is_pipelined(global_gm) or global_gm.meta.get("joint") is not None):
        raise NotImplementedError(
            f"{name}: AUTO specs are decided for a whole train step traced by pjit; "
            + ("this step calls pipeline(...), whose stages the solver does not place yet"
               if is_pipelined(global_gm) else
               "this call is differentiated from outside (its inputs require grad, or it "
               "runs under torch.func.grad), which the solver does not handle yet")
            + ". Give the specs by hand (lower an AUTO step without it and reuse "
              "`.lower(...).in_specs`).")
    if is_pipelined(global_gm):            # pipeline(loss_fn) inside: docs/pipeline.md
        return build_pipelined(arguments=arguments, mode=mode, sig=sig, args=args,
                               run_state=run_state, global_gm=global_gm, inp=inp,
                               out_info=out_info, trace_s=trace_s, lower_graph=lower_graph,
                               passes_and_finalize=passes_and_finalize, dtensor_spec=_dtensor_spec)
    joint = global_gm.meta.get("joint")
    backward_gm = None
    if joint is not None:          # NOTE [pjit under autograd]
        # remat regions first (their copies go to the backward program); random ops
        # are saved: the two programs draw apart (NOTE [Remat regions in the traced
        # program] in sharded/_remat.py)
        rematerialize_program(global_gm, save_random=True)
        global_gm, backward_gm = _torch.partition_joint(global_gm, joint.n_out)

    out_leaves, out_treedef = out_info["leaves"], out_info["treedef"]
    out_specs = arguments.out_leaf_specs(out_leaves, out_treedef, mesh)
    out_paths = [p for p, v in zip(_tree.leaf_paths(_tree.unflatten(out_treedef, out_leaves),
                                                    "output"), out_leaves)
                 if isinstance(v, torch.Tensor)]
    n_out = len(out_specs)
    for node, path in zip(global_gm.graph.find_nodes(op="placeholder"), inp.paths):
        node.meta[META_PATH] = path
    donated = arguments.donated_leaves(args, sig.static_argnums, inp.dyn_kw, sig.leaves)
    donated_local = [tensor_leaf[:j].count(True) for j in donated]
    auto = AutoRequest(arguments.memory_budget, arguments.cost_model, out_paths, name) \
        if arguments.auto else None
    low = lower_graph(global_gm, mode, mesh, inp.placements, out_specs, name=name, n_out=n_out,
                      donated=donated_local, agreement_point=True, auto=auto)
    local_gm = low.graph
    # (read after the rewrites: a float16 loss's output is then its cast back)
    out_vals = next(n for n in reversed(global_gm.graph.nodes) if n.op == "output").args[0]
    reused = _reused_inputs(local_gm, donated_local, [paths[j] for j in donated], out_paths
                            ) if donated else {}
    in_placements, in_specs = inp.placements, inp.specs
    if low.in_placements is not None:       # the mode laid the inputs out itself
        in_placements = list(low.in_placements[:len(in_placements)])
        in_specs = [from_placements(pl, mesh, m.ndim) for pl, m in zip(in_placements, inp.metas)]

    out_dt_specs = [_dtensor_spec(mesh, pl, v) for v, pl in zip(out_vals, low.out_placements)]
    backward = None
    if backward_gm is not None:
        backward = build_backward(backward_gm, joint, mode, low, out_vals, out_dt_specs, out_paths,
                                  in_placements, inp.metas, mesh, name, run_state(("backward",)))
    sig_lines = [f"input {p}: {fmt_meta(m)} {s!r}" for p, m, s in zip(inp.paths, inp.metas, in_specs)]
    sig_lines += [f"static args[{i}]: {stable_repr(v)}" for i, v in zip(sig.static_argnums, sig.static_args)]
    sig_lines += [f"static kwargs[{k!r}]: {stable_repr(v)}"
                  for k, v in sorted((sig.static_kwargs or {}).items())]
    sig_lines += [f"static leaf {p}: {stable_repr(x)}"
                  for p, x in zip(paths, sig.leaves) if not isinstance(x, torch.Tensor)]
    sig_lines += [f"ambient: {ambient_text(sig.ambient)}"]
    sig_lines += [f"output {p}: {fmt_meta(v.meta['val'])} {tuple(pl)}"
                  for p, v, pl in zip(out_paths, out_vals, low.out_placements)]
    if sig.grad is not None:
        sig_lines += [f"requires grad: {list(sig.grad)}"]

    def lines() -> list[str]:
        out = (sig_lines + ["global program:"] + program_lines(global_gm)
               + ["local collectives:"] + fingerprint(local_gm, mesh)[1])
        if backward is not None:
            out += (["backward program:"] + program_lines(backward.global_graph)
                    + ["backward collectives:"] + fingerprint(backward.local_graph, mesh)[1])
        return out

    placements = iter(in_placements)
    in_plan = [next(placements) if t else None for t in tensor_leaf]
    dt_specs = iter(out_dt_specs)
    out_plan = [("static", v) if not isinstance(v, torch.Tensor) else ("dtensor", next(dt_specs))
                for v in out_leaves]
    return Forward(
        global_graph=global_gm, local_graph=local_gm,
        runner=mode.runner(local_gm, name, mesh, run_state(())),
        mesh=mesh, name=name, in_plan=in_plan, in_paths=paths, in_specs=in_specs,
        out_treedef=out_treedef, out_plan=out_plan, out_placements=low.out_placements[:n_out],
        layouts=low.layouts, n_draws=low.n_draws,
        rng_device=mesh_device(mesh) if low.n_draws else None,
        program=sync.token(*lines()), lines=lines, times={"trace": trace_s, **low.times},
        differentiable=joint is not None, n_tensor_out=n_out,
        diff_out=list(joint.diff_out) if joint is not None else [],
        grad_in=list(joint.grad_in) if joint is not None else [],
        backward=backward,
        donated=donated, donated_local=donated_local, reused=reused,
        donated_msgs=[f"{paths[j]} was donated to {name}; use the returned value"
                      for j in donated],
        auto=low.auto,
        auto_specs=_decided_specs(arguments, sig, in_specs, out_leaves, out_treedef,
                                  low.out_specs or []) if low.auto is not None else None,
    )


def _decided_specs(arguments: Arguments, sig: Signature, in_specs: list, out_leaves: list,
                   out_treedef, out_specs: list) -> tuple:
    """(in_specs, out_specs) of a call with AUTO specs, each AUTO decided: a spec per
    tensor leaf (None for the others) in the arguments' and outputs' structure, so that
    they can be given to pjit by hand (a dict by parameter name where in_specs was
    one, else a tuple per positional argument, static ones left out)."""
    specs = iter(in_specs)
    per_leaf = [next(specs) if isinstance(x, torch.Tensor) else None for x in sig.leaves]
    tree = _tree.unflatten(sig.treedef, per_leaf)
    pos, kw = (tree, {}) if sig.static_kwargs is None else (tree[0], tree[1])
    if isinstance(arguments.in_specs, dict):
        params = arguments._params.positional if arguments._params is not None else ()
        names = [k for i, k in enumerate(params) if i not in sig.static_argnums]
        ins: Any = {**dict(zip(names, pos)), **kw}
    else:
        ins = tuple(pos)
    outs = iter(out_specs)
    out_tree = _tree.unflatten(out_treedef, [next(outs) if isinstance(v, torch.Tensor) else None
                                             for v in out_leaves])
    return ins, out_tree


def build_backward(gm, joint, mode: ParallelMode, fwd: LocalProgram, out_vals, out_dt_specs,
                   out_paths, in_placements, metas, mesh, fwd_name: str, state) -> Backward:
    """Lower the backward global program (NOTE [pjit under autograd]): its inputs are
    the forward's residuals and the cotangents of the outputs that require grad, laid
    out as the forward produced them; its outputs are the gradients, laid out as their
    inputs enter the forward program."""
    n_out = joint.n_out
    res_vals = out_vals[n_out:]
    res_pl = list(fwd.out_placements[n_out:])
    diff = [i for i in range(n_out) if joint.diff_out[i]]
    in_pl = res_pl + [fwd.out_placements[i] for i in diff]
    kinds = (fwd.layouts or {}).get("outputs", {})
    placeholders = gm.graph.find_nodes(op="placeholder")
    sources = [(f"residual {v.name}", n_out + k) for k, v in enumerate(res_vals)]
    sources += [(f"cotangent of {out_paths[i]}", i) for i in diff]
    for node, (path, k) in zip(placeholders, sources):
        node.meta[META_PATH] = path
        kind = kinds.get(f"output[{k}]")
        if kind is not None:       # DataParallelMode: batch or state, as in the forward
            node.meta[META_KIND] = kind[0]
    name = f"{fwd_name} backward"
    grad_specs = [from_placements(in_placements[i], mesh, metas[i].ndim) for i in joint.grad_in]
    low = lower_graph(gm, mode, mesh, in_pl, grad_specs, name=name)
    local_gm = low.graph
    got = low.in_placements if low.in_placements is not None else in_pl
    res_moves = []
    for v, src, dst in zip(res_vals, res_pl, got):
        res_moves.append(None if tuple(src) == tuple(dst) else
                         (_dtensor_spec(mesh, src, v), tuple(dst)))
    tan_specs = [_dtensor_spec(mesh, dst, out_vals[i]) for i, dst in zip(diff, got[len(res_vals):])]
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    grad_dt = [_dtensor_spec(mesh, pl, v) for v, pl in zip(out_node.args[0], low.out_placements)]
    placeholders = gm.graph.find_nodes(op="placeholder")
    return Backward(
        global_graph=gm, local_graph=local_gm, runner=mode.runner(local_gm, name, mesh, state),
        mesh=mesh, name=name, res_moves=res_moves, tan_specs=tan_specs, grad_specs=grad_dt,
        n_draws=low.n_draws, rng_device=mesh_device(mesh) if low.n_draws else None,
        program=sync.token(name, *program_lines(gm), *fingerprint(local_gm, mesh)[1]),
        lines=lambda: [name] + program_lines(gm) + fingerprint(local_gm, mesh)[1],
        in_specs=[_spec_or_placements(pl, mesh, n.meta["val"].ndim) for pl, n in zip(got, placeholders)],
        out_placements=list(low.out_placements), layouts=low.layouts,
        times={"trace": 0.0, **low.times},
    )


def _dtensor_spec(mesh, placements, node: fx.Node):
    val = node.meta["val"]
    return _torch.build_dtensor_spec(mesh.device_mesh, placements, val.shape, val.stride(), val.dtype)


def _reused_inputs(gm: fx.GraphModule, donated_local: list[int], in_paths: list[str],
                   out_paths: list[str]) -> dict:
    """{donated input path: output path that shares its storage, or None}; warns for
    the donated inputs whose storage no output reuses."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs: dict = {}
    for a, path in zip(out_node.args[0], out_paths):     # (not the residuals after them)
        val = a.meta.get("val") if isinstance(a, fx.Node) else None
        if isinstance(val, torch.Tensor):
            outs.setdefault(_torch.storage_key(val), path)
    reused = {}
    for k, path in zip(donated_local, in_paths):
        reused[path] = outs.get(_torch.storage_key(placeholders[k].meta["val"]))
    unused = [p for p, o in reused.items() if o is None]
    if unused:
        warnings.warn(
            f"pjit: the storage of donated input(s) {unused[:8]}{' ...' if len(unused) > 8 else ''} "
            f"is not reused: no output of the same shape, dtype and layout is computed from "
            f"them in place (or an output, or the backward, still reads them). They are "
            f"consumed by the call all the same.", stacklevel=4)
    return reused


# NOTE [Residual layouts]
# The forward returns each residual in the layout propagation gives it, so that the
# backward starts where the forward left off, with no communication in between.
# A layout no P expresses (DTensor's _StridedShard, from a view that merges two
# sharded dims) is the exception: its shards may differ in size from rank to rank,
# which a program traced once for every rank cannot have, and few sharding rules
# take it. Views are recomputed in the backward (NOTE [Views are recomputed in the
# backward] in sharded/_trace.py), so a residual rarely has one; if one does, the
# forward is partitioned again with that residual's strided mesh axes replicated.


def _agreement_point(gm) -> None:
    """Take the call's agreement as a last input and check it just before the first op of the program that is not
    a pure aten op (a collective, an in-place write that may land in a donated input,
    any other namespace's op: DTensor's CUDA all-to-all is ``_dtensor::``), or at its
    end: NOTE [The agreement overlaps the program]. Before that point the program only
    computes into its own memory, so ranks that disagree stop with nothing sent and
    nothing overwritten. Inductor's copy leaves the call out; its runner checks before
    running it."""
    g = gm.graph

    def local(n) -> bool:
        if n.op != "call_function":
            return n.op in ("placeholder", "get_attr")
        if isinstance(n.target, _torch.OpOverload):
            return n.target.namespace == "aten" and not _torch.is_mutating_op(n.target) \
                and n.target not in _torch.COLLECTIVE_OPS
        return n.target is operator.getitem

    where = next(n for n in g.nodes if not local(n))     # (the output node at the latest)
    placeholders = g.find_nodes(op="placeholder")
    with (g.inserting_after(placeholders[-1]) if placeholders
          else g.inserting_before(next(iter(g.nodes)))):
        agreement = g.placeholder("agreement")      # the call's sync.Agreement
    with g.inserting_before(where):
        point = g.call_function(sync.agreed, (agreement,))
    point.meta[META_AGREEMENT] = True


def _plain_residual_specs(placements: list, vals: list, mesh) -> list | None:
    """Out specs for the residuals if some residual's layout has no P (NOTE
    [Residual layouts]): None for each plain one, its layout with the strided mesh
    axes replicated for the others; None if every layout is plain."""
    specs: list = []
    changed = False
    for pl, v in zip(placements, vals):
        ndim = v.meta["val"].ndim
        try:
            from_placements(pl, mesh, ndim)
            specs.append(None)
        except ValueError:
            plain = tuple(p if type(p) in (Shard, Replicate) else Replicate() for p in pl)
            specs.append(from_placements(plain, mesh, ndim))
            changed = True
    return specs if changed else None


def _spec_or_placements(placements, mesh, ndim):
    """The P of ``placements``, or the placements where no P expresses them (a
    residual laid out as a _StridedShard)."""
    try:
        return from_placements(placements, mesh, ndim)
    except ValueError:
        return tuple(placements)
