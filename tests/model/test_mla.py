"""DeepSeek-V3 / Kimi-K2 specifics: absorbed MLA over the latent cache equals the expanded (per-head K/V)
computation, config variants against HF transformers 5.17 (no q_lora, rope_interleave off, attention bias, other
routing shapes), the kimi_k2 model_type with hub-style config keys and MTP tensors, the packed expert layout, fp32
router parameters, config validation, and the group-limited router on hand-computed cases."""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from engine.model.deepseek_v3 import DeepseekV3ForCausalLM, group_limited_topk
from engine.model.errors import ConfigError
from engine.model.loader import build_model, load_model
from ext.metadata import build_metadata
from tests.conftest import tiny_hf_config
from tests.model.test_parity import NUM_DECODE, NUM_PROMPT, assert_close, run_incremental


def tiny_cfg(**overrides) -> dict:
    cfg = tiny_hf_config("deepseek_v3").to_dict()
    cfg.update(overrides)
    return cfg


def random_model(seed: int = 0, **overrides) -> DeepseekV3ForCausalLM:
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(tiny_cfg(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def drive(model, token_lists, schedules, block_size, tree_step=None):
    """Runs sequences through a fresh latent cache in steps (schedules[i][step] new tokens of sequence i), with
    block tables drawn from a shuffled pool so logical neighbours live in scattered blocks. tree_step: an optional
    final step for sequence 0 with 4 tree nodes (positions 0,1,1,2 after its context; parent chain in the mask).
    Returns per step the logits [num_tokens, vocab]."""
    g = torch.Generator().manual_seed(7)
    per_seq = max(-(-(len(t) + 4) // block_size) for t in token_lists)
    num_blocks = per_seq * len(token_lists) + 3
    pool = torch.randperm(num_blocks, generator=g).tolist()
    tables = [pool[i * per_seq : (i + 1) * per_seq] for i in range(len(token_lists))]
    caches = [torch.zeros(model.kv_cache_shape(i, num_blocks, block_size)) for i in range(model.num_layers)]
    done = [0] * len(token_lists)

    def slot(seq, index):
        return tables[seq][index // block_size] * block_size + index % block_size

    outs = []
    for step in range(max(len(s) for s in schedules)):
        ids, pos, slots, qlens, slens, tabs = [], [], [], [], [], []
        for i, sched in enumerate(schedules):
            if step >= len(sched) or sched[step] == 0:
                continue
            n = sched[step]
            ids += token_lists[i][done[i] : done[i] + n]
            pos += range(done[i], done[i] + n)
            slots += [slot(i, j) for j in range(done[i], done[i] + n)]
            qlens.append(n)
            slens.append(done[i] + n)
            tabs.append(tables[i])
            done[i] += n
        meta = build_metadata(pos, slots, qlens, slens, tabs, block_size)
        with torch.inference_mode():
            hidden, _ = model(torch.tensor(ids), meta, caches)
            outs.append(model.compute_logits(hidden))
    if tree_step is not None:
        ctx = done[0]
        mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        meta = build_metadata([ctx, ctx + 1, ctx + 1, ctx + 2], [slot(0, ctx + j) for j in range(4)], [4],
                              [ctx + 4], [tables[0]], block_size, tree_masks=[mask])
        with torch.inference_mode():
            hidden, _ = model(torch.tensor(tree_step), meta, caches)
            outs.append(model.compute_logits(hidden))
    return outs


def expanded(model):
    """Context: every layer's attention runs the non-absorbed computation."""
    class Ctx:
        def __enter__(self):
            for layer in model.layers:
                layer.self_attn.forward = layer.self_attn.forward_expanded

        def __exit__(self, *exc):
            for layer in model.layers:
                del layer.self_attn.forward

    return Ctx()


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None, "rope_interleave": False, "v_head_dim": 24}])
def test_deepseek_absorbed_equals_expanded(block_size, overrides):
    model = random_model(**overrides)
    g = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (28, 21)]
    # seq 0: chunked prefill then decode; seq 1: one-shot prefill then decode, joining in step 2
    schedules = [[5, 11, 4] + [1] * 8, [0, 13] + [1] * 8]
    tree = torch.randint(0, 1000, (4,), generator=g).tolist()
    absorbed = drive(model, tokens, schedules, block_size, tree_step=tree)
    with expanded(model):
        reference = drive(model, tokens, schedules, block_size, tree_step=tree)
    assert len(absorbed) == len(reference) == 12
    for step, (a, r) in enumerate(zip(absorbed, reference)):
        diff, tol = (a - r).abs().max().item(), 1e-5 * r.abs().max().item()
        assert diff <= tol, f"step {step}: max |Δlogit| {diff:.3g} > {tol:.3g}"


def test_deepseek_kv_cache_shape_is_latent():
    model = random_model()
    for i in range(model.num_layers):
        assert model.kv_cache_shape(i, 7, 16) == (7, 16, 32 + 16)


def save_hf(folder: str, seed: int = 0, **overrides):
    """A random HF DeepSeek-V3 checkpoint of the tiny config with overrides; returns the HF model."""
    import transformers as tf

    torch.manual_seed(seed)
    config = tf.DeepseekV3Config(**{**tiny_hf_config("deepseek_v3").to_dict(), **overrides})
    hf = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, t in list(hf.named_parameters()) + list(hf.named_buffers()):
            if name.endswith("norm.weight") or "layernorm" in name or name.endswith(".bias"):
                t.add_(torch.randn_like(t) * 0.1)
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn_like(t) * 0.1)
    hf.eval().save_pretrained(folder)
    return hf


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


@pytest.mark.parametrize("overrides", [
    {"q_lora_rank": None},
    {"rope_interleave": False, "attention_bias": True},
    {"norm_topk_prob": False, "n_shared_experts": 2, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3,
     "first_k_dense_replace": 0, "v_head_dim": 24},
])
def test_deepseek_variants_match_transformers(tmp_path, overrides):
    hf = save_hf(str(tmp_path), **overrides)
    model = load_model(str(tmp_path), "fp32").model
    if overrides.get("q_lora_rank", 32) is None:
        assert hasattr(model.layers[0].self_attn, "q_proj") and not hasattr(model.layers[0].self_attn, "q_a_proj")
    ids = torch.randint(0, 1000, (NUM_PROMPT + NUM_DECODE,), generator=torch.Generator().manual_seed(1))
    for block_size, chunks in ((16, [NUM_PROMPT]), (1, [7, 17])):
        (ours,) = run_incremental(model, [ids.tolist()], chunks, block_size)
        assert_close(ours, hf_logits(hf, ids))


def test_deepseek_kimi_k2_hub_config_loads(tiny_checkpoints, tmp_path):
    """model_type kimi_k2 (no architectures), old-style rope_scaling + rope_theta, the hub routing keys, and an
    MTP layer (model.layers.{num_hidden_layers}.*) in its own shard, which is ignored."""
    from safetensors.torch import save_file

    folder, hf = tiny_checkpoints("deepseek_v3")
    kimi = tmp_path / "kimi"
    shutil.copytree(folder, kimi)
    cfg = json.loads((kimi / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg.pop("architectures")
    cfg.update(model_type="kimi_k2", rope_theta=rope.pop("rope_theta"), rope_scaling={**rope, "type": rope.pop("rope_type")},
               topk_method="noaux_tc", scoring_func="sigmoid", ep_size=1, moe_layer_freq=1, num_nextn_predict_layers=1,
               aux_loss_alpha=0.001, seq_aux=True)
    (kimi / "config.json").write_text(json.dumps(cfg))
    save_file({"model.layers.2.eh_proj.weight": torch.zeros(64, 128),
               "model.layers.2.self_attn.kv_b_proj.weight": torch.zeros(128, 32)}, str(kimi / "mtp.safetensors"))
    model = load_model(str(kimi), "fp32").model
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    ids = torch.randint(0, 1000, (NUM_PROMPT + 8,), generator=torch.Generator().manual_seed(5))
    (ours,) = run_incremental(model, [ids.tolist()], [NUM_PROMPT], 16)
    assert_close(ours, hf_logits(hf, ids))

    save_file({"model.layers.3.eh_proj.weight": torch.zeros(2)}, str(kimi / "stray.safetensors"))
    with pytest.raises(Exception, match="unexpected tensor 'model.layers.3.eh_proj.weight'"):
        load_model(str(kimi), "fp32")


def test_deepseek_packed_expert_layout_loads(tiny_checkpoints):
    """HF's in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) loads like the
    per-expert layout that save_pretrained writes."""
    folder, hf = tiny_checkpoints("deepseek_v3")
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    model = build_model(json.loads(open(os.path.join(folder, "config.json")).read()), state, folder,
                        torch.float32, "cpu")
    ids = torch.randint(0, 1000, (NUM_PROMPT,), generator=torch.Generator().manual_seed(6))
    (ours,) = run_incremental(model, [ids.tolist()], [NUM_PROMPT], 16)
    assert_close(ours, hf_logits(hf, ids))


def test_deepseek_router_params_stay_fp32_in_bf16(tiny_checkpoints):
    folder, _ = tiny_checkpoints("deepseek_v3")
    model = load_model(folder, "bf16").model
    gate = model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.layers[1].mlp.experts[0].down_proj.weight.dtype == torch.bfloat16
    assert model.layers[1].self_attn.kv_b_proj.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 1000, (NUM_PROMPT,), generator=torch.Generator().manual_seed(4))
    (logits,) = run_incremental(model, [ids.tolist()], [NUM_PROMPT], 16)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("overrides,field", [
    ({"n_group": 3}, "n_group"),  # 8 experts do not split into 3 groups
    ({"n_group": 8, "topk_group": 4}, "n_group"),  # HF's defaults on 8 experts: groups of 1, scored by a top-2
    ({"topk_group": 3}, "topk_group"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),  # more than the 4 experts of topk_group=1 group
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "group_limited_greedy"}, "topk_method"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
])
def test_deepseek_invalid_config_is_one_line_error(overrides, field):
    with pytest.raises(ConfigError) as err:
        DeepseekV3ForCausalLM(tiny_cfg(**overrides))
    msg = str(err.value)
    assert f"'{field}'" in msg and "\n" not in msg


def test_deepseek_invalid_n_group_from_checkpoint_names_file_and_field(tiny_checkpoints, tmp_path):
    folder, _ = tiny_checkpoints("deepseek_v3")
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "n_group": 8, "topk_group": 4}))
    with pytest.raises(ConfigError) as err:
        load_model(str(bad), "fp32")
    msg = str(err.value)
    assert msg.startswith(str(bad / "config.json")) and "'n_group'=8" in msg and "\n" not in msg


def route(scores, bias=None, top_k=2, norm=True):
    scores = torch.tensor([scores])
    bias = torch.zeros(scores.shape[1]) if bias is None else torch.tensor(bias)
    ids, weights = group_limited_topk(scores, bias, n_group=2, topk_group=1, top_k=top_k, norm_topk_prob=norm,
                                      routed_scaling_factor=2.5)
    order = ids[0].argsort()
    return ids[0][order].tolist(), weights[0][order].tolist()


def test_deepseek_router_group_limited_selection_with_bias():
    # groups {0..3} and {4..7}; group score = sum of its top-2 biased scores
    s = [0.9, 0.1, 0.1, 0.1, 0.62, 0.58, 0.5, 0.2]
    # group 0: 0.9 + 0.1 = 1.0 < group 1: 0.62 + 0.58 = 1.2, so the globally best expert 0 is not chosen
    ids, w = route(s)
    assert ids == [4, 5]
    assert w == pytest.approx([2.5 * 0.62 / 1.2, 2.5 * 0.58 / 1.2], abs=1e-6)
    # +0.3 on expert 1 lifts group 0 to 0.9 + 0.4 = 1.3; weights stay the unbiased scores
    bias = [0.0, 0.3, 0, 0, 0, 0, 0, 0]
    ids, w = route(s, bias)
    assert ids == [0, 1]
    assert w == pytest.approx([2.5 * 0.9 / 1.0, 2.5 * 0.1 / 1.0], abs=1e-6)
    # a bias inside the chosen group changes which experts win, not the group: biased group 1 = 0.62 + 0.6
    ids, w = route(s, [0, 0, 0, 0, 0, 0, 0, 0.4], norm=False)
    assert ids == [4, 7]
    assert w == pytest.approx([2.5 * 0.62, 2.5 * 0.2], abs=1e-6)
    # -0.5 on expert 4 (biased 0.12): group 1 still wins (0.58 + 0.5 = 1.08 > 1.0) but loses its best expert
    ids, w = route(s, [0, 0, 0, 0, -0.5, 0, 0, 0], top_k=3)
    assert ids == [5, 6, 7]
    assert w == pytest.approx([2.5 * x / 1.28 for x in (0.58, 0.5, 0.2)], abs=1e-6)


def test_deepseek_router_module_runs_in_fp32_from_logits():
    """The module's sigmoid(x W^T) feeds the same selection; bf16 input is upcast before the matmul."""
    model = random_model()
    gate = model.layers[1].mlp.gate
    s = torch.tensor([0.9, 0.1, 0.1, 0.1, 0.62, 0.58, 0.5, 0.2])
    with torch.no_grad():
        gate.weight.copy_(torch.eye(8, 64))
        gate.e_score_correction_bias.zero_()
    x = torch.zeros(1, 64)
    x[0, :8] = torch.log(s / (1 - s))  # logit, so that sigmoid gives back s
    ids, w = gate(x)
    order = ids[0].argsort()
    assert ids[0][order].tolist() == [4, 5]
    assert w.dtype == torch.float32
    assert w[0][order].tolist() == pytest.approx([2.5 * 0.62 / 1.2, 2.5 * 0.58 / 1.2], abs=1e-6)
    assert not math.isnan(gate(x.bfloat16())[1].sum().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_expert_dispatch_equals_the_expert_loop(dtype):
    """The sync-free dispatch (tokens sorted by expert, two grouped GEMMs; what CUDA runs) against the loop over
    experts (the CPU reference), on CPU where torch's grouped GEMM also runs."""
    from engine.model.moe import _run_experts_loop, make_experts, run_experts_grouped

    torch.manual_seed(0)
    experts = make_experts(6, 32, 24).to(dtype)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    experts.fuse_projections()
    x = torch.randn(9, 32, dtype=dtype)
    ids = torch.stack([torch.randperm(6)[:2] for _ in range(9)])  # expert 5 may get no token
    weights = torch.rand(9, 2, dtype=dtype)
    got, want = run_experts_grouped(experts, x, ids, weights), _run_experts_loop(experts, x, ids, weights)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    assert not experts.grouped_ok(x)  # CPU keeps the loop as the reference
