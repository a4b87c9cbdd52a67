"""Tensor parallelism on CPU with the gloo backend: two engine processes (rank 0 in this process, rank 1 started by
it) give token-for-token the greedy output of one, with DDTree verifying trees every step, for a tiny Llama, a
Qwen3-MoE and a DeepSeek-V3 (MLA + MoE); seeded sampling runs to the end identically twice (ranks that diverged
would deadlock or disagree); sizes that do not divide fail naming the field, and the other ranks exit."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.errors import ConfigError
from engine.model.loader import model_class, read_config
from engine.model.tensor_parallel import shard_model

PROMPTS = [[1, 5, 9, 200, 31, 7, 7, 8] * 3, [3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [17, 301, 999, 2, 45]]


def generate(folder: str, tp: int, *samplings: SamplingParams):
    with LLM(folder, drafter="ngram", spec_budget=8, adaptive=False, tensor_parallel_size=tp) as llm:
        return [llm.generate(PROMPTS, sampling) for sampling in samplings]


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
def test_two_ranks_greedy_equal_one_rank_with_ddtree(tiny_checkpoints, family):
    """Also: seeded sampling on two ranks runs to the end and repeats itself (ranks that diverged would deadlock
    or disagree)."""
    folder, _ = tiny_checkpoints(family)
    greedy = SamplingParams(max_tokens=32, temperature=0.0)
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=7)
    (one,) = generate(folder, 1, greedy)
    two, first, second = generate(folder, 2, greedy, seeded, seeded)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    assert all(len(o.token_ids) == 32 for o in two)
    steps = sum(o.stats["spec"]["steps"] for o in two)
    assert steps >= 3 * 4, "DDTree did not verify trees"  # at most 9 tokens a step: >= 4 steps per prompt
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert all(o.finish_reason == "length" for o in first)


def test_a_size_the_ranks_do_not_divide_fails_and_the_followers_exit(tiny_checkpoints):
    folder, _ = tiny_checkpoints("llama")  # vocab 1000: not divisible by 3
    start = time.monotonic()
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 does not divide vocab_size=1000"):
        LLM(folder, tensor_parallel_size=3)
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("family,field", [("llama", "num_attention_heads"), ("qwen3_moe", "num_attention_heads"),
                                          ("deepseek_v3", "num_attention_heads")])
def test_heads_that_do_not_divide_are_named(tiny_checkpoints, family, field):
    folder, _ = tiny_checkpoints(family)
    cfg = dict(read_config(folder), vocab_size=999)  # divisible by 3, so the heads (4) fail first
    with torch.device("meta"):
        model = model_class(cfg, folder)(cfg)
    with pytest.raises(ConfigError, match=f"tensor_parallel_size=3 does not divide {field}=4"):
        shard_model(model, SimpleNamespace(rank=0, world_size=3))


def test_shards_partition_every_split_parameter(tiny_checkpoints):
    """Rank r's slice of each split parameter is the r-th of world_size equal parts along its dim; row-parallel
    biases are whole on rank 0 only."""
    folder, _ = tiny_checkpoints("deepseek_v3")
    cfg = read_config(folder)
    specs = []
    for rank in range(2):
        with torch.device("meta"):
            model = model_class(cfg, folder)(cfg)
        full = {n: tuple(p.shape) for n, p in model.named_parameters()}
        shard_model(model, SimpleNamespace(rank=rank, world_size=2, all_reduce=lambda x: x))
        specs.append(model.shard_specs)
        for name, p in model.named_parameters():
            spec = model.shard_specs.get(name)
            assert (full[name] if spec is None else spec.full_shape(tuple(p.shape))) == full[name], name
    assert specs[0].keys() == specs[1].keys()
    assert {"embed_tokens.weight", "lm_head.weight", "layers.0.self_attn.o_proj.weight",
            "layers.1.mlp.experts.3.down_proj.weight", "layers.1.mlp.shared_experts.gate_proj.weight",
            "layers.0.self_attn.kv_b_proj.weight"} <= specs[0].keys()
    assert "layers.0.self_attn.kv_a_proj_with_mqa.weight" not in specs[0]  # the latent is replicated
    assert "layers.1.mlp.gate.weight" not in specs[0]  # so is the router
    t = torch.arange(24.0).view(4, 6)
    spec0, spec1 = specs[0]["layers.0.self_attn.o_proj.weight"], specs[1]["layers.0.self_attn.o_proj.weight"]
    assert torch.equal(torch.cat([spec0.take(t), spec1.take(t)], dim=spec0.dim), t)


def test_a_dead_rank_is_noticed_without_a_request(tiny_checkpoints):
    """The engine loop polls its ranks while idle (engine/process.py): a killed rank is reported by name."""
    import os
    import signal

    folder, _ = tiny_checkpoints("llama")
    with LLM(folder, tensor_parallel_size=2) as llm:
        llm.engine.check_ranks()  # all alive
        (follower,) = llm.engine.followers.processes
        os.kill(follower.pid, signal.SIGKILL)
        follower.wait(10)
        with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 \(pid \d+\) exited with status -9"):
            llm.engine.check_ranks()


def test_more_ranks_than_gpus_and_a_pinned_device_are_refused():
    from engine.config import EngineConfig
    from engine.ranks import check_devices

    found = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"--tensor-parallel-size {found + 1} needs that many CUDA devices; "
                                         f"{found} visible"):
        check_devices(EngineConfig(device="cuda", tensor_parallel_size=found + 1))
    with pytest.raises(ValueError, match="use --device cuda"):
        check_devices(EngineConfig(device="cuda:1", tensor_parallel_size=2))


def test_two_ranks_with_the_dflash_drafter_equal_one_rank(tiny_checkpoints, tmp_path):
    """The DFlash drafter runs on every rank over the target's vocab-parallel embedding and gathered logits (its
    collectives line up because every rank drafts the same requests at the same steps)."""
    import json

    from engine.speculative.dflash_files import save_random_dflash

    folder, _ = tiny_checkpoints("qwen3")
    with open(f"{folder}/config.json") as f:
        save_random_dflash(str(tmp_path), json.load(f), num_layers=1, block_size=8, seed=1)
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    outs = {}
    for tp in (1, 2):
        with LLM(folder, drafter="dflash", draft_model=str(tmp_path), spec_budget=8, adaptive=False,
                 tensor_parallel_size=tp) as llm:
            outs[tp] = llm.generate(PROMPTS, greedy)
    assert [o.token_ids for o in outs[2]] == [o.token_ids for o in outs[1]]
    assert all(o.stats["spec"]["steps"] > 0 for o in outs[2])


def test_refused_and_aborted_requests_keep_the_ranks_in_step(tiny_checkpoints):
    """A request the engine refuses (on every rank alike) and one aborted mid-generation leave the ranks agreeing:
    the surviving request's tokens equal the one-rank run of the same sequence of calls."""
    folder, _ = tiny_checkpoints("llama")

    def scenario(tp: int) -> list[int]:
        with LLM(folder, drafter="ngram", spec_budget=8, adaptive=False, tensor_parallel_size=tp) as llm:
            core = llm.engine
            with pytest.raises(ValueError, match="outside the vocabulary"):
                core.add_request([1, 2, 5000], SamplingParams(max_tokens=4))
            keep = core.add_request(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.0), "keep")
            core.add_request(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.0), "drop")
            tokens = []
            for step in range(40):
                if step == 2:
                    assert core.abort("drop")
                for delta in core.step():
                    if delta.request_id == keep:
                        tokens += delta.new_token_ids
                if not core.has_unfinished():
                    break
            return tokens

    one, two = scenario(1), scenario(2)
    assert len(one) == 20 and two == one


def test_dropping_the_llm_stops_its_ranks(tiny_checkpoints):
    import gc

    folder, _ = tiny_checkpoints("llama")
    llm = LLM(folder, tensor_parallel_size=2)
    (follower,) = llm.engine.followers.processes
    del llm
    gc.collect()
    assert follower.wait(timeout=30) == 0
