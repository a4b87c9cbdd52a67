"""At T > 0 DDTree keeps plain sampling's output distribution exactly.

A tiny random Llama (vocab 32) is the target; transformers computes the exact joint probability of the first
three generated tokens (all 32^3 sequences, optionally through its top-k / top-p warpers). For each drafter
(n-gram, oracle, and the target's own top-K chain for sibling-heavy trees) and budget B in {1, 4, 16}, 20,000
seeded requests go through the engine (the sibling-heavy drafter at B = 16 only) and their first three tokens pass a chi-square goodness-of-fit test at
p = 0.001 against that exact distribution. The seeds are fixed, so each test is deterministic; over the 10 tests
the family-wise false-alarm rate for a correct sampler is under 1%. The same test rejects the distribution
at another temperature (it has power), and seeded DDTree reproduces seeded plain sampling token for token.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chi2

from engine import LLM, SamplingParams
from engine.speculative.oracle import OracleDrafter

VOCAB, NUM_SAMPLES, NUM_TOKENS, MAX_TOKENS = 32, 20_000, 3, 20
PROMPT = [3, 17, 5, 9, 3, 17]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(folder, HF model) of a tiny Llama whose next-token distributions are neither flat nor one-hot."""
    import transformers as tf

    folder = str(tmp_path_factory.mktemp("tiny-vocab32"))
    torch.manual_seed(5)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    hf = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(6.0)
    hf.save_pretrained(folder)
    return folder, hf


def exact_joint(hf, prompt, warp=None) -> dict[tuple[int, ...], float]:
    """P(first three tokens) from transformers, through `warp` (its logits warpers) when given."""
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(NUM_TOKENS):
        prefixes = list(probs)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1].float()
        if warp is not None:
            logits = warp(logits)
        step = logits.softmax(-1).double()
        probs = {p + (t,): probs[p] * step[i, t].item() for i, p in enumerate(prefixes) for t in range(VOCAB)
                 if step[i, t] > 0}
    return probs


def chi_square_p(samples: list[tuple[int, ...]], probs: dict[tuple[int, ...], float]) -> float:
    counts: dict[tuple[int, ...], int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    assert all(s in probs for s in counts), "a sequence of probability 0 was sampled"
    n = len(samples)
    big = [s for s, p in probs.items() if p * n >= 5]
    obs = [counts.get(s, 0) for s in big] + [n - sum(counts.get(s, 0) for s in big)]
    exp = [probs[s] * n for s in big] + [n * (1 - sum(probs[s] for s in big))]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    return float(chi2.sf(stat, len(big)))


def first_tokens(llm: LLM, prompt: list[int], **params) -> list[tuple[int, ...]]:
    """The first NUM_TOKENS tokens of NUM_SAMPLES requests seeded 0.., each aborted once it has them (so the
    tree budget is never cut by max_tokens)."""
    core, out = llm.engine, {}
    for seed in range(NUM_SAMPLES):
        sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=seed, detokenize=False, **params)
        out[core.add_request(prompt, sp)] = []
    while core.has_unfinished():
        for delta in core.step():
            out[delta.request_id].extend(delta.new_token_ids)
            if len(out[delta.request_id]) >= NUM_TOKENS and not delta.finished:
                core.abort(delta.request_id)
    return [tuple(t[:NUM_TOKENS]) for t in out.values()]


class TargetTopKDrafter:
    """Proposes the target's own top-K at every depth along its greedy chain: the siblings are exactly the
    tokens sampling picks among, so the walk often accepts rank 1 and 2 children (non-spine paths)."""

    target_layer_ids = ()

    def __init__(self, hf, horizon: int = 4, device: str = "cpu"):
        self.hf, self.horizon, self.device = hf, horizon, device
        self.cache: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}  # history -> proposal

    def release(self, request_id):
        pass

    @torch.no_grad()
    def propose(self, batch, top_k):
        cache, lps, ids = self.cache, [], []
        for req in batch:
            key = tuple(req.token_ids)
            if key not in cache:
                tokens, lp_rows, id_rows = list(req.token_ids), [], []
                for _ in range(self.horizon):
                    logp = self.hf(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
                    lp, top = logp.topk(min(top_k, VOCAB))
                    lp_rows.append(lp)
                    id_rows.append(top)
                    tokens.append(int(top[0]))
                cache[key] = (torch.stack(lp_rows), torch.stack(id_rows))
            lps.append(cache[key][0])
            ids.append(cache[key][1])
        return torch.stack(lps).to(self.device), torch.stack(ids).to(self.device)


def make_drafter(kind: str, folder: str, hf, device: str = "cpu"):
    if kind == "ngram":
        return "ngram"
    if kind == "topk":
        return TargetTopKDrafter(hf, device=device)
    greedy = LLM(folder, dtype="fp32").generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS + 4, temperature=0,
                                                                         ignore_eos=True))[0].token_ids
    return OracleDrafter(lambda r: PROMPT + greedy, VOCAB, horizon=4, check_prefix=False, device=device)


def engine(folder, drafter=None, budget=0, device="cpu") -> LLM:
    kwargs = {} if drafter is None else dict(drafter=drafter, spec_budget=budget, adaptive=False)  # B as given
    return LLM(folder, dtype="fp32", device=device, max_num_seqs=4096,
               max_num_batched_tokens=4096 * 2 * (budget + 2), max_model_len=64, **kwargs)


@pytest.fixture(scope="module")
def plain_samples(target):
    folder, hf = target
    return first_tokens(engine(folder), PROMPT, temperature=1.0)


def test_plain_sampling_matches_exact_distribution_and_the_test_has_power(target, plain_samples):
    folder, hf = target
    assert chi_square_p(plain_samples, exact_joint(hf, PROMPT)) > 1e-3
    colder = exact_joint(hf, PROMPT, warp=lambda x: x / 0.85)
    assert chi_square_p(plain_samples, colder) < 1e-3  # a 15% temperature error is detected


EXTENDED = pytest.mark.extended  # budgets 1 and 4 of the oracle and 1 of the n-gram: ngram-4 covers small trees


@pytest.mark.parametrize("kind, budget", [pytest.param("ngram", 1, marks=EXTENDED), ("ngram", 4), ("ngram", 16),
                                          pytest.param("oracle", 1, marks=EXTENDED),
                                          pytest.param("oracle", 4, marks=EXTENDED), ("oracle", 16), ("topk", 16)])
def test_ddtree_sampling_matches_exact_distribution(target, plain_samples, kind, budget, monkeypatch):
    folder, hf = target
    from engine.speculative import speculator

    accepted = []
    walk = speculator.Speculator.walk

    def spy(batch, targets):
        result = walk(batch, targets)
        accepted.append(result.accepted_nodes.clone())
        return result

    monkeypatch.setattr(speculator.Speculator, "walk", staticmethod(spy))
    llm = engine(folder, make_drafter(kind, folder, hf), budget)
    samples = first_tokens(llm, PROMPT, temperature=1.0)
    assert chi_square_p(samples, exact_joint(hf, PROMPT)) > 1e-3
    nodes = torch.cat(accepted)
    assert int((nodes[:, 1] > 0).sum()) > 1000, "the walk hardly ever accepted a draft"
    if kind == "topk":
        depth_one = nodes[:, 1]
        assert int((depth_one > 1).sum()) > 500, "no sibling (non-spine) node was accepted"
    same = sum(a == b for a, b in zip(samples, plain_samples))
    assert same >= 0.999 * NUM_SAMPLES, f"seeded DDTree differs from seeded plain sampling in {NUM_SAMPLES - same}"


def test_top_k_top_p_under_ddtree_match_transformers_warpers(target):
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    folder, hf = target
    warp = lambda x: TopPLogitsWarper(0.8)(None, TopKLogitsWarper(4)(None, x))  # noqa: E731
    llm = engine(folder, make_drafter("topk", folder, hf), 4)
    samples = first_tokens(llm, PROMPT, temperature=1.0, top_k=4, top_p=0.8)
    assert chi_square_p(samples, exact_joint(hf, PROMPT, warp)) > 1e-3
    assert chi_square_p(samples, exact_joint(hf, PROMPT)) < 1e-3  # the warpers did change the distribution


@pytest.mark.gpu
@pytest.mark.parametrize("kind, budget", [("ngram", 4), ("oracle", 16), ("topk", 16)])
def test_ddtree_sampling_on_cuda_matches_exact_distribution(target, kind, budget):
    """The same test through the CUDA sampler, tree and attention kernels (fp32)."""
    from ext import ops

    folder, hf = target
    before = ops.cuda_calls()
    samples = first_tokens(engine(folder, make_drafter(kind, folder, hf, "cuda"), budget, "cuda"), PROMPT,
                           temperature=1.0)
    assert chi_square_p(samples, exact_joint(hf, PROMPT)) > 1e-3
    used = {k: v - before.get(k, 0) for k, v in ops.cuda_calls().items()}
    assert used.get("sample_tokens", 0) > 0 and used.get("tree_accept", 0) > 0, used
    plain = first_tokens(engine(folder, device="cuda"), PROMPT, temperature=1.0)
    assert sum(a == b for a, b in zip(samples, plain)) >= 0.999 * NUM_SAMPLES
