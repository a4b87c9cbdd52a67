"""The training objective against the inference path: the frozen target's features equal HF's hidden states;
the batched, masked training forward gives, for every anchor, the logits DFlashDrafter.forward_logits gives for
that prefix; labels, position weights and the chunked loss; padding anchors change nothing."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from engine.model.loader import load_model
from engine.speculative.dflash import load_dflash
from engine.speculative.dflash_files import save_random_dflash
from engine.speculative.drafter import DraftRequest
from engine.train import objective
from engine.train.objective import Batch, block_labels, dflash_loss, draft_hidden, make_batch, position_weights
from engine.train.target import FrozenTarget, default_mask_token_id, default_target_layer_ids

BLOCK, MASK, VOCAB = 8, 5, 1000


@pytest.fixture(scope="module")
def setup(tiny_checkpoints, tmp_path_factory):
    folder, hf = tiny_checkpoints("qwen3")
    model = load_model(folder, "fp32").model
    draft = str(tmp_path_factory.mktemp("draft"))
    with open(os.path.join(folder, "config.json")) as f:
        save_random_dflash(draft, json.load(f), num_layers=2, block_size=BLOCK, mask_token_id=MASK,
                           target_layer_ids=[0, 1], seed=3)
    drafter = load_dflash(draft, model, VOCAB)
    return hf, model, drafter, FrozenTarget(model, [0, 1], page_size=4)


def seqs():
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(6, VOCAB, (n,), generator=g).tolist(), p) for n, p in ((23, 5), (14, 3), (31, 20))]


def test_features_are_the_layer_outputs(setup):
    hf, _, _, target = setup
    data = seqs()
    batch = make_batch(data, 4, torch.Generator().manual_seed(1))
    feats = target.features(batch.tokens, batch.lengths)  # [B, T, 128]
    for b, (ids, _) in enumerate(data):
        with torch.no_grad():
            hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        want = torch.cat([hs[1][0], hs[2][0]], dim=-1)  # layer 0's output; the last layer's is after the norm
        torch.testing.assert_close(feats[b, :len(ids)], want, atol=1e-4, rtol=1e-4)
        assert not feats[b, len(ids):].any()


def test_training_forward_equals_inference_drafter(setup):
    _, model, drafter, target = setup
    data = seqs()
    batch = make_batch(data, 6, torch.Generator().manual_seed(2))
    assert batch.anchor_valid.sum(1).tolist() == [6, 6, 6]
    feats = target.features(batch.tokens, batch.lengths)
    with torch.no_grad():
        hidden = draft_hidden(drafter.model, target.embed, feats, batch)  # [B, A, bs, H]
        logits = model.compute_logits(hidden[:, :, 1:].reshape(-1, hidden.shape[-1])).view(3, 6, BLOCK - 1, -1)
    for b, (ids, prompt_len) in enumerate(data):
        for j, a in enumerate(batch.anchors[b].tolist()):
            assert prompt_len <= a <= len(ids) - 2
            req = DraftRequest(f"{b}-{j}", ids[:a + 1], feats[b, :a])
            want = drafter.forward_logits([req])[0]  # [L, V]
            drafter.release(req.request_id)
            torch.testing.assert_close(logits[b, j], want, atol=2e-4, rtol=1e-4)


def test_padding_anchors_and_other_sequences_change_nothing(setup):
    _, _, drafter, target = setup
    data = seqs()
    batch = make_batch(data, 6, torch.Generator().manual_seed(2))
    feats = target.features(batch.tokens, batch.lengths)
    with torch.no_grad():
        together = draft_hidden(drafter.model, target.embed, feats, batch)
        ids, prompt_len = data[1]
        alone = Batch(batch.tokens[1:2, :len(ids)], [len(ids)],
                      torch.cat([batch.anchors[1:2, :3], torch.zeros(1, 2, dtype=torch.int64)], 1),
                      torch.tensor([[True, True, True, False, False]]))
        single = draft_hidden(drafter.model, target.embed, feats[1:2, :len(ids)], alone)
    torch.testing.assert_close(single[0, :3], together[1, :3], atol=1e-5, rtol=1e-5)


def test_labels_and_weights():
    tokens = torch.tensor([[10, 11, 12, 13, MASK, 15, 0, 0], [20, 21, 22, 23, 24, 25, 26, 27]])
    batch = Batch(tokens, [6, 8], torch.tensor([[2, 0], [5, 6]]), torch.tensor([[True, False], [True, True]]))
    labels, valid = block_labels(batch, 4, MASK)
    assert labels[0, 0].tolist() == [13, MASK, 15] and valid[0, 0].tolist() == [True, False, True]
    assert not valid[0, 1].any()  # a padding anchor
    assert labels[1, 1, 0].item() == 27 and valid[1, 1].tolist() == [True, False, False]  # past the end
    w = position_weights(16, 7.0)
    assert w[0] == 1.0 and abs(w[7].item() - torch.exp(torch.tensor(-1.0)).item()) < 1e-6


def test_chunked_loss_equals_full_and_has_gradients(setup, monkeypatch):
    _, model, drafter, target = setup
    data = seqs()
    batch = make_batch(data, 6, torch.Generator().manual_seed(4))
    feats = target.features(batch.tokens, batch.lengths)
    trainee = drafter.model
    for p in trainee.parameters():
        p.requires_grad_(True)
    full = dflash_loss(trainee, target, feats, batch, gamma=4.0)
    full.loss.backward()
    grads = {n: p.grad.clone() for n, p in trainee.named_parameters()}
    trainee.zero_grad()
    monkeypatch.setattr(objective, "LOGIT_ELEMENTS_PER_CHUNK", 7 * VOCAB)  # 7 rows per chunk
    chunked = dflash_loss(trainee, target, feats, batch, gamma=4.0)
    chunked.loss.backward()
    torch.testing.assert_close(chunked.loss, full.loss)
    for n, p in trainee.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], atol=1e-6, rtol=1e-4)
    assert all(g.abs().sum() > 0 for g in grads.values())
    # the loss by hand: per-row CE over the head with the mask logit removed, weighted per position
    with torch.no_grad():
        hidden = draft_hidden(trainee, target.embed, feats, batch)[:, :, 1:]
        labels, valid = block_labels(batch, BLOCK, MASK)
        logits = model.compute_logits(hidden[valid])
        logits[:, MASK] = float("-inf")
        ce = F.cross_entropy(logits, labels[valid], reduction="none")
        w = position_weights(BLOCK, 4.0)[torch.nonzero(valid)[:, 2]]
    torch.testing.assert_close(full.loss.detach(), (ce * w).sum() / w.sum())
    assert full.count.sum().item() == valid.sum().item() and full.num_blocks.item() == 18


def test_defaults_from_the_target():
    assert default_target_layer_ids(2) == [0, 1]
    assert default_target_layer_ids(30) == [1, 8, 14, 21, 27]
    assert default_mask_token_id(None, 1000) == 999
