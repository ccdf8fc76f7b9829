"""Hugging Face transformers models under pjit: a train step of LlamaForCausalLM,
Qwen2ForCausalLM and GPT2LMHeadModel (tiny random configs, SDPA) through
torch.func.functional_call with ``labels=``, one SGD update, equals one device in
every mode: DataParallelMode "replicate" and "shard", tensor parallel with the
model's own plan (``config.base_model_tp_plan``, transformers' plan strings) and
FSDP x TP on a 2x2 mesh, with the default ``use_cache`` (a DynamicCache whose first
append is a cat onto a legacy empty tensor) and with ``use_cache=False`` (what
training code passes: transformers' masking code asks whether it is traced).

GPT-2 has no plan (its config's base_model_tp_plan is None) and its Conv1D layers
are refused by the plans: both are clear errors, tested here.
"""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from sharded import Mesh, P, gather  # noqa: E402
from sharded import plans  # noqa: E402
from sharded.modes import DataParallelMode  # noqa: E402
from sharded.plans import parallelize  # noqa: E402
from transforms import pjit  # noqa: E402

VOCAB, SEQ, BATCH, LR = 96, 8, 4, 0.1
CACHES = {"default": {}, "use_cache=False": {"use_cache": False}}


def _config(name: str):
    # 2 layers for Llama (the cache across layers), 1 for the others: the tests' time
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2 * SEQ)
    if name == "llama":
        return transformers.LlamaConfig(num_hidden_layers=2, **common)
    if name == "qwen2":
        return transformers.Qwen2Config(num_hidden_layers=1, **common)
    if name == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=32,
                                       n_layer=1, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    raise ValueError(name)


_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gpt2": "GPT2LMHeadModel"}


def _model(name: str):
    """The same random weights on every call (and every rank)."""
    cfg = _config(name)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, _CLASSES[name])(cfg).train()


def _params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _ids():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _step(model, kwargs, params, ids):
    def loss_of(p):
        return torch.func.functional_call(model, p, (ids,), {"labels": ids, **kwargs}).loss

    grads, loss = torch.func.grad_and_value(loss_of)(params)
    return {k: v - LR * grads[k] for k, v in params.items()}, loss


def _tp_specs(model, mesh) -> dict:
    """The base model's own plan, as written in the model's config; every other
    parameter (the LM head) replicated."""
    base = model.base_model_prefix
    specs = parallelize(getattr(model, base), model.config.base_model_tp_plan, mesh, axis="tp")
    specs = {f"{base}.{k}": v for k, v in specs.items()}
    return {k: specs.get(k, P()) for k, _ in model.named_parameters()}


# -- rank-side bodies ------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _reference(name: str, cache: str):
    """The single-device step (eager, no pjit): new parameters and loss."""
    model = _model(name)
    return _step(model, CACHES[cache], _params(model), _ids())


def _check(name, cache, mesh, setup) -> str | None:
    """One pjit step of model ``name`` against one device; None, or what went wrong."""
    try:
        ref_params, ref_loss = _reference(name, cache)
        model = _model(name)
        in_specs, mode = setup(model, mesh)
        step = pjit(functools.partial(_step, model, CACHES[cache]), in_specs=in_specs, mesh=mesh,
                    mode=mode)
        params, loss = step(_params(model), _ids())
        torch.testing.assert_close(gather(loss), ref_loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gather(params), ref_params, rtol=1e-4, atol=1e-6)
        return None
    except Exception as e:  # noqa: BLE001 - reported per case
        return f"{type(e).__name__}: {str(e)[:2000]}"


def _data_parallel(layout):
    return lambda model, mesh: ((P(), P("dp")), DataParallelMode(layout))


def _tensor_parallel(model, mesh):
    return (_tp_specs(model, mesh), P()), None


def _fsdp_tp(model, mesh):
    return (_tp_specs(model, mesh), P("dp")), DataParallelMode("shard")


def _train_1d():
    """Data parallel (both layouts) on ("dp",) and the model's plan on ("tp",)."""
    dp, tp = Mesh((2,), ("dp",)), Mesh((2,), ("tp",))
    out = {}
    for name in ("llama", "qwen2", "gpt2"):
        for cache in CACHES:
            out[name, cache, "replicate"] = _check(name, cache, dp, _data_parallel("replicate"))
            out[name, cache, "shard"] = _check(name, cache, dp, _data_parallel("shard"))
            if name != "gpt2":
                out[name, cache, "tp"] = _check(name, cache, tp, _tensor_parallel)
    return out


def _train_2x2():
    """FSDP ("shard" over "dp") x the model's plan over "tp"."""
    mesh = Mesh((2, 2), ("dp", "tp"))
    return {(name, cache, "fsdp x tp"): _check(name, cache, mesh, _fsdp_tp)
            for name in ("llama", "qwen2") for cache in CACHES}


def _failures(results: dict) -> dict:
    return {k: v for k, v in results.items() if v is not None}


def test_train_step_equals_one_device_data_and_tensor_parallel(on_ranks):
    results = on_ranks(2, _train_1d)[0]
    assert len(results) == 3 * 2 * 2 + 2 * 2
    assert _failures(results) == {}


def test_train_step_equals_one_device_fsdp_x_tp(on_ranks):
    results = on_ranks(4, _train_2x2)[0]
    assert len(results) == 4
    assert _failures(results) == {}


# -- plans from the model's config, in one process ----------------------------------------------

@pytest.fixture(scope="module")
def tp2():
    return Mesh.abstract((2,), ("tp",))


def test_the_models_plan_gives_megatron_specs(tp2):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = _model("llama")
    specs = parallelize(model.model, model.config.base_model_tp_plan, tp2)
    torch_plan = {k: ColwiseParallel() if v == "colwise" else RowwiseParallel()
                  for k, v in model.config.base_model_tp_plan.items()}
    assert specs == plans.specs_from_plan(model.model, torch_plan, tp2)
    assert specs["layers.1.self_attn.q_proj.weight"] == P("tp")
    assert specs["layers.1.self_attn.o_proj.weight"] == P(None, "tp")
    assert specs["layers.0.mlp.down_proj.weight"] == P(None, "tp")
    assert specs["norm.weight"] == P() and specs["embed_tokens.weight"] == P()
    # the whole model's plan, as transformers writes it for the LM (the head gathered, the
    # embedding split over the vocabulary)
    plan = {f"model.{k}": v for k, v in model.config.base_model_tp_plan.items()}
    plan.update({"model.embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output"})
    full = parallelize(model, plan, tp2)
    assert full["lm_head.weight"] == P("tp") and full["model.embed_tokens.weight"] == P("tp")
    assert full["model.layers.0.mlp.up_proj.weight"] == P("tp")


def test_qwen2_plan_splits_the_projection_biases(tp2):
    model = _model("qwen2")
    specs = parallelize(model.model, model.config.base_model_tp_plan, tp2)
    assert specs["layers.0.self_attn.k_proj.bias"] == P("tp")
    assert specs["layers.0.self_attn.o_proj.weight"] == P(None, "tp")


def test_every_plan_string_of_transformers_is_mapped_or_refused():
    from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES

    assert set(ALL_PARALLEL_STYLES.keys()) <= set(plans._HF_PLAN_STRINGS)
    # and the names of earlier releases (local_*, gather, isolated, ep_router)
    assert {"local_colwise", "local_rowwise", "local_packed_rowwise", "local", "gather",
            "isolated", "ep_router"} <= set(plans._HF_PLAN_STRINGS)


def test_plan_strings_map_to_styles(tp2):
    model = _model("llama")
    specs = parallelize(model, {
        "model.embed_tokens": "embedding_colwise", "lm_head": "colwise_rep",
        "model.layers.0.mlp.up_proj": "local_colwise", "model.layers.0.mlp.down_proj": "rowwise_rep",
        "model.layers.1.mlp.down_proj": "rowwise_split_input",
        "model.layers.*.input_layernorm.weight": "sequence_parallel",   # a parameter's path
        "model.layers.*.self_attn": "replicate", "model.layers.*.mlp": "all_reduce",
        "model.norm": "replicated_with_grad_allreduce",
    }, tp2)
    assert specs["model.embed_tokens.weight"] == P(None, "tp")
    assert specs["lm_head.weight"] == P("tp")
    assert specs["model.layers.0.mlp.up_proj.weight"] == P("tp")
    assert specs["model.layers.1.mlp.down_proj.weight"] == P(None, "tp")
    assert specs["model.layers.0.input_layernorm.weight"] == P()
    assert specs["model.norm.weight"] == P() and specs["model.layers.0.self_attn.q_proj.weight"] == P()


@pytest.mark.parametrize("value, fragment", [
    ("packed_colwise", r"'packed_colwise' on module 'layers.0.mlp.gate_proj' \(Linear\) is refused: "
                       r"transformers' 'packed_colwise' style splits a fused weight .* unfuse"),
    ("moe_tp_experts", r"'moe_tp_experts' on module 'layers.0.mlp.gate_proj' .* no expert-parallel "
                       r"style; leave the experts out of the plan"),
    ("local_params", r"'local_params' on module 'layers.0.mlp.gate_proj' .* give its parameters specs by hand"),
])
def test_refused_plan_strings_name_the_string_the_module_and_the_fix(tp2, value, fragment):
    model = _model("llama")
    with pytest.raises(ValueError, match=r"parallelize: plan\['layers.\*.mlp.gate_proj'\] = " + fragment):
        parallelize(model.model, {"layers.*.mlp.gate_proj": value}, tp2)


def test_unknown_plan_strings_are_errors(tp2):
    model = _model("llama")
    with pytest.raises(ValueError, match=r"plan\['layers.\*.mlp.up_proj'\] is 'colwsie', which is not "
                                         r"a transformers plan string .*close: \['colwise'"):
        parallelize(model.model, {"layers.*.mlp.up_proj": "colwsie"}, tp2)


def test_gpt2_has_no_plan_and_its_conv1d_is_refused(tp2):
    model = _model("gpt2")
    assert model.config.base_model_tp_plan is None
    with pytest.raises(TypeError, match=r"parallelize: plan is None. A transformers config without "
                                        r"a tensor-parallel plan"):
        parallelize(model.transformer, model.config.base_model_tp_plan, tp2)
    with pytest.raises(TypeError, match=r"plan\['h.\*.mlp.c_fc'\] = colwise\(\) on module 'h.0.mlp.c_fc' "
                                        r"\(Conv1D\): colwise applies to nn.Linear .* Conv1D .*"
                                        r"weight P\(None, axis\), bias P\(axis\)"):
        parallelize(model.transformer, {"h.*.mlp.c_fc": "colwise"}, tp2)
