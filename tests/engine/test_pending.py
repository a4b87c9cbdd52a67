"""PendingStep (engine/pending.py) read by a step launched ahead of its results: after a step that verified trees
beside a prompt's last chunk (an admission), each request's successor (root, root position, tokens emitted, the
emitted tokens) and accepted rows' features come from the trees' walk for the tree requests and from the sampled
plain row for the prompt, in the order the next step asks for them."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.pending import PendingStep
from engine.sampler import SampleOutput
from engine.staging import Staging


def mixed_step() -> tuple[PendingStep, list]:
    """Two trees (width 3) after one plain sampled row: tree A accepts 2 drafts, tree B none; the prompt P's chunk
    ends at its host length 7 and samples token 55. Feature rows: row r holds [r, r]."""
    tree_a, tree_b = SimpleNamespace(num_tokens=10), SimpleNamespace(num_tokens=20)
    prompt = SimpleNamespace(num_tokens=7)
    batch = SimpleNamespace(seqs=[SimpleNamespace(request=tree_a), SimpleNamespace(request=tree_b)], width=3,
                            budgets=[2, 2])
    walk = SimpleNamespace(accept_len=torch.tensor([3, 1]), emitted=torch.tensor([[11, 12, 13], [21, -1, -1]]),
                           accepted_nodes=torch.tensor([[0, 1, 2], [0, -1, -1]]))
    inputs = SimpleNamespace(tree_starts=torch.tensor([9, 19]), tree_row0=5)  # the chunk's rows are 0..4
    out = SampleOutput(torch.tensor([55, 0, 0, 0, 0, 0, 0]), [], None, None, None)
    features = torch.arange(11, dtype=torch.float32)[:, None].repeat(1, 2)  # [11 rows, 2]
    step = PendingStep(plain=[SimpleNamespace(request=prompt)], batch=batch, watched=None, inputs=inputs,
                       sampling=[(prompt, 4)], out=out, walk=walk, features=features, graph_mode="eager",
                       copy=None, t1=0.0, t2=0.0)
    return step, [tree_b, prompt, tree_a]  # the order the next step asks in


def test_a_mixed_steps_successors_merge_its_trees_and_its_prompts_row():
    step, order = mixed_step()
    assert step.verifies_trees and not step.is_tree_step
    roots, starts, num_new, emitted = step.successors(order, Staging("cpu"))
    assert roots.tolist() == [21, 55, 13]  # each request's last emitted token
    assert starts.tolist() == [20, 7, 12]  # past its accepted tokens; the prompt's first token at its length
    assert num_new.tolist() == [1, 1, 3]
    assert emitted.tolist() == [[21, -1, -1], [55, -1, -1], [11, 12, 13]]
    assert step.most_emitted() == {id(r): n for r, n in zip(order, [3, 1, 3])}


def test_a_mixed_steps_accepted_features_merge_likewise():
    step, order = mixed_step()
    feats = step.accepted_features(order, Staging("cpu"))  # [3 requests, A = 3, 2]
    # tree B: its root row (5 + 3 = 8), then filler; the prompt: its sampled row 4, then filler; tree A: rows 5-7
    assert feats[0, 0].tolist() == [8.0, 8.0] and feats[1, 0].tolist() == [4.0, 4.0]
    assert feats[1, 1:].eq(-1).all()
    assert feats[2].tolist() == [[5.0, 5.0], [6.0, 6.0], [7.0, 7.0]]
