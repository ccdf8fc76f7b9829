"""P: immutable, hashable, and converting to and from DTensor placements."""

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from sharded import Mesh, P, gather, shard, spec_of, visualize_sharding
from sharded.spec import from_placements, to_placements


class _FakeMesh:  # the conversions only need names and sizes
    def __init__(self, shape, names):
        self.shape, self.axis_names = shape, names


MESH = _FakeMesh((2, 2), ("dp", "tp"))


def test_p_is_immutable_hashable_and_ignores_trailing_none():
    assert P("dp", None) == P("dp") and hash(P("dp", None)) == hash(P("dp"))
    assert P(("dp",)) == P("dp")
    assert P(("dp", "tp")) != P(("tp", "dp"))
    assert {P("dp"): 1}[P("dp", None)] == 1
    with pytest.raises(AttributeError):
        P("dp").x = 1
    assert repr(P("dp", None, ("dp", "tp"))) == "P('dp', None, ('dp', 'tp'))"
    assert P("dp", ("a", "b")).axes() == ["dp", "a", "b"]
    with pytest.raises(TypeError, match="P entry 0 must be None, a mesh axis name or a tuple"):
        P(3)
    import pickle

    assert pickle.loads(pickle.dumps(P("dp", None, ("a", "b")))) == P("dp", None, ("a", "b"))


@pytest.mark.parametrize("spec, placements", [
    (P(), (Replicate(), Replicate())),
    (P("dp"), (Shard(0), Replicate())),
    (P(None, "tp"), (Replicate(), Shard(1))),
    (P("tp", "dp"), (Shard(1), Shard(0))),
    (P(("dp", "tp")), (Shard(0), Shard(0))),
])
def test_placements_round_trip(spec, placements):
    assert to_placements(spec, MESH) == placements
    assert from_placements(placements, MESH, 2) == spec
    assert repr(from_placements(placements, MESH, 2)) == repr(spec)  # no trailing Nones


def test_axes_out_of_mesh_order_are_strided_shards():
    """NOTE [Axes out of mesh order]: P(("tp", "dp")) on a ("dp", "tp") mesh is FSDP2's
    (_StridedShard(0, split_factor=|tp|), Shard(0)), and every order of a dim's axes
    round-trips; each rank's block (spec.block) is the one DTensor computes, on 2- and
    3-axis abstract meshes, for every rank. A _StridedShard whose split factor is no
    product of later axes' sizes (a view that merged two split dims) has no spec."""
    import itertools

    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from sharded import _torch
    from sharded.spec import block

    assert to_placements(P(("tp", "dp")), MESH) == (_torch.strided_shard(0, 2), Shard(0))
    for shape, names in (((2, 3), ("a", "b")), ((2, 3, 2), ("a", "b", "c"))):
        for order in (o for k in range(2, len(names) + 1) for o in itertools.permutations(names, k)):
            spec = P(None, order)
            for rank in range(6 if len(shape) == 2 else 12):
                mesh = Mesh.abstract(shape, names, rank=rank)
                pl = to_placements(spec, mesh)
                assert from_placements(pl, mesh, 2) == spec
                with _torch.suspend_dispatch_modes():
                    size, offset = compute_local_shape_and_global_offset(
                        torch.Size((3, 24)), mesh.device_mesh, pl)
                assert block((3, 24), pl, mesh) == (tuple(size), tuple(offset)), (spec, rank)
    with pytest.raises(ValueError, match="no PartitionSpec expresses them"):
        from_placements((_torch.strided_shard(0, 3), Shard(0)), MESH, 1)


def test_partial_has_no_spec():
    with pytest.raises(ValueError, match="pending reduction over mesh axis 'dp'"):
        from_placements((Partial(), Replicate()), MESH, 2)


def _shard_gather_2d():
    mesh = Mesh((2, 2), ("dp", "tp"))
    x = torch.arange(32.0).reshape(4, 8)
    for spec in (P("dp", "tp"), P(("dp", "tp")), P(None, ("dp", "tp")), P("tp")):
        d = shard({"x": x}, {"x": spec}, mesh)["x"]
        assert spec_of(d) == spec
        torch.testing.assert_close(gather(d), x)
    d = shard(x, P("dp", "tp"), mesh)
    # rank r = 2 * dp + tp holds rows dp*2:(dp+1)*2 and columns tp*4:(tp+1)*4
    dp, tp = mesh.coordinate()
    torch.testing.assert_close(d.to_local(), x[dp * 2:dp * 2 + 2, tp * 4:tp * 4 + 4])
    return visualize_sharding(d)


def test_shard_gather_and_visualize_on_2x2(on_ranks):
    text = on_ranks(4, _shard_gather_2d)[0]
    assert "rank 3 (dp=1, tp=1): [2:4, 4:8]" in text, text


def _mesh_pickles():
    import pickle

    mesh = Mesh((2, 2), ("dp", "tp"))
    back = pickle.loads(pickle.dumps(mesh))
    assert back is mesh and back.device_type == "cpu"
    dm = mesh.device_mesh
    assert Mesh.from_device_mesh(dm) is mesh


def test_mesh_pickles_and_from_device_mesh_is_stable(on_ranks):
    on_ranks(4, _mesh_pickles)
