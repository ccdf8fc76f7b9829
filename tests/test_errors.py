"""Bad input gets a clear error that names the API, the pytree path, the shapes, the
mesh and the fix. Each test matches the fragment a user would search for."""

import os

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from sharded import Mesh, P
from sharded.modes import ShardingRuleError
from sharded.rules import register_sharding
from transforms import TracingError, pjit


@pytest.fixture(scope="module")
def mesh1():
    return Mesh((1,), ("dp",))


# Two custom ops: one never gets a sharding rule, one gets it in a test.
@torch.library.custom_op("sharded_tests::no_rule", mutates_args=())
def _no_rule(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_no_rule.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("sharded_tests::with_rule", mutates_args=())
def _with_rule(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_with_rule.register_fake
def _(x):
    return torch.empty_like(x)


# -- in_specs ---------------------------------------------------------------------------

def test_in_specs_not_a_prefix_names_the_key_path(mesh1):
    f = pjit(lambda p, x: p["w"] @ x, in_specs=({"w": P(), "b": P()}, P()), mesh=mesh1)
    with pytest.raises(ValueError, match=r"pjit\(<lambda>\) in_specs\[0\] does not match the argument's keys: spec for key\(s\) \['b'\] not in the argument"):
        f({"w": torch.ones(2, 2)}, torch.ones(2))


def test_in_specs_container_where_the_argument_is_a_tensor(mesh1):
    f = pjit(lambda p: p["w"], in_specs=({"w": {"a": P()}},), mesh=mesh1)
    with pytest.raises(ValueError, match=r"in_specs\[0\]\['w'\] is a dict, but the argument there is a tensor of shape \(2,\)"):
        f({"w": torch.ones(2)})


def test_in_specs_count(mesh1):
    f = pjit(lambda a, b: a + b, in_specs=(P(),), mesh=mesh1)
    with pytest.raises(ValueError, match=r"in_specs has 1 entries but the call has 2 positional args"):
        f(torch.ones(2), torch.ones(2))


def test_in_specs_string_instead_of_P(mesh1):
    f = pjit(lambda x: x, in_specs=("dp",), mesh=mesh1)
    with pytest.raises(TypeError, match=r"in_specs\[0\] is 'dp'; expected P\(...\), None, or a container. Did you mean P\('dp'\)\?"):
        f(torch.ones(2))


def test_unknown_mesh_axis(mesh1):
    f = pjit(lambda p: p["w"] * 2, in_specs=({"w": P("tp")},), mesh=mesh1)
    with pytest.raises(ValueError, match=r"in_specs\[0\]\['w'\] \(for args\[0\]\['w'\]\) is P\('tp'\), which names mesh axis 'tp', but the mesh has axes \('dp',\)"):
        f({"w": torch.ones(2)})


def test_repeated_mesh_axis(mesh1):
    f = pjit(lambda x: x, in_specs=P("dp", "dp"), mesh=mesh1)
    with pytest.raises(ValueError, match=r"uses mesh axis 'dp' twice \(dims 0 and 1\)"):
        f(torch.ones(2, 2))


def test_spec_longer_than_the_tensor(mesh1):
    f = pjit(lambda x: x, in_specs=P(None, "dp"), mesh=mesh1)
    with pytest.raises(ValueError, match=r"has 2 entries, but the tensor has 1 dims \(shape \(4,\)\)"):
        f(torch.ones(4))


def test_out_specs_checked_against_outputs(mesh1):
    f = pjit(lambda x: (x, x.sum()), in_specs=P(), out_specs=(P(), P("dp")), mesh=mesh1)
    with pytest.raises(ValueError, match=r"out_specs\[1\] \(for output\[1\]\) is P\('dp'\), which has 1 entries, but the tensor has 0 dims"):
        f(torch.ones(4))


def _not_divisible():
    mesh = Mesh((4,), ("dp",))
    f = pjit(lambda p: p["w"] * 2, in_specs=({"w": P("dp")},), mesh=mesh)
    f({"w": torch.ones(6, 2)})


def test_dim_not_divisible(on_ranks):
    with pytest.raises(ValueError, match=r"pjit\(<lambda>\) in_specs\[0\]\['w'\] \(for args\[0\]\['w'\]\) maps dim 0 \(size 6\) to mesh axis 'dp' \(size 4\), which does not divide it; pad the input or change the mesh"):
        on_ranks(4, _not_divisible)


# -- the mesh -----------------------------------------------------------------------------

def test_mesh_size_must_match_world(mesh1):
    with pytest.raises(ValueError, match=r"Mesh\(2, 2\) has 4 ranks but the world has 1"):
        Mesh((2, 2), ("dp", "tp"))


def test_mesh_axis_names(mesh1):
    with pytest.raises(ValueError, match=r"Mesh axis names must be unique; 'dp' repeats"):
        Mesh((1, 1), ("dp", "dp"))
    with pytest.raises(ValueError, match=r"give one name per axis"):
        Mesh((1, 1), ("dp",))


def test_pjit_without_a_mesh():
    f = pjit(lambda x: x, in_specs=P())
    with pytest.raises(ValueError, match=r"pjit\(<lambda>\) needs a mesh: pass mesh=Mesh\(...\) or call it inside `with mesh:`"):
        f(torch.ones(2))


def test_with_mesh_context(mesh1):
    f = pjit(lambda x: x * 2, in_specs=P("dp"))
    with mesh1:
        out = f(torch.ones(2))
    torch.testing.assert_close(out.full_tensor(), torch.full((2,), 2.0))


# -- the function ------------------------------------------------------------------------

def test_input_mutation(mesh1):
    def f(p, x):
        p["w"].add_(x)
        return p["w"] * 2

    g = pjit(f, in_specs=(P(), P()), mesh=mesh1)
    with pytest.raises(ValueError, match=r"mutates its input args\[0\]\['w'\] in place; pjit functions must be pure. Return the new value instead"):
        g({"w": torch.ones(2)}, torch.ones(2))


def test_data_dependent_control_flow(mesh1):
    def f(x):
        if x.sum() > 0:
            return x
        return -x

    with pytest.raises(TracingError, match=r"control flow or output shape depends on tensor values .* use torch.where"):
        pjit(f, in_specs=P(), mesh=mesh1)(torch.ones(2))


def test_data_dependent_call_names_the_users_line(mesh1):
    """Under torch.func.grad too: the frame is the user's, not torch.func's."""
    def step(x):
        def loss(x):
            if (x > 0).all():  # the data-dependent line
                return x.sum()
            return (2 * x).sum()

        return torch.func.grad(loss)(x)

    with pytest.raises(TracingError) as info:
        pjit(step, in_specs=P(), mesh=mesh1).lower(torch.ones(2))
    assert f"\n  at {__file__}:" in str(info.value)
    assert "in loss: `if (x > 0).all():  # the data-dependent line`" in str(info.value)


def test_data_dependent_call_in_a_library_names_its_line_and_the_users(mesh1, tmp_path, monkeypatch):
    """An installed library's line (one that asks for a value, as transformers' masking
    code did before it checked torch.compiler.is_compiling()), and the user's call."""
    import sharded._trace as trace

    (tmp_path / "valuelib.py").write_text(
        "def packed(pos):\n"
        "    if (pos[:, -1] == 0).all():  # the library's line\n"
        "        return None\n"
        "    return pos\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(trace, "_SITE_DIRS", (str(tmp_path) + os.sep,))   # as if installed
    import valuelib

    def f(pos):
        return valuelib.packed(pos) * 2  # the user's call

    with pytest.raises(TracingError) as info:
        pjit(f, in_specs=P(), mesh=mesh1).lower(torch.ones(2, 3))
    msg = str(info.value)
    assert f"\n  at {tmp_path / 'valuelib.py'}:2 in packed: `if (pos[:, -1] == 0).all():  # the library's line`" in msg
    assert f"\n  called from {__file__}:" in msg and "`return valuelib.packed(pos) * 2  # the user's call`" in msg


def test_libraries_see_an_export_trace(mesh1):
    """pjit traces as torch.export's non-strict mode does: torch.compiler.is_compiling()
    and is_exporting() are True while the function is traced (libraries take their
    traceable branch), and False around it."""
    seen = []

    def f(x):
        seen.append((torch.compiler.is_compiling(), torch.compiler.is_exporting()))
        return x + 1

    pjit(f, in_specs=P(), mesh=mesh1).lower(torch.ones(2))
    assert seen == [(True, True)]
    assert (torch.compiler.is_compiling(), torch.compiler.is_exporting()) == (False, False)


def test_op_without_sharding_rule(mesh1):
    g = pjit(lambda x: _no_rule(x), in_specs=P("dp"), mesh=mesh1)
    with pytest.raises(ShardingRuleError, match=r"DTensorExpandMode has no sharding rule for sharded_tests.no_rule.default .* Register one with sharded.rules.register_sharding\(sharded_tests.no_rule.default\)"):
        g(torch.ones(4))


def test_registered_sharding_rule_is_used(mesh1):
    @register_sharding(torch.ops.sharded_tests.with_rule.default)
    def _(x):
        return [([Replicate()], [Replicate()]), ([Shard(0)], [Shard(0)])]

    g = pjit(lambda x: _with_rule(x), in_specs=P("dp"), mesh=mesh1)
    torch.testing.assert_close(g(torch.ones(4)).full_tensor(), torch.full((4,), 2.0))


def test_unhashable_static_leaf(mesh1):
    g = pjit(lambda x, cfg: x, in_specs=(P(), None), mesh=mesh1)
    with pytest.raises(TypeError, match=r"non-tensor arguments are static and must be hashable"):
        g(torch.ones(2), {1, 2})  # a set is a leaf, and unhashable


def test_axes_out_of_mesh_order():
    mesh = Mesh((1, 1), ("dp", "tp"))
    f = pjit(lambda x: x, in_specs=P(("tp", "dp")), mesh=mesh)
    with pytest.raises(NotImplementedError, match=r"in an order other than the mesh's \('dp', 'tp'\); list the axes in mesh order, e.g. \('dp', 'tp'\)"):
        f(torch.ones(2))


def test_static_argnums_and_mode_are_checked(mesh1):
    with pytest.raises(ValueError, match=r"static_argnums has 2, but the function takes 2 positional argument"):
        pjit(lambda x, n: x * n, in_specs=(P(),), static_argnums=(2,), mesh=mesh1)
    f = pjit(lambda *a: a[0] * a[1], in_specs=(P(),), static_argnums=(2,), mesh=mesh1)
    with pytest.raises(ValueError, match=r"static_argnums has 2, but the call has 2 positional args"):
        f(torch.ones(2), 3)
    with pytest.raises(TypeError, match=r"pjit mode must be a sharded.modes.ParallelMode"):
        pjit(lambda x: x, in_specs=P(), mesh=mesh1, mode="dtensor")


def test_from_device_mesh_needs_axis_names(mesh1):
    from torch.distributed.device_mesh import init_device_mesh

    with pytest.raises(ValueError, match=r"Mesh.from_device_mesh needs a DeviceMesh with mesh_dim_names"):
        Mesh.from_device_mesh(init_device_mesh("cpu", (1,)))


def test_a_cotangent_on_another_mesh_is_refused_by_name(mesh1):
    """The backward program checks each DTensor cotangent's mesh, as the forward checks
    its inputs' (it would have redistributed on the cotangent's own mesh)."""
    from sharded import shard

    w = shard(torch.ones(4), P(), mesh1).requires_grad_()
    out = pjit(lambda w: w * 2, in_specs=P(), mesh=mesh1)(w)
    other = shard(torch.ones(4), P(), Mesh((1,), ("tp",)))
    with pytest.raises(ValueError, match=r"pjit\(<lambda>\) backward: the cotangent of output 0 "
                                         r"is a DTensor on .*not on the pjit mesh .*gather it"):
        torch.autograd.grad(out, w, grad_outputs=other)
