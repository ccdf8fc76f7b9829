"""sharded.remat (activation checkpointing): the backward recomputes what the policy
does not save. Gradients equal the program without remat (bitwise on one device, to
float noise on gloo ranks in every mode), the recomputed nodes are in the program,
``Lowered.memory()`` shows the drop, random draws are the same draws, and
torch.utils.checkpoint calls inside a user's module become the same recomputation."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import sharded
from sharded import Mesh, P, checkpoint_name, gather, pjit, remat, remat_policies, shard_map
from sharded._remat import BARRIER_OP
from sharded.modes import DataParallelMode, DTensorExpandMode

# a batch large enough that activations, not the gradient bucket, make the peak:
# at batch 4 the SGD step's one bucket of every gradient (its concatenation beside
# the gradients, NOTE [Bucketing]) was the peak of every program, remat or not
V, T, D, L, B = 16, 8, 16, 3, 8
NO_REMAT = "no remat"
aten = torch.ops.aten


def init(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    shapes = {"emb": (V, D)}
    for i in range(L):
        shapes.update({f"{i}.ln": (D,), f"{i}.q": (D, D), f"{i}.k": (D, D), f"{i}.v": (D, D),
                       f"{i}.o": (D, D), f"{i}.w1": (2 * D, D), f"{i}.w2": (D, 2 * D)})
    p = {k: torch.randn(*s, generator=g) * 0.3 for k, s in shapes.items()}
    for i in range(L):
        p[f"{i}.ln"] = p[f"{i}.ln"] + 1.0
    return p


# Megatron over "tp"
TP = {"emb": P()}
for _i in range(L):
    TP.update({f"{_i}.ln": P(), f"{_i}.q": P("tp"), f"{_i}.k": P("tp"), f"{_i}.v": P("tp"),
               f"{_i}.o": P(None, "tp"), f"{_i}.w1": P("tp"), f"{_i}.w2": P(None, "tp")})


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    return ids, torch.roll(ids, -1, 1)


def block(p, i, x, dropout):
    """A pre-norm transformer block: single-head causal attention, a GELU MLP whose
    hidden activation is named "mlp_hidden"."""
    h = F.layer_norm(x, (D,), p[f"{i}.ln"])
    q, k, v = F.linear(h, p[f"{i}.q"]), F.linear(h, p[f"{i}.k"]), F.linear(h, p[f"{i}.v"])
    s = (q @ k.transpose(-1, -2)) / D ** 0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    x = x + F.dropout(F.linear(torch.softmax(s, -1) @ v, p[f"{i}.o"]), dropout)
    hidden = checkpoint_name(F.gelu(F.linear(F.layer_norm(x, (D,)), p[f"{i}.w1"])), "mlp_hidden")
    return x + F.linear(hidden, p[f"{i}.w2"])


def make_step(policy=NO_REMAT, dropout: float = 0.0):
    """A train step (loss, grad, SGD) with every block under ``remat(policy)``, or none."""
    def loss_fn(p, ids, targets):
        x = F.embedding(ids, p["emb"])
        for i in range(L):
            blk = functools.partial(block, p, i, dropout=dropout)
            x = (blk if policy == NO_REMAT else remat(blk, policy))(x)
        return F.cross_entropy((x @ p["emb"].T).reshape(-1, V), targets.reshape(-1))

    def step(p, ids, targets):
        grads, loss = torch.func.grad_and_value(loss_fn)(p, ids, targets)
        return {k: p[k] - 0.1 * grads[k] for k in p}, loss

    return step


def ops(graph) -> Counter:
    return Counter(n.target for n in graph.graph.nodes if n.op == "call_function")


def local(tree):
    return {k: v.to_local() for k, v in tree.items()}


POLICIES = {
    "nothing_saveable": None,
    "dots_saveable": remat_policies.dots_saveable,
    "save_only_these_names": remat_policies.save_only_these_names("mlp_hidden"),
}


# -- one device: bitwise ---------------------------------------------------------------------

def _one_device(policy, dropout=0.1, mode=None):
    mesh = Mesh((1,), ("dp",))
    sharded.random.manual_seed(0)
    f = pjit(make_step(policy, dropout), in_specs=(P(), P(), P()), mesh=mesh,
             mode=mode or DTensorExpandMode(compile=False))
    args = (init(), *batch())
    lowered = f.lower(*args)
    params, loss = f(*args)
    return lowered, local(params), loss.to_local()


@functools.lru_cache(maxsize=None)
def _plain():
    return _one_device(NO_REMAT)


@pytest.mark.parametrize("name", list(POLICIES))
def test_gradients_bitwise_equal_without_remat(name):
    plain_low, plain_params, plain_loss = _plain()
    low, params, loss = _one_device(POLICIES[name])
    assert torch.equal(loss, plain_loss)
    for k in plain_params:
        assert torch.equal(params[k], plain_params[k]), k
    # the recomputation is in the lowered program: barriers, and more ops than without
    assert ops(low.global_graph)[BARRIER_OP] >= L
    assert sum(ops(low.local_graph).values()) > sum(ops(plain_low.local_graph).values())


def test_memory_drops():
    plain = _plain()[0].memory()["peak_bytes"]
    full = _one_device(None)[0].memory()["peak_bytes"]
    names = _one_device(POLICIES["save_only_these_names"])[0].memory()["peak_bytes"]
    assert full < 0.85 * plain, (full, plain)
    assert full <= names < plain, (full, names, plain)


def test_policies_recompute_what_they_do_not_save():
    plain = ops(_plain()[0].global_graph)
    full = ops(_one_device(None)[0].global_graph)
    dots = ops(_one_device(POLICIES["dots_saveable"])[0].global_graph)
    names = ops(_one_device(POLICIES["save_only_these_names"])[0].global_graph)
    gelu = aten.gelu.default
    # nothing saved: every block's forward runs again (matmuls, the GELU, the softmax)
    mm = sum(full[op] for op in (aten.mm.default, aten.bmm.default, aten.addmm.default))
    mm_plain = sum(plain[op] for op in (aten.mm.default, aten.bmm.default, aten.addmm.default))
    assert mm > mm_plain and full[gelu] == plain[gelu] + L
    # matmuls saved: no matmul runs again, the pointwise ops between them do
    mm_dots = sum(dots[op] for op in (aten.mm.default, aten.bmm.default, aten.addmm.default))
    assert mm_dots == mm_plain and dots[aten._softmax.default] > plain[aten._softmax.default]
    # "mlp_hidden" saved: the GELU that makes it does not run again, the rest does
    assert names[gelu] == plain[gelu] and sum(names[op] for op in (
        aten.mm.default, aten.bmm.default, aten.addmm.default)) > mm_plain


def test_recomputed_dropout_draws_the_same_bits():
    plain_low = _plain()[0]
    low = _one_device(None)[0]
    rng = torch.ops.sharded.rng.default

    def draws(g):
        return [n.args[2] for n in g.graph.nodes if n.target is rng]
    # the dropout masks are drawn again in the backward, as the same draws (their
    # draw numbers), and the gradients are bitwise those without remat (above)
    assert len(draws(low.global_graph)) == 2 * len(draws(plain_low.global_graph))
    assert sorted(set(draws(low.global_graph))) == sorted(set(draws(plain_low.global_graph)))


def test_policy_naming_no_value_is_an_error():
    with pytest.raises(ValueError, match=r"save_only_these_names.*\['x'\].*checkpoint_name\(x, 'x'\)"):
        _one_device(remat_policies.save_only_these_names("x"))


def test_bad_arguments_are_errors():
    with pytest.raises(TypeError, match="remat_policies"):
        remat(lambda x: x, policy="dots")
    with pytest.raises(TypeError, match="save_only_these_names"):
        remat_policies.save_only_these_names()
    with pytest.raises(TypeError, match="checkpoint_name"):
        checkpoint_name(torch.ones(2), "")


def test_outside_pjit_it_is_the_function():
    x = torch.randn(3, requires_grad=True)
    f = remat(lambda x: (checkpoint_name(x.sin(), "s") * 2).sum())
    assert torch.equal(f(x), (x.sin() * 2).sum())


def test_under_vmap_and_nested():
    """remat inside torch.func.vmap (per-example gradients) and a remat region inside
    another (the outer one decides): the values of the program without remat."""
    g = torch.Generator().manual_seed(0)
    w, xs = torch.randn(D, D, generator=g), torch.randn(4, 3, D, generator=g)

    def blk(w, x):
        return torch.tanh(checkpoint_name(x @ w, "a")).sum()

    def per_example(b):
        return lambda w, xs: torch.func.vmap(lambda x: torch.func.grad(b)(w, x))(xs)

    mesh = Mesh((1,), ("dp",))
    ref = per_example(blk)(w, xs)
    for b in (remat(blk), remat(lambda w, x: remat(blk)(w, x) * 2)):
        f = pjit(per_example(b), in_specs=(P(), P()), out_specs=P(), mesh=mesh)
        want = ref if b.__name__ == "blk" else 2 * ref
        assert torch.equal(f(w, xs).to_local(), want)
        assert ops(f.lower(w, xs).global_graph)[BARRIER_OP] >= 1


def test_compiled_runner_keeps_the_recomputation():
    """Inductor gets the program with its copies (CSE and scheduling keep them: NOTE
    [Recomputed values stay recomputed]): the compiled code runs the barriers and more
    matmuls than the program without remat, with the same results to float noise."""
    plain_low, plain_params, _ = _plain()
    low, params, _ = _one_device(None, mode=DTensorExpandMode(compile=True))
    assert low.runner() == "inductor"
    for k in plain_params:
        torch.testing.assert_close(params[k], plain_params[k], rtol=1e-5, atol=1e-6)
    sharded.random.manual_seed(0)
    f = pjit(make_step(None, 0.1), in_specs=(P(), P(), P()), mesh=Mesh((1,), ("dp",)),
             mode=DTensorExpandMode(compile=True))
    args = (init(), *batch())
    f(*args)
    with torch.profiler.profile() as prof:
        f(*args)
    calls = Counter(e.name for e in prof.events())
    mm_plain = sum(n for op, n in ops(plain_low.local_graph).items()
                   if op in (aten.mm.default, aten.bmm.default, aten.addmm.default))
    assert calls["sharded::remat_barrier"] >= L
    assert calls["aten::mm"] + calls["aten::bmm"] + calls["aten::addmm"] > mm_plain


# -- the joint program (pjit called under autograd) and shard_map bodies ------------------

def _joint(use_remat):
    def f(ws, x):
        h = x
        for w in ws:
            blk = (lambda w, h: torch.sin(F.dropout(torch.tanh(h @ w), 0.2) @ w.t()) + h)
            h = (remat(blk) if use_remat else blk)(w, h)
        return (h ** 2).sum()

    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(D, D, generator=g) * 0.3).requires_grad_() for _ in range(3)]
    x = torch.randn(8, D, generator=g)
    sharded.random.manual_seed(0)
    pf = pjit(f, in_specs=(P(), P()), out_specs=P(), mesh=Mesh((1,), ("dp",)))
    low = pf.lower(ws, x)
    pf(ws, x).backward()
    return low, [w.grad for w in ws]


def test_joint_program_recomputes_in_its_backward():
    plain, g_plain = _joint(False)
    low, grads = _joint(True)
    for a, b in zip(grads, g_plain):
        assert torch.equal(a, b)
    assert ops(low.backward.global_graph)[BARRIER_OP] >= 3
    residuals = len(low.local_graph.graph.find_nodes(op="output")[0].args[0])
    plain_residuals = len(plain.local_graph.graph.find_nodes(op="output")[0].args[0])
    assert residuals < plain_residuals
    assert low.memory()["peak_bytes"] < plain.memory()["peak_bytes"]


def _joint_3d(use_remat):
    """The joint program with 3-D activations: F.linear reshapes, and the joint program
    copies the forward's views to the start of its backward."""
    def f(ws, x):
        h = x
        for w in ws:
            blk = (lambda w, h: torch.tanh(F.linear(torch.tanh(F.linear(h, w)), w)) + h)
            h = (remat(blk) if use_remat else blk)(w, h)
        return (h ** 2).sum()

    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(D, D, generator=g) * 0.1).requires_grad_() for _ in range(4)]
    x = torch.randn(8, 16, D, generator=g)
    pf = pjit(f, in_specs=(P(), P()), out_specs=P(), mesh=Mesh((1,), ("dp",)))
    low = pf.lower(ws, x)
    pf(ws, x).backward()
    return low, [w.grad for w in ws]


def test_joint_program_recomputes_each_region_where_its_backward_needs_it():
    """NOTE [A view waits for its reader]: each region is recomputed just before its own
    backward, not all at the backward's start (where the views of 3-D activations
    once pulled them: the backward's peak rose above the program without remat)."""
    plain, g_plain = _joint_3d(False)
    low, grads = _joint_3d(True)
    for a, b in zip(grads, g_plain):
        assert torch.equal(a, b)
    assert low.memory()["peak_bytes"] < plain.memory()["peak_bytes"]
    assert low.backward.memory()["peak_bytes"] < plain.backward.memory()["peak_bytes"]
    nodes = list(low.backward.global_graph.graph.nodes)
    barriers = [i for i, n in enumerate(nodes) if n.target is BARRIER_OP]
    first_backward = min(i for i, n in enumerate(nodes) if n.target is torch.ops.aten.tanh_backward.default)
    assert sum(i < first_backward for i in barriers) == 1       # one region's, not all four


def _shard_map_step(use_remat):
    mesh = Mesh((1,), ("dp",))

    def blk(w, h):
        return torch.sin(torch.tanh(h @ w) @ w.t()) + h

    b = remat(blk) if use_remat else blk
    body = shard_map(lambda w, h: b(w, b(w, h)), mesh=mesh, in_specs=(P(), P("dp")),
                     out_specs=P("dp"))
    f = pjit(lambda w, x: torch.func.grad(lambda w, x: (body(w, x) ** 2).sum())(w, x),
             in_specs=(P(), P("dp")), out_specs=P(), mesh=mesh)
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(D, D, generator=g) * 0.3, torch.randn(64, D, generator=g)
    return f.lower(w, x), f(w, x).to_local()


def test_inside_a_shard_map_body():
    plain, g_plain = _shard_map_step(False)
    low, grads = _shard_map_step(True)
    assert torch.equal(grads, g_plain)
    assert ops(low.local_graph)[BARRIER_OP] >= 2
    assert low.memory()["peak_bytes"] < plain.memory()["peak_bytes"]


# -- torch.utils.checkpoint inside a user's module ------------------------------------------

class _Blocks(torch.nn.Module):
    def __init__(self, use_checkpoint, use_reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.LayerNorm(D), torch.nn.Linear(D, 2 * D), torch.nn.GELU(),
            torch.nn.Linear(2 * D, D)) for _ in range(3))
        self.use_checkpoint, self.use_reentrant = use_checkpoint, use_reentrant

    def forward(self, x):
        for layer in self.layers:
            if self.use_checkpoint:
                x = x + torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=self.use_reentrant)
            else:
                x = x + layer(x)
        return x


def _module_step(model):
    x = torch.randn(128, D, generator=torch.Generator().manual_seed(1))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def step(p, x):
        return torch.func.grad(lambda p: (torch.func.functional_call(model, p, (x,)) ** 2).sum())(p)

    f = pjit(step, in_specs=(P(), P()), out_specs=P(), mesh=Mesh((1,), ("dp",)))
    return f.lower(params, x), local(f(params, x)), functools.partial(step, params, x)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_torch_checkpoint_becomes_recomputation(use_reentrant):
    plain_low, plain, _ = _module_step(_Blocks(False, False))
    low, grads, eager = _module_step(_Blocks(True, use_reentrant))
    # torch's checkpoint does not run under torch.func.grad at all (what pjit traces)
    with pytest.raises(RuntimeError, match="saved tensor hooks|setup_context"):
        eager()
    for k in plain:
        assert torch.equal(grads[k], plain[k]), k
    assert ops(low.global_graph)[BARRIER_OP] >= 3      # recomputed, not inlined saves
    assert low.memory()["peak_bytes"] < plain_low.memory()["peak_bytes"]


def test_torch_selective_checkpoint_is_a_clear_error():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE

    model = _Blocks(True, False)
    model.forward = lambda x: torch.utils.checkpoint.checkpoint(   # type: ignore[method-assign]
        model.layers[0], x, use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
    with pytest.raises(NotImplementedError, match="sharded.remat"):
        _module_step(model)


def test_hugging_face_gradient_checkpointing():
    transformers = pytest.importorskip("transformers")

    def model(checkpointing):
        cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=16, num_hidden_layers=2)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        m = transformers.LlamaForCausalLM(cfg).train()
        if checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            # its forward hook calls requires_grad_ on the embeddings' output, which
            # torch.func.grad refuses; the gradients reach the embeddings without it
            m.disable_input_require_grads()
        return m

    ids = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(1))
    out = {}
    for checkpointing in (False, True):
        m = model(checkpointing)
        p = {k: v.detach().clone() for k, v in m.named_parameters()}

        def step(p, ids, m=m):
            return torch.func.grad(lambda p: torch.func.functional_call(
                m, p, (ids,), {"labels": ids, "use_cache": False}).loss)(p)

        f = pjit(step, in_specs=(P(), P()), out_specs=P(), mesh=Mesh((1,), ("dp",)))
        out[checkpointing] = (f.lower(p, ids), local(f(p, ids)))
    (plain_low, plain), (low, grads) = out[False], out[True]
    for k in plain:
        assert torch.equal(grads[k], plain[k]), k
    assert ops(low.global_graph)[BARRIER_OP] >= 2      # one region per decoder layer
    assert low.memory()["peak_bytes"] < plain_low.memory()["peak_bytes"]


# -- gloo ranks: every mode, to float noise ------------------------------------------------

def _ranks(mesh_shape, names, in_specs, mode, dropout=0.1):
    """On every rank, with dropout: the remat steps (nothing saved, matmuls saved) equal
    the step without remat on the same mesh (the same draws); returns this rank's
    program's peak memory and barrier count per policy."""
    mesh = Mesh(mesh_shape, names)
    args = (init(), *batch())
    ref_params = ref_loss = None
    peaks = {}
    for policy in (NO_REMAT, None, remat_policies.dots_saveable):
        sharded.random.manual_seed(0)
        f = pjit(make_step(policy, dropout), in_specs=in_specs, mesh=mesh, mode=mode)
        params, loss = f(*args)
        if policy == NO_REMAT:
            ref_params, ref_loss = gather(params), gather(loss)
        else:
            torch.testing.assert_close(gather(loss), ref_loss, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(gather(params), ref_params, rtol=1e-5, atol=1e-6)
        low = f.lower(*args)
        peaks[str(policy)] = (low.memory()["peak_bytes"], ops(low.local_graph)[BARRIER_OP])
    return peaks


def _ranks_against_one_device(mesh_shape, names, in_specs, mode):
    """As ``_ranks``, with the single-device step (eager, no pjit) as the reference."""
    args = (init(), *batch())
    ref_params, ref_loss = make_step(NO_REMAT, 0.0)(*args)
    mesh = Mesh(mesh_shape, names)
    f = pjit(make_step(None, 0.0), in_specs=in_specs, mesh=mesh, mode=mode)
    params, loss = f(*args)
    torch.testing.assert_close(gather(loss), ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gather(params), ref_params, rtol=1e-4, atol=1e-6)
    return True


MODES = {
    "expand": lambda: DTensorExpandMode(compile=False),
    "replicate": lambda: DataParallelMode("replicate", compile=False),
    "shard": lambda: DataParallelMode("shard", compile=False),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_on_ranks_every_mode(on_ranks, mode):
    specs = (P(), P("dp"), P("dp"))
    assert all(on_ranks(2, _ranks_against_one_device, (2,), ("dp",), specs, MODES[mode]()))
    for peaks in on_ranks(2, _ranks, (2,), ("dp",), specs, MODES[mode]()):
        plain, _ = peaks[NO_REMAT]
        full, barriers = peaks["None"]
        assert barriers >= L and full < plain, peaks


def test_on_ranks_dp_x_tp(on_ranks):
    specs = (TP, P("dp"), P("dp"))
    assert all(on_ranks(4, _ranks_against_one_device, (2, 2), ("dp", "tp"), specs,
                        DTensorExpandMode(compile=False)))
    for peaks in on_ranks(4, _ranks, (2, 2), ("dp", "tp"), specs, DTensorExpandMode(compile=False)):
        assert peaks["None"][0] < peaks[NO_REMAT][0], peaks


def test_torch_checkpoint_outside_a_trace_stays_torchs():
    """The redirect of torch.utils.checkpoint is process-wide while pjit traces; a call
    that is not inside the trace (another thread's) runs torch's own checkpoint."""
    from sharded import _torch
    from sharded._remat import torch_checkpoint

    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 4, generator=g, requires_grad=True)
    x = torch.randn(2, 4, generator=g)
    runs = []

    def block(a):
        runs.append(1)
        return torch.tanh(a @ w)

    with _torch.torch_checkpoint_as(torch_checkpoint):
        y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        (gw,) = torch.autograd.grad(y.sum(), w)
    (ref,) = torch.autograd.grad(torch.tanh(x @ w).sum(), w)
    assert torch.equal(gw, ref)
    assert len(runs) == 2          # torch's checkpoint: the forward, then its recomputation


def _shard_map_psum_on_ranks():
    """A remat region inside a shard_map body whose block has a psum over "dp": the
    recomputation issues the collective again, on every rank alike."""
    from sharded import gather, shard_map
    from sharded.collectives import psum

    mesh = Mesh((2,), ("dp",))
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(D, D, generator=g) * 0.3, torch.randn(8, D, generator=g)

    def blk(w, h):
        a = torch.tanh(h @ w)
        return torch.sin(a * psum(a.sum(0, keepdim=True), "dp")) + h

    grads = []
    for use in (False, True):
        b = remat(blk) if use else blk
        body = shard_map(lambda w, h: b(w, b(w, h)), mesh=mesh, in_specs=(P(), P("dp")),
                         out_specs=P("dp"))
        f = pjit(lambda w, x: torch.func.grad(lambda w, x: (body(w, x) ** 2).sum())(w, x),
                 in_specs=(P(), P("dp")), out_specs=P(), mesh=mesh)
        grads.append(gather(f(w, x)))
        barriers = ops(f.lower(w, x).local_graph)[BARRIER_OP]
        assert (barriers >= 2) if use else (barriers == 0), barriers
    return torch.equal(grads[0], grads[1])


def test_shard_map_body_with_a_collective_on_ranks(on_ranks):
    assert all(on_ranks(2, _shard_map_psum_on_ranks))
