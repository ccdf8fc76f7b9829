"""sharded.plans: torch's tensor-parallel styles and the project's builders give the
same parameter specs; the styles' activation layouts become part of the traced
program; training through ``functional_call`` equals one device, on real gloo ranks.

Cases marked "port of ..." are written fresh against this API after torch's tests of
``parallelize_module`` (test/distributed/tensor/parallel/test_parallelize_api.py and
test_tp_style.py) and torchtitan's Llama plans.
"""

import functools
import os
import subprocess
import sys
from collections import Counter, OrderedDict

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from examples import gpt, gpt_module as gm
from sharded import Mesh, P, gather, optim, shard, spec_of
from sharded.plans import (
    colwise, parallelize, prepare_input, prepare_output, rowwise, sequence_parallel,
    specs_from_plan,
)
from transforms import pjit, shard_map

CFG = gm.Config(vocab=64, d_model=32, n_heads=4, n_layers=2, seq=16)
BATCH = 4


@pytest.fixture(scope="module")
def mesh1():
    return Mesh((1,), ("tp",))


def _megatron_specs(n_layers: int) -> dict:
    """The specs a Megatron plan gives the GPT, written out by hand."""
    specs = {"wte.weight": P("tp"), "wpe.weight": P()}
    for i in range(n_layers):
        b = f"blocks.{i}."
        specs.update({b + "ln1.weight": P(), b + "ln1.bias": P(),
                      b + "ln2.weight": P(), b + "ln2.bias": P()})
        for w in ("wq", "wk", "wv"):
            specs.update({f"{b}attn.{w}.weight": P("tp"), f"{b}attn.{w}.bias": P("tp")})
        specs.update({b + "attn.wo.weight": P(None, "tp"), b + "attn.wo.bias": P(),
                      b + "mlp.fc1.weight": P("tp"), b + "mlp.fc1.bias": P("tp"),
                      b + "mlp.fc2.weight": P(None, "tp"), b + "mlp.fc2.bias": P()})
    specs.update({"ln_f.weight": P(), "ln_f.bias": P(), "head.weight": P("tp")})
    return specs


# -- rank-side bodies ------------------------------------------------------------------

_SGD = functools.partial(optim.sgd, lr=0.1, momentum=0.9)


def _train_with_plans(shape):
    """3 SGD-with-momentum steps of the GPT through functional_call under pjit,
    Megatron and sequence-parallel plans (torch's styles), against the single-device
    run. (SGD: AdamW would turn summation-order noise in the key biases' gradient,
    zero in exact arithmetic, into parameter differences of order lr.)"""
    mesh = Mesh(shape, ("dp", "tp"))
    ids, targets = gm.pattern_batch(CFG, BATCH)
    out = {}
    for name in ("megatron", "sp"):
        model = gm.GPT(CFG)
        specs = parallelize(model, gm.PLANS[name](), mesh, axis="tp")
        assert specs == _megatron_specs(CFG.n_layers), specs
        assert specs_from_plan(model, gm.PLANS[name](builders=True), mesh) == specs
        params = {k: v.detach() for k, v in model.named_parameters()}
        opt, ospecs = optim.sgd_init(params), specs
        train_step = gm.make_train_step(model, _SGD)
        step = pjit(train_step, in_specs=(specs, ospecs, P("dp"), P("dp")),
                    out_specs=(specs, ospecs, P()), mesh=mesh)
        d_params, d_opt = shard((params, opt), (specs, ospecs), mesh)
        r_params, r_opt = params, opt
        for _ in range(3):
            d_params, d_opt, d_loss = step(d_params, d_opt, ids, targets)
            r_params, r_opt, r_loss = train_step(r_params, r_opt, ids, targets)
            torch.testing.assert_close(gather(d_loss), r_loss, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(gather(d_params), r_params, rtol=1e-4, atol=1e-5)
        assert step.trace_count == 1
        lowered = step.lower(d_params, d_opt, ids, targets)
        calls = [(c.axis, c.kind, c.shape, c.wire_bytes) for c in lowered.collectives()]
        out[name] = calls
        out[name + "_cost"] = lowered.cost()
        if shape == (1, 2) and name == "sp":
            # The builders' plan (layouts as P) traces to the same program.
            model_b = gm.GPT(CFG)
            specs_b = parallelize(model_b, gm.sp_plan(builders=True), mesh)
            step_b = pjit(gm.make_train_step(model_b, _SGD),
                          in_specs=(specs_b, ospecs, P("dp"), P("dp")), mesh=mesh)
            same = [str(c) for c in step_b.lower(params, opt, ids, targets).collectives()]
            assert same == [str(c) for c in lowered.collectives()], same
    return out


class MLPModule(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.net1, self.relu, self.net2 = nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 12)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


class MLPStacked(nn.Module):
    def __init__(self, n_layers=2):
        super().__init__()
        self.layers = nn.ModuleList(MLPModule() for _ in range(n_layers))
        for m in self.layers:
            m.net2 = nn.Linear(16, 10)

    def forward(self, x):
        for m in self.layers:
            x = m(x)
        return x


class KwargModule(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.linear = nn.Linear(8, 8)

    def forward(self, x, *, y, z=2):
        return self.linear(x) + y + z


class EmbedModule(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.emb, self.out = nn.Embedding(16, 8), nn.Linear(8, 4)

    def forward(self, ids):
        return self.out(self.emb(ids))


class NormModule(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(6)
        self.ln, self.proj = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(self.ln(x))


def _sgd_check(mesh, model, plan, args, kwargs=None, in_specs=None):
    """One SGD step of ``sum(model(*args, **kwargs))`` under pjit equals one device;
    returns the program's collectives."""
    kwargs = kwargs or {}
    specs = parallelize(model, plan, mesh, axis="tp")
    params = {k: v.detach() for k, v in model.named_parameters()}

    def step(p, args, kwargs):
        def loss(p):
            out = torch.func.functional_call(model, p, args, kwargs)
            return (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum()

        g, value = torch.func.grad_and_value(loss)(p)
        return {k: p[k] - 0.25 * g[k] for k in p}, value

    f = pjit(step, in_specs=(specs, in_specs or P(), P()), out_specs=(specs, P()), mesh=mesh)
    torch.testing.assert_close(gather(f(params, args, kwargs)), step(params, args, kwargs),
                               rtol=1e-5, atol=1e-5)
    return [str(c) for c in f.lower(params, args, kwargs).collectives()]


def _masked_sum_on_another_axis():
    """An embedding table split over "dp" rows yields a masked pending sum over "dp";
    a plan's layout over "tp" that splits the same rows must not leave the mask behind
    (it failed at run time: 'shape of the mask [16] does not match [8, 8]')."""
    mesh = Mesh((2, 2), ("dp", "tp"))
    out = []
    for desired in (P("tp"), P(None, "tp")):
        torch.manual_seed(0)
        emb = nn.Sequential(nn.Embedding(16, 8))
        specs = parallelize(emb, {"0": prepare_output(output_layouts=P(), desired_output_layouts=desired)}, mesh)
        specs["0.weight"] = P("dp")
        params = {k: v.detach() for k, v in emb.named_parameters()}

        def f(p, ids):
            return torch.func.grad_and_value(
                lambda p: (torch.func.functional_call(emb, p, (ids,)) ** 2).sum())(p)

        g = pjit(f, in_specs=(specs, P()), out_specs=(specs, P()), mesh=mesh)
        ids = torch.tensor([3, 0, 15, 7, 7, 9, 1, 12, 2, 2, 11, 4, 14, 5, 6, 8])
        torch.testing.assert_close(gather(g(params, ids)), f(params, ids), rtol=1e-5, atol=1e-5)
        out.append([str(c) for c in g.lower(params, ids).collectives()])
    return out


def _vmapped_module(mesh):
    """vmap over a parallelized module (per-example outputs and gradients): the
    styles' layouts name the logical dims, so net2's output split over its dim 0 (the
    sequence) is a split of the program's dim 1. (net2 has no bias: under vmap a
    Linear's bias is a separate add, before which the pending sum is all-reduced;
    docs/plans.md, limitations.)"""
    model = MLPModule()
    model.net2 = nn.Linear(16, 12, bias=False)
    specs = parallelize(model, {"net1": colwise(), "net2": rowwise(output_layouts=Shard(0))}, mesh)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.rand(3, 4, 10)

    def per_example(p, x):
        def one(xi):
            return torch.func.functional_call(model, p, (xi,))

        grads = torch.func.vmap(torch.func.grad(lambda p, xi: torch.func.functional_call(
            model, p, (xi,)).pow(2).sum()), in_dims=(None, 0))(p, x)
        return torch.func.vmap(one)(x), grads

    f = pjit(per_example, in_specs=(specs, P()), mesh=mesh)
    out, grads = f(params, x)
    torch.testing.assert_close(gather((out, grads)), per_example(params, x), rtol=1e-5, atol=1e-5)
    assert spec_of(out) == P(None, "tp"), spec_of(out)
    return [str(c) for c in f.lower(params, x).collectives()]


def _torch_style_ports():
    mesh = Mesh((2,), ("tp",))
    torch.manual_seed(0)
    x12, x16 = torch.rand(12, 10), torch.rand(16, 10)
    results = {}
    # port of test_parallelize_module_with_star / _with_question / _with_digit
    for key in ("net*", "net?", "net[1-2]"):
        calls = _sgd_check(mesh, MLPModule(), {key: ColwiseParallel(output_layouts=Replicate())}, (x12,))
        results[key] = calls
    # port of test_parallelize_module_multi_wildcard
    results["multi"] = _sgd_check(
        mesh, MLPStacked(), {"layers.*.net[1]": ColwiseParallel(), "layers.*.net[2]": RowwiseParallel()},
        (x12,))
    # port of test_parallelize_module_with_root_module: the root's input split over the
    # batch, net2's output reduce-scattered over it, the root's output gathered.
    results["root"] = _sgd_check(mesh, MLPModule(), {
        "": PrepareModuleInputOutput(input_layouts=Replicate(), desired_input_layouts=Shard(0),
                                     output_layouts=Shard(0), desired_output_layouts=Replicate()),
        "net1": ColwiseParallel(input_layouts=Shard(0)),
        "net2": RowwiseParallel(output_layouts=Shard(0)),
    }, (x16,))
    # port of test_prepare_module_kwargs_input: a keyword input laid out by name.
    results["kwargs"] = _sgd_check(
        mesh, KwargModule(),
        {"": PrepareModuleInput(input_kwarg_layouts={"y": Shard(0)},
                                desired_input_kwarg_layouts={"y": Replicate()}),
         "linear": ColwiseParallel(output_layouts=Replicate())},
        (torch.rand(4, 8),), {"y": torch.rand(4, 8)})
    # port of test_tp_style's embedding cases: colwise splits the table's dim 1,
    # rowwise its dim 0 (the vocabulary; a masked pending sum).
    ids = torch.tensor([[0, 5, 15, 7], [3, 3, 9, 12]])
    results["emb_col"] = _sgd_check(mesh, EmbedModule(), {"emb": colwise(output_layouts=P())}, (ids,))
    results["emb_row"] = _sgd_check(mesh, EmbedModule(), {"emb": RowwiseParallel(input_layouts=Replicate())}, (ids,))
    # torch's default input_layouts=Shard(-1) for a rowwise embedding: the ids are
    # taken as split on the last dim, so they are all-gathered (as in torch).
    results["emb_row_default"] = _sgd_check(mesh, EmbedModule(), {"emb": RowwiseParallel()}, (ids,))
    # port of test_sequence_parallel_style: a norm's input and output split over the
    # sequence (here dim 0), its parameters replicated.
    results["sp_dim0"] = _sgd_check(mesh, NormModule(), {"ln": sequence_parallel(sequence_dim=0)},
                                    (torch.rand(6, 8),))
    assert specs_from_plan(NormModule(), {"ln": SequenceParallel(sequence_dim=0)}, mesh) == {
        "ln.weight": P(), "ln.bias": P(), "proj.weight": P(), "proj.bias": P()}
    results["vmap"] = _vmapped_module(mesh)
    # Inside a shard_map body the module sees local shards: the hooks stand aside
    # (here they would split the local 3 rows over 2 ranks and fail).
    norm = NormModule()
    parallelize(norm, {"ln": sequence_parallel(sequence_dim=0)}, mesh)
    region = shard_map(lambda x: norm(x), mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))
    x6 = torch.rand(6, 8)
    torch.testing.assert_close(gather(pjit(lambda x: region(x) * 2, in_specs=P("tp"), mesh=mesh)(x6)),
                               norm(x6) * 2)
    # A layout that does not divide the sequence is an error naming the module.
    try:
        _sgd_check(mesh, NormModule(), {"ln": sequence_parallel(sequence_dim=0)}, (torch.rand(5, 8),))
        raise AssertionError("no error")
    except ValueError as e:
        assert "on module 'ln'" in str(e) and "does not divide" in str(e), e
    return results


# -- tests -------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 2), (2, 2)], ids=["tp2", "dp2xtp2"])
def test_gpt_trains_like_one_device_with_megatron_and_sequence_parallel_plans(on_ranks, shape):
    res = on_ranks(shape[0] * shape[1], _train_with_plans, shape)[0]
    L, b = CFG.n_layers, BATCH // shape[0]
    act = b * CFG.seq * CFG.d_model                      # elements of one activation
    cost = {name: res.pop(name + "_cost") for name in ("megatron", "sp")}
    tp = {name: [(k, s, w) for a, k, s, w in calls if a == "tp"] for name, calls in res.items()}
    numel = lambda s: torch.Size(s).numel()  # noqa: E731

    # Megatron: per block one all-reduce after attention and one after the MLP, and
    # one per block input gradient in the backward; plus the embedding's all-reduce,
    # the head's input gradient and the logits' all-gather. Nothing else over "tp".
    mega = Counter((k, numel(s)) for k, s, _ in tp["megatron"])
    assert mega == Counter({("all_reduce", act): 4 * L + 2,
                            ("all_gather", b * CFG.seq * CFG.vocab // 2): 1}), mega
    if shape == (1, 2):
        assert {k: v["count"] for k, v in cost["megatron"].items()} == {
            "all_reduce": 4 * L + 2, "all_gather": 1, "total": 4 * L + 3}, cost["megatron"]

    # Sequence parallel (torchtitan's plan): the activations are reduce-scattered and
    # all-gathered over "tp"; no activation is all-reduced.
    sp = Counter((k, numel(s)) for k, s, _ in tp["sp"] if len(s) >= 3)
    assert sp == Counter({("reduce_scatter", act): 4 * L + 2, ("all_gather", act // 2): 4 * L + 2,
                          ("all_gather", b * CFG.seq * CFG.vocab // 2): 1}), sp
    small = [(k, s) for k, s, _ in tp["sp"] if len(s) < 3]
    n_norm = 2 * CFG.d_model * (2 * L + 1)               # the norms' weights and biases
    assert all(k in ("all_reduce", "all_gather") for k, _ in small), small
    if shape == (1, 2):
        # the norms' gradients (pending sums over the sequence) in one all-reduce, the
        # position table's gradient (split over the sequence) all-gathered.
        assert Counter((k, numel(s)) for k, s in small) == Counter(
            {("all_reduce", n_norm): 1, ("all_gather", CFG.seq * CFG.d_model // 2): 1}), small

    # Bytes on the wire: the SP activation traffic is no more than Megatron's. SP also
    # reduces the gradients of the parameters it replicates over split sequences
    # (norms, position table), which Megatron computes whole on every rank.
    wire = {name: sum(w for _, s, w in calls if len(s) >= 3) for name, calls in tp.items()}
    assert wire["sp"] <= wire["megatron"], wire
    param_grads = sum(w for _, s, w in tp["sp"] if len(s) < 3)
    assert param_grads <= 2 * 4 * (n_norm + CFG.seq * CFG.d_model), param_grads
    if shape == (2, 2):
        # The norms' gradients under SP are pending over both axes (the batch over
        # "dp", the sequence over "tp"): one all-reduce over the whole mesh (NOTE [One
        # reduction over every mesh axis]), not one per axis.
        both = {name: Counter((k, numel(s)) for a, k, s, _ in calls if a == ("dp", "tp"))
                for name, calls in res.items()}
        assert both == {"megatron": Counter(), "sp": Counter({("all_reduce", n_norm): 1})}, both
        assert {a for name in res for a, *_ in res[name]} == {"dp", "tp", ("dp", "tp")}


def test_torch_parallelize_module_cases(on_ranks):
    res = {k: Counter(c.split(" over")[0] for c in v) for k, v in on_ranks(2, _torch_style_ports)[0].items()}
    # Both Linears column-parallel with replicated outputs: each output all-gathered;
    # net2's input gradient (pending) is reduced before the ReLU's backward.
    for key in ("net*", "net?", "net[1-2]"):
        assert res[key] == Counter(["all_gather float32[12, 8]", "all_gather float32[12, 6]",
                                    "all_reduce sum float32[12, 16]"]), (key, res[key])
    # Megatron MLP per layer: one all-reduce forward; the input gradient of layer 2
    # (layer 1's input is the batch, which needs none).
    assert res["multi"] == Counter({"all_reduce sum float32[12, 10]": 3}), res["multi"]
    # Root: its input split over the batch, all-gathered for net1 (input_layouts
    # Shard(0)); net2's pending sum reduce-scattered over the batch; the root's
    # output all-gathered; backward: the gradient at net2's output all-gathered.
    assert res["root"] == Counter({"all_gather float32[8, 10]": 1, "reduce_scatter sum float32[16, 12]": 1,
                                   "all_gather float32[8, 12]": 2}), res["root"]
    # The keyword input y: Shard(0) -> Replicate is an all-gather.
    assert res["kwargs"] == Counter({"all_gather float32[2, 8]": 1, "all_gather float32[4, 4]": 1}), res["kwargs"]
    assert res["emb_col"] == Counter({"all_gather float32[2, 4, 4]": 1}), res["emb_col"]
    assert res["emb_row"] == Counter({"all_reduce sum float32[2, 4, 8]": 1}), res["emb_row"]
    assert res["emb_row_default"] == Counter({"all_gather int64[2, 2]": 1, "all_reduce sum float32[2, 4, 8]": 1})
    # Per-example (vmap): net2's pending sum reduce-scattered over the sequence, no
    # all-reduce of activations.
    assert res["vmap"] == Counter({"reduce_scatter sum float32[6, 2, 12]": 1, "all_reduce sum float32[3]": 1,
                                   "all_gather float32[3, 2, 12]": 1}), res["vmap"]
    # Sequence parallel: no activation collective; the loss and the gradients of the
    # replicated parameters are reduced.
    assert all(c.startswith("all_reduce") for c in res["sp_dim0"]), res["sp_dim0"]


def test_layouts_reduce_a_masked_pending_sum_on_other_axes_first(on_ranks):
    rows, cols = on_ranks(4, _masked_sum_on_another_axis)[0]
    # the masked sum over "dp" is all-reduced once before the "tp" split
    assert rows[0] == "all_reduce sum float32[16, 8] over 'dp'", rows
    assert cols[0] == "all_reduce sum float32[16, 8] over 'dp'", cols


def test_specs_from_torch_styles_and_builders_agree(mesh1):
    model = gm.GPT(CFG)
    expected = _megatron_specs(CFG.n_layers)
    for plan in (gm.megatron_plan(), gm.megatron_plan(builders=True), gm.sp_plan(),
                 gm.sp_plan(builders=True)):
        specs = specs_from_plan(model, plan, mesh1)
        assert specs == expected and list(specs) == [n for n, _ in model.named_parameters()]
    # Embedding colwise splits dim 1; Linear colwise its bias too; rowwise keeps it.
    specs = specs_from_plan(model, {"wte": ColwiseParallel(), "blocks.0.attn.wo": colwise(),
                                    "head": rowwise()}, mesh1)
    assert specs["wte.weight"] == P(None, "tp") and specs["blocks.0.attn.wo.bias"] == P("tp")
    assert specs["head.weight"] == P(None, "tp") and specs["blocks.1.attn.wo.weight"] == P()
    # A single style applies to the root module.
    assert specs_from_plan(nn.Linear(4, 6), colwise(), mesh1) == {"weight": P("tp"), "bias": P("tp")}


def test_specs_from_plan_on_a_params_pytree(mesh1):
    cfg = gpt.tiny()
    params = gpt.init_params(cfg)
    plan = {"blocks.*.attn.w[qkv]": colwise(), "blocks.*.attn.wo": rowwise(),
            "blocks.*.mlp.up": ColwiseParallel(), "blocks.*.mlp.down": RowwiseParallel()}
    assert specs_from_plan(params, plan, mesh1) == gpt.tp_specs(params)
    flat = {"emb": torch.zeros(8, 4), "fc.weight": torch.zeros(6, 4), "fc.bias": torch.zeros(6)}
    assert specs_from_plan(flat, {"emb": rowwise(embedding=True), "fc": rowwise()}, mesh1) == {
        "emb": P("tp"), "fc.weight": P(None, "tp"), "fc.bias": P()}
    assert specs_from_plan(flat, {"fc.weight": colwise()}, mesh1)["fc.bias"] == P()


def test_hooks_do_nothing_outside_pjit_and_are_replaced(mesh1):
    model = gm.GPT(CFG)
    ids, targets = gm.pattern_batch(CFG, 2)
    before = model(ids, targets)
    parallelize(model, gm.sp_plan(), mesh1)
    parallelize(model, gm.sp_plan(), mesh1)
    assert torch.equal(model(ids, targets), before)
    assert len(model.blocks[0].attn._forward_pre_hooks) == 1


def test_plan_errors(mesh1):
    model = gm.GPT(CFG)
    with pytest.raises(ValueError, match=r"plan key 'blocks.\*.attn.wz' .* matches no module path. Close module paths: .*attn.wo"):
        specs_from_plan(model, {"blocks.*.attn.wz": colwise()}, mesh1)
    with pytest.raises(TypeError, match=r"on module 'blocks.0.ln1' \(LayerNorm\).*nn.Linear and nn.Embedding"):
        specs_from_plan(model, {"blocks.0.ln1": ColwiseParallel()}, mesh1)
    # transformers' plan strings are styles ("colwise"), others are not (tests/test_hf_models.py)
    with pytest.raises(ValueError, match=r"plan\['head'\] is 'column', which is not a transformers plan string"):
        specs_from_plan(model, {"head": "column"}, mesh1)

    class MyStyle(ParallelStyle):
        def _apply(self, module, device_mesh):
            return module

    with pytest.raises(TypeError, match="expected a style"):
        specs_from_plan(model, {"head": MyStyle()}, mesh1)
    with pytest.raises(ValueError, match=r"axis='mp' is not an axis of Mesh"):
        specs_from_plan(model, {"head": colwise()}, mesh1, axis="mp")
    with pytest.raises(ValueError, match=r"output_layouts is P\('dp'\); a plan's layouts are over its axis 'tp' only"):
        parallelize(model, {"head": colwise(output_layouts=P("dp"))}, mesh1)
    with pytest.raises(ValueError, match="cannot be laid out as a pending sum"):
        parallelize(model, {"blocks.0": prepare_input(input_layouts=Shard(1),
                                                      desired_input_layouts=torch.distributed.tensor.Partial())}, mesh1)
    with pytest.raises(ValueError, match="need one entry each per positional input"):
        prepare_input(input_layouts=(Shard(1), None), desired_input_layouts=Replicate())
    with pytest.raises(ValueError, match=r"2-D weights .* in a params pytree"):
        specs_from_plan({"w": torch.zeros(2, 2, 2)}, {"w": colwise()}, mesh1)
    # Tied weights that two styles would lay out differently.
    tied = gm.GPT(CFG)
    tied.head.weight = tied.wte.weight
    with pytest.raises(ValueError, match=r"parameter 'head.weight' would be P\('tp'\) here, but plan key 'wte' made it \(tied: the same tensor as 'wte.weight'\) P\(None, 'tp'\)"):
        specs_from_plan(tied, {"wte": ColwiseParallel(), "head": ColwiseParallel()}, mesh1)
    with pytest.raises(ValueError, match=r"'head.weight' would be P\(None, 'tp'\) here, but plan key 'head' made it P\('tp'\).*Give the two keys"):
        specs_from_plan(model, {"head": colwise(), "he*": rowwise()}, mesh1)
    # Megatron's tied embedding: rowwise table and colwise head agree (vocab split).
    assert specs_from_plan(tied, {"wte": RowwiseParallel(), "head": ColwiseParallel()}, mesh1)["wte.weight"] == P("tp")


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.fc(x))


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.fc(x)


def test_modules_that_update_buffers_in_place_are_named(mesh1):
    x = torch.randn(8, 4)
    model = BNNet()
    specs = parallelize(model, {"fc": colwise()}, mesh1)
    params = dict(model.named_parameters())

    def loss(p, x):
        return torch.func.functional_call(model, p, (x,)).sum()

    grad = pjit(torch.func.grad(loss), in_specs=(specs, P()), mesh=mesh1)
    with pytest.raises(RuntimeError, match=r"cannot trace module 'bn' \(BatchNorm1d\): it updates its buffer\(s\) \['running_mean', 'running_var'\].*model.eval\(\)"):
        grad(params, x)
    model.eval()
    torch.testing.assert_close(gather(grad(params, x)), torch.func.grad(loss)(params, x))

    counting = nn.Sequential(OrderedDict(enc=Counting()))
    parallelize(counting, {}, mesh1)
    fwd = pjit(lambda p, x: torch.func.functional_call(counting, p, (x,)), in_specs=P(), mesh=mesh1)
    with pytest.raises(RuntimeError, match=r"module 'enc' \(Counting\): it updates its buffer\(s\) \['calls'\]|changes counting.enc.calls \(shape \(\), torch.float32\) in place"):
        fwd(dict(counting.named_parameters()), x)


def test_input_layout_count_mismatch_is_an_error(mesh1):
    model = MLPModule()
    specs = parallelize(model, {"net1": prepare_input(input_layouts=(Shard(0), None),
                                                      desired_input_layouts=(Replicate(), None))}, mesh1)
    f = pjit(lambda p, x: torch.func.functional_call(model, p, (x,)), in_specs=(specs, P()), mesh=mesh1)
    with pytest.raises(ValueError, match=r"on module 'net1': input_layouts has 2 entries but the module was called with 1"):
        f(dict(model.named_parameters()), torch.rand(4, 10))


def test_example_trains_a_module_with_a_plan_on_2x2_local_ranks():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, os.path.join(root, "examples", "gpt_module.py"), "--steps", "3"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert "sp plan on mesh {'dp': 2, 'tp': 2}" in res.stdout, res.stdout
    assert "'reduce_scatter': 10" in res.stdout, res.stdout
    assert "loss difference over 3 steps" in res.stdout, res.stdout


# -- composition with DataParallelMode --------------------------------------------------

def _plans_under_data_parallel():
    """The Megatron and sequence-parallel plans over "tp" with DataParallelMode over
    "dp" (DDP x TP and FSDP x TP in one program): 3 steps equal one device, and the
    mode lays the parameters out over "dp" on a dim that "tp" does not split."""
    from sharded.modes import DataParallelMode

    mesh = Mesh((2, 2), ("dp", "tp"))
    ids, targets = gm.pattern_batch(CFG, BATCH)
    out = {}
    for name in ("megatron", "sp"):
        for layout in ("replicate", "shard"):
            model = gm.GPT(CFG)
            specs = parallelize(model, gm.PLANS[name](), mesh, axis="tp")
            params = {k: v.detach() for k, v in model.named_parameters()}
            opt = optim.sgd_init(params)
            train_step = gm.make_train_step(model, _SGD)
            step = pjit(train_step, in_specs=(specs, specs, P("dp"), P("dp")), mesh=mesh,
                        mode=DataParallelMode(layout))
            d_params, d_opt, r_params, r_opt = params, opt, params, opt
            for _ in range(3):
                d_params, d_opt, d_loss = step(d_params, d_opt, ids, targets)
                r_params, r_opt, r_loss = train_step(r_params, r_opt, ids, targets)
                torch.testing.assert_close(gather(d_loss), r_loss, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(gather(d_params), r_params, rtol=1e-4, atol=1e-5)
            kinds = Counter((c.axis, c.kind) for c in step.lower(d_params, d_opt, ids, targets).collectives())
            out[name, layout] = ({k: spec_of(v) for k, v in d_params.items()}, specs, kinds)
    return out


def test_plans_compose_with_data_parallel_mode(on_ranks):
    res = on_ranks(4, _plans_under_data_parallel)[0]
    for (name, layout), (out_specs, tp_specs, kinds) in res.items():
        for k, spec in out_specs.items():
            tp_dims = [d for d, e in enumerate(tp_specs[k]) if e is not None]
            dp_dims = [d for d, e in enumerate(spec) if e is not None and "dp" in ((e,) if isinstance(e, str) else e)]
            assert [d for d, e in enumerate(spec) if e is not None and "tp" in ((e,) if isinstance(e, str) else e)] == tp_dims
            if layout == "replicate":
                assert dp_dims == [], (name, k, spec)
            else:    # a dim "tp" splits only where it splits every dim: P(("tp", "dp"))
                assert len(dp_dims) <= 1, (name, k, spec)
                assert all(spec[d] == ("tp", "dp") for d in set(dp_dims) & set(tp_dims)), (name, k, spec)
        if layout == "shard":
            n_sharded = sum("dp" in str(spec) for spec in out_specs.values())
            assert n_sharded >= len(out_specs) // 2, (name, out_specs)
            assert kinds[("dp", "all_gather")] >= 1 and kinds[("dp", "reduce_scatter")] >= 1, kinds
        else:
            assert kinds[("dp", "all_gather")] == 0 and kinds[("dp", "reduce_scatter")] == 0, kinds
        if name == "sp":
            assert kinds[("tp", "reduce_scatter")] > 0 and kinds[("tp", "all_gather")] > 0, kinds
