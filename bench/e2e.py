"""End-to-end decode speed on one device, everything measured in the same run: our plain decoding (with and without
asynchronous scheduling), DFlash-style
chain verification (the drafter's top-1 path, B = depth) and DDTree (an oracle drafter replaying the mode's own
greedy output from an untimed first pass, gathered on the device so the drafter costs nothing and the engine's
round is what is measured; `diverged_from_plain` counts the requests whose first pass left the plain output;
that first pass, where chain and DDTree replay the same plain output, is reported too; the timed pass's adaptive
budget goes on from the untimed pass before it, as a serving engine's would, unless --cold-budget; --miss-rate
makes the oracle's top-1 wrong at a share of positions, its runner-up right),
at several batch sizes, beside transformers' static-cache `generate` (compiled by transformers) on a model of the
same shapes, and the weight-read floor (weight bytes over the device-to-device copy bandwidth measured here).
Prints one JSON line per run; not a test.

    python bench/e2e.py --model SmolLM2.gguf --batch 1 8 32 64
    python bench/e2e.py --qwen3-8b --batch 1 16          # Qwen3-8B shape, dummy bf16 weights
    python bench/e2e.py --smollm2-shape --batch 1 64     # SmolLM2-135M shape, dummy bf16 weights
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench.gpu_serving import QWEN3_8B, SMOLLM2_135M, free_engine_memory  # noqa: E402
from bench.host_timers import host_speed_us  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.speculative.oracle import DeviceOracle  # noqa: E402


def emit(**record) -> None:
    """One result as a JSON line, with the host's speed just after it (bench/host_timers.py host_speed_us: small
    models' steps follow it)."""
    print(json.dumps(dict(record, host_probe_us=round(host_speed_us(3)))), flush=True)


def copy_bandwidth(device: str) -> float:
    """Bytes read + written per second of a large device-to-device copy."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - t0)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def prompts(vocab: int, batch: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(batch)]


def timed(llm: LLM, ps: list[list[int]], new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
          fresh: bool = True, steps: Counter | None = None) -> tuple[float, list]:
    """Seconds to generate new_tokens for every prompt, and the outputs (seeded per request at temperature > 0:
    every pass draws the same tokens, which the oracle can then replay). fresh: a warm-up request first, then a
    fresh adaptive budget (the warm-up request ran alone, with other GEMM shapes than the batch whose output
    the oracle replays, and may have left that output; a previous pass's requests may have too); else the
    pass starts from what the previous pass of the same prompts and drafter left (a warm engine). steps: counts
    the pass's engine steps by how they were scheduled ("ahead", "synchronous: <why>")."""
    sp = [SamplingParams(max_tokens=new_tokens, temperature=temperature, top_p=top_p, seed=i, ignore_eos=True)
          for i in range(len(ps))]
    if fresh:
        llm.generate([ps[0]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
        llm.engine.budgets.reset()
    core, step = llm.engine, llm.engine.step
    if steps is not None:
        def counted():
            deltas = step()
            if core.last_stats is not None:
                steps[core.last_stats.scheduling or "synchronous"] += 1
            return deltas
        core.step = counted
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        outs = llm.generate(ps, sp)
        torch.cuda.synchronize()
    finally:
        core.step = step
    return time.perf_counter() - t0, outs


def run_ours(args, model_path: str, load_format: str) -> None:
    # no prefix caching: a pass would reuse the previous pass's prompt KV, prefill other shapes, round differently
    # in bf16 and leave the greedy path the oracle replays
    common = dict(device=args.device, load_format=load_format, max_num_seqs=max(args.batch),
                  max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=4096,
                  enable_prefix_caching=False)
    plain = LLM(model_path, **common)
    sync = LLM(model_path, async_scheduling=False, **common)  # the same engine, each step waiting for its results
    vocab = plain.engine.vocab_size
    floor_s = weight_bytes(plain.engine.model) / copy_bandwidth(args.device)
    emit(bench="floor", weight_gb=round(weight_bytes(plain.engine.model) / 1e9, 3), floor_ms=round(floor_s * 1e3, 3),
         floor_tok_s_batch1=round(1 / floor_s, 1))
    goldens = {}  # batch -> prompt -> prompt + plain output (bf16 rounding differs with the batch's shapes)
    for batch in args.batch:
        ps = prompts(vocab, batch, args.prompt_len)
        elapsed, outs = timed(plain, ps, args.new_tokens, args.temperature, args.top_p)
        tokens = sum(len(o.token_ids) for o in outs)
        emit(bench="ours", mode="plain", batch=batch, tok_s=round(tokens / elapsed, 1),
             ms_per_step=round(elapsed / args.new_tokens * 1e3, 3))
        goldens[batch] = {tuple(p): p + o.token_ids for p, o in zip(ps, outs)}
        runner = plain.engine.runner  # the same engine with the sampler outside the graphs (engine/plain_graphs.py off)
        runner.plain_graphs, sampling_graphs = None, runner.plain_graphs
        elapsed, eager_outs = timed(plain, ps, args.new_tokens, args.temperature, args.top_p)
        runner.plain_graphs = sampling_graphs
        assert [o.token_ids for o in eager_outs] == [o.token_ids for o in outs]
        emit(bench="ours", mode="plain, forward-only graphs", batch=batch, tok_s=round(tokens / elapsed, 1),
             ms_per_step=round(elapsed / args.new_tokens * 1e3, 3))
        elapsed, sync_outs = timed(sync, ps, args.new_tokens, args.temperature, args.top_p)
        assert [o.token_ids for o in sync_outs] == [o.token_ids for o in outs]
        emit(bench="ours", mode="plain, synchronous steps", batch=batch, tok_s=round(tokens / elapsed, 1),
             ms_per_step=round(elapsed / args.new_tokens * 1e3, 3))
    del plain, sync
    free_engine_memory()
    if args.plain_only:
        return
    oracle = DeviceOracle(goldens[args.batch[0]], args.prompt_len, vocab, args.depth, args.device,
                          miss_rate=args.miss_rate)
    # tree steps run ahead of their predecessor's results (the device oracle drafts from the device) as whole-round
    # graphs; the synchronous run is the same engine with every step waiting for its results, the forward-only
    # run the same engine with only the target forward of a tree step in a graph (engine/round_graphs.py off)
    for mode, kwargs in (("chain", dict(chain=True)), ("ddtree", dict(spec_budget=args.budget)),
                         ("ddtree, synchronous steps", dict(spec_budget=args.budget, async_scheduling=False)),
                         ("ddtree, forward-only graphs", dict(spec_budget=args.budget))):
        if args.fixed_budget:
            mode += ", fixed budget"
        llm = LLM(model_path, drafter=oracle, adaptive=not args.fixed_budget, **kwargs, **common)
        if "forward-only graphs" in mode:
            llm.engine.runner.rounds = None
        if args.no_harmonize:  # every tree at its own budget, padded to the step's widest (the A/B baseline)
            llm.engine.scheduler.width_of = lambda requests, budgets: budgets
            mode += ", budgets not harmonized"
        if args.no_fill:  # trees narrower than the step's width keep their padding rows
            llm.engine.scheduler.fill_trees = False
            mode += ", trees not filled"
        if args.no_uniform:  # graph steps priced and filled as if only the trees paid the width (the A/B)
            llm.engine.scheduler.uniform_of = None
            mode += ", not uniform"
        for batch in args.batch:
            ps = prompts(vocab, batch, args.prompt_len)
            # A verify step rounds in bf16 unlike a plain step (other GEMM shapes), so a greedy output can leave
            # the plain one at a near-tie and the oracle then proposes junk for the rest of that request. The
            # first, untimed pass counts those requests; the timed pass replays this mode's own output.
            oracle.load(goldens[batch])
            elapsed, own = timed(llm, ps, args.new_tokens, args.temperature, args.top_p)
            diverged = sum(p + o.token_ids != goldens[batch][tuple(p)] for p, o in zip(ps, own))
            # both modes' first passes replay the same plain output: the same drafter, wrong where a request
            # left that output (the engine's first steps of these shapes are in it too)
            emit_spec(f"{mode}, first pass replaying plain", batch, elapsed, own, diverged_from_plain=diverged)
            # Replaying its own output changes a pass's step shapes (longer accepted runs) and so its rounding,
            # which can leave that output again (bf16 near-ties: dummy weights are full of them). Untimed passes
            # replay the previous one's output until a pass reproduces the output it replayed: the timed pass
            # then repeats that pass exactly.
            golden, passes = {tuple(p): p + o.token_ids for p, o in zip(ps, own)}, 0
            while passes < args.replay_passes:
                passes += 1
                oracle.load(golden)
                _, again = timed(llm, ps, args.new_tokens, args.temperature, args.top_p)
                replayed = {tuple(p): p + o.token_ids for p, o in zip(ps, again)}
                if replayed == golden:
                    break
                golden = replayed
            oracle.load(golden)
            # warm: the adaptive budget goes on from the last untimed pass (same prompts, same drafter), as a
            # serving engine's would; --cold-budget starts it fresh (the first steps then draft to learn)
            # a timed pass whose step shapes differ from the pass it replays (the warm budget, the host's timing)
            # can round a request off its replay, which then decodes at tau 1 to the end: that pass measures
            # the oracle, not the engine, and is repeated (--timed-attempts; every attempt is counted)
            for attempt in range(1, max(1, args.timed_attempts) + 1):
                steps = Counter()
                elapsed, outs = timed(llm, ps, args.new_tokens, args.temperature, args.top_p,
                                      fresh=args.cold_budget, steps=steps)
                left = sum(p + o.token_ids != golden[tuple(p)] for p, o in zip(ps, outs))
                if not left:
                    break
            emit_spec(mode, batch, elapsed, outs, diverged_from_plain=diverged, replay_passes=passes,
                      timed_attempts=attempt, left_replayed_output=left, engine_steps=sum(steps.values()),
                      ahead=steps.pop("ahead", 0), synchronous=dict(steps.most_common()))
        del llm
        free_engine_memory()


def emit_spec(mode: str, batch: int, elapsed: float, outs: list, **extra) -> None:
    tokens = sum(len(o.token_ids) for o in outs)
    taus = [o.stats.get("spec", {}).get("mean_accept_length", 1.0) for o in outs]
    emit(bench="ours", mode=mode, batch=batch, tok_s=round(tokens / elapsed, 1), tau=round(sum(taus) / len(taus), 2),
         tau_min=round(min(taus), 2), max_steps=max(o.stats.get("spec", {}).get("steps", 0) for o in outs), **extra)


def run_transformers(args, hf_source) -> None:
    """transformers' generate with its static cache (it compiles the forward itself), greedy."""
    import transformers

    with torch.device(args.device):
        model = hf_source().eval()
    for batch in args.batch:
        ids = torch.tensor(prompts(model.config.vocab_size, batch, args.prompt_len), device=args.device)
        kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                      cache_implementation="static", pad_token_id=0)
        with torch.no_grad():
            model.generate(ids, **kwargs)  # compile + warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, **kwargs)
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        emit(bench="transformers", mode="static-cache generate", batch=batch,
             tok_s=round(batch * args.new_tokens / elapsed, 1), version=transformers.__version__)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF folder or GGUF (ours and transformers)")
    p.add_argument("--qwen3-8b", action="store_true", help="a Qwen3-8B-shaped model with dummy bf16 weights")
    p.add_argument("--smollm2-shape", action="store_true", help="a SmolLM2-135M-shaped model with dummy bf16 weights")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--replay-passes", type=int, default=4,
                   help="untimed passes at most, each replaying the previous one's output, before the timed pass")
    p.add_argument("--timed-attempts", type=int, default=3,
                   help="timed passes at most: one in which a request left the output it replays is repeated")
    p.add_argument("--fixed-budget", action="store_true",
                   help="chain and DDTree verify their whole budget every step (no adaptive budget): every tree "
                        "step has one shape, so long generations' replay passes settle (with the adaptive budget "
                        "the verify width varies, bf16 rounds differently and dummy weights' near-ties move)")
    p.add_argument("--temperature", type=float, default=0.0, help="ours: sample (seeded per request) instead of argmax")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--depth", type=int, default=7, help="oracle horizon (tau = depth + 1 when all accepted)")
    p.add_argument("--miss-rate", type=float, default=0.0,
                   help="share of positions where the oracle's top-1 is wrong and the golden token its second "
                        "proposal (the same positions for chain and DDTree)")
    p.add_argument("--no-harmonize", action="store_true",
                   help="ours: a step's tree budgets are not harmonized to one padded width")
    p.add_argument("--no-fill", action="store_true",
                   help="ours: trees narrower than the step's width are not filled to it")
    p.add_argument("--no-uniform", action="store_true",
                   help="ours: a graph step's width is not priced for every request (harmonize and fill instead)")
    p.add_argument("--cold-budget", action="store_true",
                   help="timed passes start from a fresh adaptive budget (default: warm, from the untimed pass "
                        "before)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the engine's step token budget (default: the engine's own, 8192 on CUDA)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--plain-only", action="store_true", help="ours: plain decoding's modes only (no drafter)")
    args = p.parse_args()
    import transformers

    shape = QWEN3_8B if args.qwen3_8b else SMOLLM2_135M if args.smollm2_shape else None
    if shape is not None:
        folder = tempfile.mkdtemp(prefix="dummy-shape-")
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(shape, f)
        run_ours(args, folder, "dummy")
        fields = {k: v for k, v in shape.items() if k not in ("architectures", "model_type")}
        config = transformers.AutoConfig.for_model(shape["model_type"], **fields)
        hf_source = lambda: transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # noqa: E731
    else:
        run_ours(args, args.model, "auto")
        folder, name = os.path.split(args.model)
        hf_source = lambda: transformers.AutoModelForCausalLM.from_pretrained(  # noqa: E731
            folder, gguf_file=name, dtype=torch.bfloat16)
    if not args.skip_transformers:
        free_engine_memory()
        run_transformers(args, hf_source)


if __name__ == "__main__":
    main()
