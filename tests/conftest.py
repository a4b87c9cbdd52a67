"""Shared fixtures: offline HF settings, tiny random checkpoints of every family (saved by transformers itself,
loaded by our loader), and the `gpu` marker that skips without CUDA."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch


GPU_TEST_TIMEOUT_S = 3600  # pytest-timeout's default (pyproject.toml) is 300 s


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # GPU tests may JIT-build the CUDA extension (test_prebuilt_gpu gives its build an hour); the device run's
        # own time limit bounds them there
        for item in items:
            if "gpu" in item.keywords and item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(GPU_TEST_TIMEOUT_S))
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def tiny_hf_config(family: str):
    import transformers as tf

    if family == "llama":
        return tf.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                              tie_word_embeddings=False)
    if family == "llama3":  # llama3 rope scaling, tied embeddings
        return tf.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                              tie_word_embeddings=True,
                              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 64})
    if family == "qwen3":
        return tf.Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                              max_position_embeddings=512)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                                 num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0],
                                 norm_topk_prob=True, max_position_embeddings=512)
    if family in ("deepseek_v3", "deepseek_v3_fp8"):
        shared = dict(vocab_size=1000, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1,
                      routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=512,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                       "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
                                       "mscale": 1.0, "mscale_all_dim": 1.0})
        if family == "deepseek_v3":
            return tf.DeepseekV3Config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, q_lora_rank=32,
                                       kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                                       n_shared_experts=1, **shared)
        # the FP8 GEMMs' shapes: every FP8 linear's in % 512 and out % 128 are 0
        return tf.DeepseekV3Config(hidden_size=512, intermediate_size=512, moe_intermediate_size=128,
                                   q_lora_rank=512, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                                   v_head_dim=128, n_shared_experts=4, **shared)
    raise KeyError(family)


def make_tiny_checkpoint(family: str, folder: str, seed: int = 0):
    """Saves a random tiny HF model of `family` into `folder`; returns the HF model (fp32, eval)."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(tiny_hf_config(family), attn_implementation="eager")
    with torch.no_grad():  # random init leaves some tensors at 0/1; perturb so every weight matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    model.eval().save_pretrained(folder)
    return model


FAMILIES = ["llama", "llama3", "qwen3", "qwen3_moe", "deepseek_v3"]


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """family -> (folder, HF model); built lazily, once per session."""
    cache = {}

    def get(family: str):
        if family not in cache:
            folder = str(tmp_path_factory.mktemp(f"tiny-{family}"))
            cache[family] = (folder, make_tiny_checkpoint(family, folder))
        return cache[family]

    return get
