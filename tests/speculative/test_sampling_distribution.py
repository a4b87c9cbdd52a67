"""At T > 0 DDTree keeps the output distribution of plain sampling (target-only sampling): per-position token
histograms of many seeded requests agree by a chi-square test, including steps that accept non-rank-0 siblings.
The same test tells apart two genuinely different distributions (T = 1 vs T = 0.6), so it can fail."""
from __future__ import annotations

import math
from collections import Counter

import torch

from engine import LLM, SamplingParams

NUM_REQUESTS, NUM_TOKENS, TOP_K = 400, 6, 3


class TargetTopKDrafter:
    """Proposes the target's own top-K at every depth along its greedy chain: the root's siblings are exactly
    the tokens plain sampling picks among, so the walk often accepts rank 1 and 2 children."""

    target_layer_ids = ()

    def __init__(self, hf_model, horizon: int = 2):
        self.hf, self.horizon = hf_model, horizon

    def release(self, request_id):
        pass

    @torch.no_grad()
    def propose(self, batch, top_k):
        logprobs, ids = [], []
        for req in batch:
            tokens, lp_rows, id_rows = list(req.token_ids), [], []
            for _ in range(self.horizon):
                logits = self.hf(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
                lp, top = logits.topk(top_k)
                lp_rows.append(lp)
                id_rows.append(top)
                tokens.append(int(top[0]))
            logprobs.append(torch.stack(lp_rows))
            ids.append(torch.stack(id_rows))
        return torch.stack(logprobs), torch.stack(ids)


def histograms(outputs) -> list[Counter]:
    return [Counter(o.token_ids[pos] for o in outputs) for pos in range(NUM_TOKENS)]


def chi_square(a: Counter, b: Counter) -> tuple[float, int]:
    """Two-sample chi-square statistic and degrees of freedom; rare categories pooled."""
    total_a, total_b = sum(a.values()), sum(b.values())
    cats = sorted(set(a) | set(b))
    common = [c for c in cats if a[c] + b[c] >= 10]
    rows = [(a[c], b[c]) for c in common]
    rest = (sum(a[c] for c in cats if c not in common), sum(b[c] for c in cats if c not in common))
    if sum(rest) > 0:
        rows.append(rest)
    stat = 0.0
    for x, y in rows:
        n = x + y
        for obs, total in ((x, total_a), (y, total_b)):
            exp = n * total / (total_a + total_b)
            stat += (obs - exp) ** 2 / exp
    return stat, max(1, len(rows) - 1)


def critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at p = 0.001."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def sample(llm, temperature):
    prompt = list(range(11, 19))
    params = [SamplingParams(max_tokens=NUM_TOKENS, temperature=temperature, top_k=TOP_K, seed=1000 + i,
                             ignore_eos=True) for i in range(NUM_REQUESTS)]
    core = llm.engine
    ids = [core.add_request(prompt, p) for p in params]
    tokens = {rid: [] for rid in ids}
    while core.has_unfinished():
        for d in core.step():
            tokens[d.request_id].extend(d.new_token_ids)

    class Out:
        def __init__(self, t):
            self.token_ids = t

    return [Out(tokens[rid]) for rid in ids]


def peaked_checkpoint(folder):
    """A tiny random Llama whose logits are spread out (a random init gives near-uniform top tokens, where
    every sampler looks alike)."""
    from tests.conftest import make_tiny_checkpoint

    hf = make_tiny_checkpoint("llama", folder, seed=11)
    with torch.no_grad():
        hf.lm_head.weight.mul_(25.0)
    hf.save_pretrained(folder)
    return hf


def test_ddtree_sampling_matches_plain_sampling(tmp_path, monkeypatch):
    from engine.speculative import speculator

    sibling_steps = []
    original = speculator.Speculator.compact

    def spy(slot_views, row_slots, accepted):
        sibling_steps.extend(acc for acc in accepted if len(acc) > 1 and acc != list(range(len(acc))))
        return original(slot_views, row_slots, accepted)

    monkeypatch.setattr(speculator.Speculator, "compact", staticmethod(spy))
    folder = str(tmp_path)
    hf = peaked_checkpoint(folder)
    plain = sample(LLM(folder, dtype="fp32", max_num_seqs=NUM_REQUESTS), 1.0)
    tree = sample(LLM(folder, dtype="fp32", drafter=TargetTopKDrafter(hf), spec_budget=6,
                      max_num_seqs=NUM_REQUESTS), 1.0)
    colder = sample(LLM(folder, dtype="fp32", max_num_seqs=NUM_REQUESTS), 0.6)
    assert len(sibling_steps) > 50, "the walk hardly ever accepted a non-rank-0 sibling"
    for pos, (h_plain, h_tree, h_cold) in enumerate(zip(histograms(plain), histograms(tree), histograms(colder))):
        stat, df = chi_square(h_plain, h_tree)
        assert stat < critical(df), f"position {pos}: chi2 {stat:.1f} >= {critical(df):.1f} (df {df})"
        if pos == 1:  # power check: a different temperature is detected
            stat, df = chi_square(h_plain, h_cold)
            assert stat > critical(df), f"chi2 {stat:.1f} cannot tell T=1 from T=0.6"
