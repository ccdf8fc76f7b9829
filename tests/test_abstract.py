"""Mesh.abstract: lowering for meshes this machine cannot run, in one process. On 4
real ranks, every rank's program equals the one lowered for its rank on an abstract
mesh of the same shape; large meshes lower from meta tensors; nothing runs on one."""

import optree
import pytest
import torch

from examples import gpt
from sharded import Mesh, P, gather, optim, shard
from sharded import collectives as C
from sharded.modes import DataParallelMode
from transforms import pjit, shard_map

CFG = gpt.tiny(n_layers=1, d_model=32, vocab=64, seq=8)


def _programs(mesh):
    """(name, Lowered) for a few programs on ``mesh``: Megatron specs with the batch
    over "dp" (DTensorExpandMode), DataParallelMode("shard") composed with them, and a
    shard_map with a collective over an axis tuple."""
    params = gpt.init_params(CFG)
    opt = optim.adamw_init(params)
    ids, tgt = gpt.batch(CFG, 4)
    ps = gpt.tp_specs(params)
    specs = (ps, gpt.opt_specs(ps), P("dp"), P("dp"))
    out = []
    for name, mode in (("expand", None), ("fsdp", DataParallelMode("shard"))):
        f = pjit(gpt.train_step, in_specs=specs, mesh=mesh, static_argnums=(4,), mode=mode)
        out.append((name, f.lower(params, opt, ids, tgt, CFG)))
    region = shard_map(lambda x: C.psum(x * 2, ("dp", "tp")), mesh=mesh, in_specs=P(("dp", "tp")),
                       out_specs=P())
    out.append(("shard_map", pjit(region, in_specs=P(), mesh=mesh).lower(torch.ones(8, 3))))
    return out


def _signature(lowered) -> tuple:
    nodes = []
    for n in lowered.local_graph.graph.nodes:
        val = n.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        nodes.append((n.op, str(n.target) if n.op == "call_function" else "", shape))
    return ([str(c) for c in lowered.collectives()], lowered.cost(by="axis"), nodes,
            lowered.memory()["peak_bytes"])


def _real_and_abstract():
    real = Mesh((2, 2), ("dp", "tp"))
    abstract = Mesh.abstract((2, 2), ("dp", "tp"), rank=real.rank)
    assert abstract.coordinate() == real.coordinate() and abstract.rank == real.rank
    return [(name, _signature(a), _signature(b))
            for (name, a), (_, b) in zip(_programs(real), _programs(abstract))]


def test_abstract_mesh_lowers_the_program_of_real_ranks(on_ranks):
    for rank, programs in enumerate(on_ranks(4, _real_and_abstract)):
        for name, real, abstract in programs:
            assert real == abstract, (rank, name)
            assert real[0], (rank, name)          # the programs do communicate


def test_lowering_for_512_ranks_from_meta_tensors():
    mesh = Mesh.abstract((64, 8), ("dp", "tp"), rank=13)
    assert mesh.coordinate() == (1, 5) and mesh.rank == 13
    cfg = gpt.tiny(n_layers=1, d_model=64, n_heads=8, vocab=256, seq=16)
    with torch.device("meta"):
        params = gpt.init_params(cfg)
        opt = optim.adamw_init(params)
    ids = torch.empty(128, 16, dtype=torch.long, device="meta")
    ps = gpt.tp_specs(params)
    f = pjit(gpt.train_step, in_specs=(ps, gpt.opt_specs(ps), P("dp"), P("dp")), mesh=mesh,
             static_argnums=(4,))
    lowered = f.lower(params, opt, ids, ids, cfg)
    by_axis = lowered.cost(by="axis")
    assert set(by_axis) == {"dp", "tp", "total"}
    # each "tp" collective's group has 8 ranks, each "dp" one 64
    assert {c.group_size for c in lowered.collectives() if c.axis == "tp"} == {8}
    assert {c.group_size for c in lowered.collectives() if c.axis == "dp"} == {64}
    mem = lowered.memory()
    # this rank's blocks: the Megatron-split params and moments (8-way over "tp"), the
    # step count, and 2 of the 128 examples of ids and targets
    leaves = optree.tree_leaves(params)
    spec_leaves = optree.tree_leaves(ps, is_leaf=lambda x: isinstance(x, P))
    blocks = sum(t.numel() * 4 // (8 if "tp" in s else 1) for t, s in zip(leaves, spec_leaves))
    assert mem["input_bytes"] == 3 * blocks + 4 + 2 * (2 * 16 * 8)
    assert mem["peak_bytes"] > mem["input_bytes"]
    with pytest.raises(RuntimeError, match="abstract mesh .* for .lower.. only"):
        f(params, opt, ids, ids, cfg)


def test_nothing_runs_on_an_abstract_mesh():
    mesh = Mesh.abstract((4,), ("dp",), rank=1)
    x = shard(torch.arange(8.0), P("dp"), mesh)         # placing blocks is local: fine
    assert x.to_local().tolist() == [2.0, 3.0]
    with pytest.raises(RuntimeError, match="gather cannot run on Mesh.abstract"):
        gather(x)
    with pytest.raises(RuntimeError, match="abstract mesh"):
        shard_map(lambda v: C.psum(v, "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P())(x)
    with pytest.raises(ValueError, match=r"rank must be an int in range\(4\)"):
        Mesh.abstract((4,), ("dp",), rank=4)
    assert Mesh.abstract((4,), ("dp",), rank=1) is mesh


def test_abstract_meshes_of_one_shape_that_share_an_axis_name():
    """Each abstract mesh's fake process groups are named after the whole mesh: two of
    one shape that share an axis name ("dp" as dim 0 of one and dim 1 of the other)
    both lower (their "dp" groups, and their groups over every axis, once collided:
    "A process group is already registered under the name ...")."""
    def loss(x):
        return (x * 2).sum()

    counts = []
    for names in (("dp", "tp"), ("pp", "dp")):
        mesh = Mesh.abstract((2, 2), names)
        lowered = pjit(loss, in_specs=(P(("dp",) if names[0] == "dp" else "dp"),),
                       mesh=mesh, mode=DataParallelMode()).lower(torch.ones(8, 4, device="meta"))
        counts.append([(c.kind, c.axis, c.group_size) for c in lowered.collectives()])
    assert counts == [[("all_reduce", "dp", 2)]] * 2


@pytest.mark.parametrize("shape,names,axis", [((2,), ("tp",), "tp"), ((2, 2), ("dp", "tp"), "dp")])
def test_a_shard_that_moves_to_another_dim_of_its_axis(shape, names, axis):
    """Two inputs sharded over one axis on different dims: DTensor moves one to the
    other's dim (on CPU: gloo has no all-to-all, so torch gathers and slices, asking
    the group for this rank's index). On an abstract mesh that question failed with
    "Default process group has not been initialized"; the mesh's coordinate answers
    it. Found through AUTO layouts, which choose such pairs."""
    mesh = Mesh.abstract(shape, names, rank=1)
    lowered = pjit(lambda a, b: a + b, in_specs=(P(axis), P(None, axis)),
                   mesh=mesh).lower(torch.ones(4, 4), torch.ones(4, 4))
    assert [(c.kind, c.axis) for c in lowered.collectives()] == [("all_gather", axis)]
