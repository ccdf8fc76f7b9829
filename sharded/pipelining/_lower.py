"""The lowering of a pipelined train step and its program type.

A step that calls ``pipeline(loss_fn, ...)`` is traced and partitioned as any step
(the pipeline axis replicated: sharded/lowering.py), then cut into pieces
(NOTE [Pipeline pieces] in sharded/pipelining/_split.py); each piece gets the mode's
passes and runner, and ``PipelinedForward`` runs this rank's pieces in the schedule's
order (sharded/pipelining/_runtime.py). Inputs are taken only where a piece on this
rank reads them; a stage's outputs come back as DTensors on that stage's slice of the
mesh (NOTE [Stage slices] in sharded/mesh.py), scalars (the loss) on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.tensor import DTensor, Replicate

from sharded import _torch, sync
from sharded._arguments import check_on_mesh
from sharded._fingerprint import ambient_text, fmt_meta, program_lines, stable_repr
from sharded.passes import fingerprint
from sharded._program import Forward, _separate_donated, local_input
from sharded._registry import META_DONATED, META_PATH
from sharded.mesh import mesh_device, slice_of, stage_slice
from sharded.modes._runner import make_runner
from sharded.pipelining import _markers as M, _schedules
from sharded.pipelining._api import PipelineConfig
from sharded.pipelining._report import format_report, report
from sharded.pipelining._runtime import Plan, PipelineRunner
from sharded.pipelining._split import MB, PipelineError, split_program
from sharded.spec import from_placements, local_slice


def is_pipelined(gm: fx.GraphModule) -> bool:
    return bool(gm.graph.find_nodes(op="call_function", target=M.OUTPUT))


def config_of(gm: fx.GraphModule) -> PipelineConfig:
    node = gm.graph.find_nodes(op="call_function", target=M.OUTPUT)[0]
    return PipelineConfig.parse(node.args[1])


def check_mesh(config: PipelineConfig, mesh, in_paths, in_placements, name: str) -> None:
    """The pipeline axis is on the mesh, and no input is laid out over it (the pipeline
    places state by stage)."""
    if config.axis not in mesh.axis_names:
        raise PipelineError(
            f"{name}: pipeline(..., axis={config.axis!r}) but the mesh {mesh} has no axis "
            f"{config.axis!r}; add it (Mesh((2, ...), ({config.axis!r}, ...))).")
    d = mesh.axis_names.index(config.axis)
    for path, pl in zip(in_paths, in_placements):
        if pl is not None and not isinstance(pl[d], Replicate):
            raise PipelineError(
                f"{name}: in_specs for {path} lay it out over the pipeline axis "
                f"{config.axis!r} ({pl[d]}); the pipeline places each stage's state on its "
                f"ranks itself: leave {config.axis!r} out of the specs.")


@dataclass(eq=False, kw_only=True)
class PipelinedForward(Forward):
    """A pipelined step's program: this rank's pieces, its schedule, and where each
    input and output lives."""

    split: Any = None
    order: dict = field(default_factory=dict)
    pp_axis: str = "pp"
    pp_rank: int = 0
    needed: list = field(default_factory=list)      # per tensor input: read on this rank
    in_owner: list = field(default_factory=list)    # per tensor input: the pp rank that reads it (None: several)
    in_local_meta: list = field(default_factory=list)   # per tensor input: its local shape and dtype
    out_owner: list = field(default_factory=list)   # per tensor output: stage coordinate or None
    stage_specs: list = field(default_factory=list)  # per tensor output: DTensorSpec on its slice

    def __post_init__(self):
        super().__post_init__()
        self._donated_set = set(self.donated_local)

    def _restage(self, leaf: DTensor, pl, holder: int, k: int, d: int):
        """A stage's tensor that this program needs on another stage's ranks (the
        split points moved, or a checkpoint of other stages was loaded): sent from its
        slice over the pipeline axis, each rank its own dp/tp shard. Every rank meets
        the inputs in the same order, so the sends and receives pair up."""
        owner = self.in_owner[k]
        targets = [r for r in range(self.split.n_ranks) if r != holder and (owner is None or r == owner)]
        group = self.mesh.device_mesh.get_group(self.pp_axis)
        if self.pp_rank == holder:
            want = tuple(p for j, p in enumerate(pl) if j != d) or (Replicate(),)
            if tuple(leaf.placements) != want:
                leaf = leaf.redistribute(leaf.device_mesh, want)
            t = _torch.local_tensor(leaf).detach().contiguous()
            for r in targets:
                dist.send(t, group=group, group_dst=r)
            return t if owner is None else None
        if self.pp_rank in targets:
            meta = self.in_local_meta[k]
            buf = torch.empty(meta.shape, dtype=meta.dtype, device=mesh_device(self.mesh))
            dist.recv(buf, group=group, group_src=holder)
            return buf
        return None

    def pipeline_report(self) -> dict:
        """Lowered.pipeline (sharded/pipelining/_report.py)."""
        if getattr(self, "_report", None) is None:
            self._report = report(self.split, self.order, self.local_graph)
        return self._report

    def pipeline_text(self) -> str:
        return format_report(self.pipeline_report())

    def pieces(self) -> list:
        """(name, graph) of this rank's pieces, in the order a step meets them."""
        sp = self.split
        out = [("pre", sp.pre.graph)] if sp.pre is not None else []
        out += [(p.name, p.graph) for p in sp.mb_pieces()]
        return out + [(p.name, p.graph) for p in sp.tail]

    def outcome(self, leaves: list) -> sync.Outcome:
        plain = [i for i, (leaf, pl) in enumerate(zip(leaves, self.in_plan))
                 if pl is not None and isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor)]
        for i, (leaf, pl) in enumerate(zip(leaves, self.in_plan)):
            if pl is not None and isinstance(leaf, DTensor):
                why = _torch.donated_message(leaf)
                if why is not None:
                    raise RuntimeError(f"{self.name}: {self.in_paths[i]} cannot be used: {why}.")
                check_on_mesh(leaf, self.mesh, self.in_paths[i], self.name, stage_slices=True)
        return self.steady_outcome(plain, leaves)

    def run(self, leaves: list, shards: list | None = None,
            agreement: sync.Agreement | None = None) -> Any:
        locals_: list = []
        k = 0
        d = self.mesh.axis_names.index(self.pp_axis)
        for leaf, pl in zip(leaves, self.in_plan):
            if pl is None:
                continue
            found = slice_of(leaf.device_mesh) if isinstance(leaf, DTensor) else None
            if found is not None and found[2] != self.in_owner[k]:
                sync.agreed(agreement)       # (moving it communicates: agree first)
                locals_.append(self._restage(leaf, pl, found[2], k, d))
            elif not self.needed[k]:
                locals_.append(None)
            elif found is not None:
                want = tuple(p for j, p in enumerate(pl) if j != d) or (Replicate(),)
                if tuple(leaf.placements) != want:
                    sync.agreed(agreement)   # (redistributing communicates: agree first)
                    leaf = leaf.redistribute(leaf.device_mesh, want)
                t = _torch.local_tensor(leaf)
                locals_.append((t.detach() if t.requires_grad else t).contiguous())
            elif isinstance(leaf, DTensor):
                if tuple(leaf.placements) != tuple(pl):
                    sync.agreed(agreement)
                locals_.append(local_input(leaf, pl, self.mesh))
            else:
                t = local_slice(leaf.detach() if leaf.requires_grad else leaf, pl, self.mesh)
                # a plain input stays the caller's (NOTE [Donation]): its shard may be
                # the caller's storage, which a donated input's update would write
                locals_.append(t.clone() if k in self._donated_set else t)
            k += 1
        if self.donated:
            present = [t if t is not None else torch.empty(0) for t in locals_]
            _separate_donated(present, self.donated_local)     # (overlapping inputs)
            for k in self.donated_local:
                if locals_[k] is not None:
                    locals_[k] = present[k]
        self.with_random_inputs(locals_)     # ((m + 1) x the traced program's draws)
        try:
            outs = self.runner(*locals_, agreement=agreement)
        except BaseException:
            if self.donated and (agreement is None or not agreement.failed):
                self._consume(leaves)
            raise
        if self.donated:
            self._consume(leaves)
        wrapped = []
        for o, owner, spec, stage_spec in zip(outs, self.out_owner, self.out_dtensor_specs,
                                              self.stage_specs):
            if owner is None:
                wrapped.append(_torch.make_dtensor(o, spec))
            else:
                if o is None:
                    o = torch.empty(0, dtype=spec.tensor_meta.dtype, device=mesh_device(self.mesh))
                wrapped.append(_torch.make_dtensor(o, stage_spec))
        return self.outputs(wrapped)


def build_pipelined(*, arguments, mode, sig, args, run_state, global_gm: fx.GraphModule,
                    inp, out_info: dict, trace_s: float, lower_graph, passes_and_finalize,
                    dtensor_spec) -> PipelinedForward:
    """The pipelined counterpart of ``lowering.build_forward`` (after the trace), which
    passes its own steps in (``lower_graph``, ``passes_and_finalize``, ``dtensor_spec``:
    sharded/lowering.py calls this module, not the other way round)."""
    name, mesh = arguments.name, sig.mesh
    config = config_of(global_gm)
    if global_gm.meta.get("joint") is not None:
        raise PipelineError(
            f"{name}: a pipelined step is differentiated inside (torch.func.grad of "
            f"pipeline(loss_fn)); calling it on inputs that require grad, or under "
            f"torch.func.grad from outside, is not supported. Pass detached tensors.")
    check_mesh(config, mesh, inp.paths, inp.placements, name)
    donated = arguments.donated_leaves(args, sig.static_argnums, inp.dyn_kw, sig.leaves)
    tensor_leaf = [isinstance(x, torch.Tensor) for x in sig.leaves]
    donated_local = [tensor_leaf[:j].count(True) for j in donated]
    out_leaves, out_treedef = out_info["leaves"], out_info["treedef"]
    out_specs = arguments.out_leaf_specs(out_leaves, out_treedef, mesh)
    for node, path in zip(global_gm.graph.find_nodes(op="placeholder"), inp.paths):
        node.meta[META_PATH] = path
    global_text = program_lines(global_gm)
    low = lower_graph(global_gm, mode, mesh, inp.placements, out_specs, name=name,
                      passes=False)
    local = low.graph
    n_ranks = mesh.size(config.axis)
    d = mesh.axis_names.index(config.axis)
    pp_rank = (mesh.coordinate()[d] if not mesh.is_abstract else
               int((mesh.device_mesh.mesh == mesh.rank).nonzero()[0][d]))
    order = _schedules.order(config.schedule, n_ranks, config.microbatches, config.virtual)
    numel = {ph.name: m.numel() for ph, m in zip(local.graph.find_nodes(op="placeholder"), inp.metas)}
    split = split_program(local, n_ranks, pp_rank, numel)
    _mark_donated(split, [ph.name for k, ph in enumerate(local.graph.find_nodes(op="placeholder"))
                          if k in donated_local], local)
    # each piece: the mode's passes (and no output shares storage with another:
    # the runtime keeps them apart)
    runners = {}
    for piece in [*split.mb_pieces(), split.pre, *split.tail]:
        if piece is None:
            continue
        piece.graph = passes_and_finalize(piece.graph, mode, mesh, 0, False)
        # (compile="auto" decides with one all-reduce over the mesh, which the ranks of
        # different stages, running different pieces, cannot make together: the pieces
        # of a pipelined step run as graphs unless compile=True asks for inductor)
        runners[piece.name] = make_runner(piece.graph, getattr(mode, "compile", False) is True,
                                          f"{name} {piece.name}", mesh,
                                          run_state(("pipeline", piece.name)))
        if piece.per_microbatch and runners[piece.name] is piece.graph:
            # (a micro-batch's residuals freed as its backward reads them: NOTE [Pipeline
            # memory] in sharded/pipelining/_runtime.py)
            _torch.boxed(piece.graph)
    nodes = {n.name: n for n in local.graph.nodes}
    plan = Plan(split, order, nodes, split.tail_needed)
    metas = {n: v.meta["val"] for n, v in nodes.items() if isinstance(v.meta.get("val"), torch.Tensor)}
    placeholders = local.graph.find_nodes(op="placeholder")
    offset = next((p.name for p in placeholders if p.meta.get(META_PATH) == "rng offset"), None)
    runner = PipelineRunner(split, plan, order, pp_rank, _pp_group(mesh, config.axis), metas,
                            offset, low.n_draws, runners)
    read_here = set()
    for piece in [*split.mb_pieces(), split.pre, *split.tail]:
        if piece is not None:
            read_here.update(piece.inputs)
    for out, s in zip(split.outputs, split.out_stage):        # (inputs returned as they are)
        if isinstance(out, str) and (s is None or split.rank_of_stage[s] == pp_rank):
            read_here.add(out)
    n_inputs = len(inp.paths)
    needed = [p.name in read_here for p in placeholders[:n_inputs]]
    in_owner = []
    for ph in placeholders[:n_inputs]:
        ranks_ = {r for r in (split.rank_of(u.name) for u in ph.users) if r is not None}
        if ph.name in split.param_stage:
            ranks_.add(split.rank_of_stage[split.param_stage[ph.name]])
        in_owner.append(ranks_.pop() if len(ranks_) == 1 else None)

    out_vals = list(next(n for n in reversed(local.graph.nodes) if n.op == "output").args[0])
    global_out = list(next(n for n in reversed(global_gm.graph.nodes) if n.op == "output").args[0])
    out_owner: list = []
    stage_specs: list = []
    for v, s, gv, pl in zip(out_vals, split.out_stage, global_out, low.out_placements):
        scalar = isinstance(v, fx.Node) and v.meta["val"].ndim == 0     # (dims: alike on every rank)
        owner = None if (s is None or scalar) else split.rank_of_stage[s]
        out_owner.append(owner)
        if owner is None:
            stage_specs.append(None)
        else:
            rest = tuple(p for j, p in enumerate(pl) if j != d) or (Replicate(),)
            val = gv.meta["val"]
            stage_specs.append(_torch.build_dtensor_spec(stage_slice(mesh, config.axis, owner), rest,
                                                         val.shape, val.stride(), val.dtype))
    out_dt_specs = [dtensor_spec(mesh, pl, v) for v, pl in zip(global_out, low.out_placements)]
    in_placements, in_specs = inp.placements, inp.specs
    if low.in_placements is not None:       # the mode laid the inputs out itself
        in_placements = list(low.in_placements[:len(in_placements)])
        in_specs = [from_placements(pl, mesh, m.ndim) for pl, m in zip(in_placements, inp.metas)]
    placements = iter(in_placements)
    in_plan = [next(placements) if t else None for t in tensor_leaf]
    dt_specs = iter(out_dt_specs)
    out_plan = [("static", v) if not isinstance(v, torch.Tensor) else ("dtensor", next(dt_specs))
                for v in out_leaves]
    text = (["pipeline: " + config.text(), f"stages {split.n_stages} boundaries {split.boundaries}",
             f"mode: {mode!r}"]
            + [f"input {p}: {fmt_meta(m)} {s_!r}" for p, m, s_ in zip(inp.paths, inp.metas, in_specs)]
            + [f"static args[{i}]: {stable_repr(v)}" for i, v in zip(sig.static_argnums, sig.static_args)]
            + [f"static kwargs[{k!r}]: {stable_repr(v)}" for k, v in sorted((sig.static_kwargs or {}).items())]
            + [f"ambient: {ambient_text(sig.ambient)}", f"donated: {donated}"]
            + [f"output {p}: {tuple(pl)}" for p, pl in zip(range(len(out_specs)), low.out_placements)]
            + ["global program:"] + global_text
            + ["local collectives (the whole step, one micro-batch):"] + fingerprint(local, mesh)[1]
            + ["stages:"] + sorted(f"{ph.meta.get(META_PATH, ph.name)} on stage {split.param_stage[ph.name]}"
                                   for ph in local.graph.find_nodes(op="placeholder")
                                   if ph.name in split.param_stage))
    # (rank-independent: a rank's program may differ from its dp/tp peers' in its
    # nodes (a shard of another size); what every rank must agree on is the global
    # program, the schedule and which stage holds what)

    def lines():
        return text

    entry = PipelinedForward(
        global_graph=global_gm, local_graph=local, runner=runner, mesh=mesh, name=name,
        in_plan=in_plan, in_paths=inp.leaf_paths, in_specs=in_specs, out_treedef=out_treedef,
        out_plan=out_plan, out_placements=low.out_placements, layouts=low.layouts,
        # micro-batch j draws at offset + j x d (d: the traced program's draws), the
        # pieces after them at offset + m x d
        n_draws=low.n_draws * (config.microbatches + 1),
        rng_device=mesh_device(mesh) if low.n_draws else None,
        program=sync.token(*text), lines=lines, times={"trace": trace_s, **low.times},
        n_tensor_out=len(out_specs),
        split=split, order=order, pp_axis=config.axis, pp_rank=pp_rank, needed=needed,
        out_owner=out_owner, stage_specs=stage_specs, in_owner=in_owner,
        in_local_meta=[ph.meta["val"] for ph in placeholders[:n_inputs]],
        donated=donated, donated_local=donated_local,
        donated_msgs=[f"{inp.leaf_paths[j]} was donated to {name}; use the returned value"
                      for j in donated],
    )
    return entry


def _mark_donated(split, donated: list[str], graph: fx.GraphModule) -> None:
    """NOTE [Donation] for a pipelined step: a donated input may be written in place
    only by the last piece on the rank that reads it or a view of it, and only if that
    is a tail piece (the optimizer) and the step returns neither the input nor a view of
    it: the pieces before (the prologue, every micro-batch) still read the old value."""
    order = ([split.pre] if split.pre is not None else []) + split.mb_pieces() + list(split.tail)
    returned = {o for o in split.outputs if isinstance(o, str)}
    by_storage: dict = {}
    for n in graph.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            by_storage.setdefault(_torch.storage_key(val), set()).add(n.name)
    for name in donated:
        ph = next(p for p in graph.graph.find_nodes(op="placeholder") if p.name == name)
        aliases = by_storage.get(_torch.storage_key(ph.meta["val"]), set()) | {name}
        readers = [p for p in order if aliases & set(p.inputs)]
        if not readers or readers[-1] not in split.tail or aliases & returned:
            continue
        for node in readers[-1].graph.graph.find_nodes(op="placeholder"):
            if node.target == name:
                node.meta[META_DONATED] = True


def _pp_group(mesh, axis: str):
    if mesh.is_abstract:
        return None
    return mesh.device_mesh.get_group(axis)
