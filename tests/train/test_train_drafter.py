"""`ddtree train-drafter` end to end on a tiny random target: its own greedy responses to synthetic prompts are
the corpus; a few hundred steps lower the drafter's loss and raise tau far above an untrained drafter's; the
output folder loads through --draft-model (LLM and the CLI) and greedy DDTree with it equals plain decoding;
resuming continues from the checkpoint; bad settings are one-line errors."""
from __future__ import annotations

import json
import os

import pytest
import torch

from engine import LLM, SamplingParams
from engine.train.checkpoint import save_drafter
from engine.train.config import TrainConfig
from engine.train.prompts import make_prompt
from engine.train.run import drafter_config, train_drafter
from engine.train.trainer import init_drafter
from server.cli import main

BLOCK, STEPS, VOCAB = 8, 300, 64


def synthetic_prompts(path: str, count: int = 400) -> list[list[int]]:
    """Token-id prompts (the tiny target has no tokenizer): random ids of random lengths, as a .jsonl source."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(count)]
    with open(path, "w") as f:
        for ids in prompts:
            f.write(json.dumps({"prompt_token_ids": ids}) + "\n")
    return prompts


def small_vocab_target(folder: str) -> str:
    """A tiny random Llama with a 64-token vocabulary: its greedy continuations are a random function of the
    context over few tokens, which a one-layer drafter can learn in a few hundred CPU steps (over the 1000-token
    test models it needs thousands)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    folder = small_vocab_target(str(root / "target"))
    prompts_file = str(root / "prompts.jsonl")
    prompts = synthetic_prompts(prompts_file)
    out = str(root / "drafter")
    config = TrainConfig(target=folder, prompts=(prompts_file,), out=out, chat=False, max_new_tokens=48,
                         block_size=BLOCK, num_layers=1, max_steps=STEPS, batch_size=8, anchors=32, lr=1e-2,
                         log_every=50, save_every=100, eval_prompts=8, eval_max_tokens=32, eval_budget=8,
                         max_num_seqs=16)
    summary = train_drafter(config)
    heldout = [ids for ids in prompts if make_prompt(token_ids=ids).heldout]
    return folder, config, summary, heldout


def log_lines(out: str) -> list[dict]:
    with open(os.path.join(out, "train_log.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_training_lowers_the_loss_and_raises_tau(trained, tmp_path):
    folder, config, summary, heldout = trained
    assert summary["responses"]["generated"] == summary["train_prompts"] > 350 and len(heldout) >= 8
    log = log_lines(config.out)
    assert [r["step"] for r in log] == list(range(50, STEPS + 1, 50))
    assert log[-1]["loss"] < 0.8 * log[0]["loss"], [r["loss"] for r in log]
    assert len(log[-1]["accuracy"]) == BLOCK - 1 and log[-1]["accuracy"][0] > 0.5
    assert log[-1]["accuracy"][0] > log[0]["accuracy"][0] + 0.2
    # tau of the trained drafter (the eval stage, held-out prompts) against an untrained one of the same shape
    trained_tau = {r["mode"]: r["tau"] for r in summary["eval"]}
    untrained = str(tmp_path / "untrained")
    llm = LLM(model=folder)
    hf_cfg = drafter_config(config, llm.engine.loaded)
    save_drafter(untrained, init_drafter(hf_cfg, seed=1, device="cpu"), hf_cfg, "fp32")
    from engine.train.evaluate import measure

    ids = [i for i in heldout][:8]
    assert ids, "the synthetic prompts hold held-out ones"
    base = llm.config
    before = measure(llm.engine.loaded, base, ids, "ddtree", draft_model=untrained, budget=8, max_tokens=32)
    assert before.tau < 1.3
    assert trained_tau["ddtree"] > 2.0 and trained_tau["ddtree"] > before.tau + 1.0, (trained_tau, before.tau)
    assert trained_tau["chain"] > before.tau + 1.0
    with open(os.path.join(config.out, "eval.json")) as f:
        assert json.load(f)["results"][1]["tau"] == trained_tau["ddtree"]


def test_folder_round_trips_and_greedy_ddtree_equals_plain(trained):
    folder, config, _, heldout = trained
    files = sorted(os.listdir(config.out))
    assert {"config.json", "model.safetensors", "responses.jsonl", "train_state.pt"} <= set(files)
    with open(os.path.join(config.out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["block_size"] == BLOCK and cfg["dflash_config"]["target_layer_ids"] == [0, 1]
    assert cfg["vocab_size"] == VOCAB and cfg["num_target_layers"] == 2
    greedy = SamplingParams(max_tokens=40, temperature=0)
    plain = LLM(model=folder).generate(heldout[:4], greedy)
    spec = LLM(model=folder, drafter="dflash", draft_model=config.out, adaptive=False).generate(heldout[:4], greedy)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(sum(o.stats["spec"]["accepted_per_depth"]) for o in spec) > 40  # the drafter is really used


def test_cli_generate_with_the_trained_drafter(trained, capsys):
    folder, config, _, heldout = trained
    ids = ",".join(map(str, heldout[0]))
    assert main(["generate", folder, "--prompt-ids", ids, "--max-tokens", "24", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["generate", folder, "--prompt-ids", ids, "--max-tokens", "24", "--json",
                 "--draft-model", config.out, "--no-adaptive"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"] and spec["mean_accept_length"] > 1.5


def test_resume_continues_from_the_checkpoint(trained, tmp_path):
    folder, config, _, _ = trained
    import dataclasses
    import shutil

    out = str(tmp_path / "resumed")
    shutil.copytree(config.out, out)
    more = dataclasses.replace(config, out=out, stages=("train",), max_steps=STEPS + 20, log_every=10)
    summary = train_drafter(more)
    steps = [r["step"] for r in log_lines(out)]
    assert steps[-2:] == [STEPS + 10, STEPS + 20] and summary["train"]["step"] == STEPS + 20
    # another architecture in the same folder is refused, naming the difference
    other = dataclasses.replace(more, num_layers=2, max_steps=STEPS + 30)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        train_drafter(other)


def test_bad_settings_are_one_line_errors(tmp_path, capsys):
    assert main(["train-drafter", "--prompts", "sharegpt"]) == 2
    assert "needs --out" in capsys.readouterr().err
    assert main(["train-drafter", "--out", str(tmp_path), "--prompts", str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "no such prompt file" in err and len(err.strip().splitlines()) == 1


def test_the_shipped_drafter_loads_for_the_embedded_model_and_keeps_greedy_output():
    """engine/drafters/smollm2-135m-instruct: --drafter dflash without --draft-model on the embedded model."""
    from engine.drafters import shipped_drafter_dir

    prompt = "Write a short note to a friend about a road trip."
    greedy = SamplingParams(max_tokens=32, temperature=0)
    plain = LLM().generate([prompt], greedy, chat=True)[0]
    llm = LLM(drafter="dflash", adaptive=False)
    assert llm.config.spec.draft_model == shipped_drafter_dir()
    spec = llm.generate([prompt], greedy, chat=True)[0]
    assert spec.token_ids == plain.token_ids
    assert sum(spec.stats["spec"]["accepted_per_depth"]) > 0  # a trained drafter: some drafts are accepted
