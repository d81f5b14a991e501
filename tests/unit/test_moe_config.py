"""Qwen3-MoE configuration, routing and the MoE decode roofline."""
import pytest
import torch

from oasiskv.bench.roofline import weight_bytes
from oasiskv.config import ModelConfig
from oasiskv.layers.moe import route
from oasiskv.models.decoder import CausalLM
from oasiskv.models.loader import resolve_model_path

MOE = dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=64, intermediate_size=128,
           num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           vocab_size=256, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    cfg = ModelConfig.from_hf_dict(dict(MOE, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert cfg.moe.sparse_layers == (1, 5)
    assert ModelConfig.from_hf_dict(MOE).moe.sparse_layers == tuple(range(6))
    # transformers-5 spells the expert count num_local_experts
    spelled = {k: v for k, v in MOE.items() if k != "num_experts"} | {"num_local_experts": 8}
    assert ModelConfig.from_hf_dict(spelled).moe.num_experts == 8


@pytest.mark.parametrize("bad,match", [(dict(num_experts_per_tok=9), "num_experts_per_tok"),
                                       (dict(hidden_act="gelu"), "hidden_act"),
                                       (dict(num_experts=None), "num_experts")])
def test_bad_moe_configs_are_refused(bad, match):
    cfg = {k: v for k, v in (MOE | bad).items() if v is not None}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(cfg)


def test_preset_qwen3_30b_a3b_has_30b_parameters():
    cfg = ModelConfig.from_file(resolve_model_path("qwen3-30b-a3b") / "config.json")
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size) == (128, 8, 768)
    assert 30.4e9 < cfg.num_parameters() < 30.6e9


def test_route_takes_top_k_of_the_softmax_and_renormalises():
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    probs = logits.softmax(-1)[0]
    weights, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[2, 3]]
    torch.testing.assert_close(weights[0], probs[[2, 3]])
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights[0], probs[[2, 3]] / probs[[2, 3]].sum())


def test_moe_roofline_counts_the_experts_a_step_is_expected_to_touch():
    cfg = ModelConfig.from_file(resolve_model_path("qwen3-moe-tiny") / "config.json")
    with torch.device("meta"):
        model = CausalLM(cfg, 64)
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    assert weight_bytes(model) == weight_bytes(model, None)
    # one token touches k of E experts in every layer; many touch (nearly) all
    assert weight_bytes(model) - weight_bytes(model, 1) == round(experts * (1 - 2 / 8))
    assert weight_bytes(model, 10_000) == weight_bytes(model)
