"""The training corpus: the target's own responses to the training prompts, generated through our engine
(EngineCore: continuous batching, any supported model, greedy or seeded sampling) and kept in
`<out>/responses.jsonl`, one line per answered prompt:

    {"key": <prompt sha256>, "prompt_token_ids": [...], "token_ids": [...], "finish_reason": "stop"|"length"}

Resumable: each line is appended and flushed the moment its request finishes; a restart reads the keys already
there and generates only the rest (a line cut by a kill is ignored and its prompt answered again). Sampled
responses are seeded by the prompt's key, so a restart reproduces what an uninterrupted run would have written.
Also here: the engine loop shared with the evaluation (`run_requests`) and prompt encoding.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable

from engine.llm import encode_text
from engine.messages import Delta
from engine.request import SamplingParams
from engine.train.prompts import Prompt

logger = logging.getLogger("ddtree.train")
RESPONSES_FILE = "responses.jsonl"


def encode_prompt(tokenizer, prompt: Prompt, chat: bool) -> list[int]:
    """Token ids of a prompt: its own ids, or its text (as a user turn of the chat template when chat)."""
    if prompt.token_ids is not None:
        return list(prompt.token_ids)
    return encode_text(tokenizer, prompt.text, chat)


def run_requests(core, requests: Iterable[tuple[str, list[int], SamplingParams]],
                 on_finish: Callable[[str, list[int], Delta], None], max_in_flight: int,
                 progress=None) -> None:
    """Feeds (request id, prompt ids, sampling) to an EngineCore, at most max_in_flight at once, and calls
    on_finish(request id, output token ids, final Delta) as each finishes. A request the engine fails is logged
    and skipped; the others go on."""
    pending = iter(requests)
    tokens: dict[str, list[int]] = {}
    exhausted = False
    while True:
        while not exhausted and len(tokens) < max_in_flight:
            item = next(pending, None)
            if item is None:
                exhausted = True
                break
            rid, ids, sampling = item
            tokens[core.add_request(ids, sampling, request_id=rid)] = []
        if not tokens:
            return
        for delta in core.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
            if delta.finished:
                on_finish(delta.request_id, tokens.pop(delta.request_id), delta)
                if progress is not None:
                    progress.update(1)
        for error in core.pop_request_errors():
            logger.warning("request %s failed and is skipped: %s", error.request_id, error.message)
            tokens.pop(error.request_id, None)


def read_responses(path: str) -> list[dict]:
    """The complete lines of a responses file (a last line cut by a kill is dropped)."""
    if not os.path.isfile(path):
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def drop_cut_line(path: str) -> None:
    """Truncates a file after its last newline (a line cut by a kill goes; complete lines stay)."""
    if not os.path.isfile(path):
        return
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        pos = end
        while pos > 0:
            start = max(0, pos - (1 << 16))
            f.seek(start)
            newline = f.read(pos - start).rfind(b"\n")
            if newline >= 0:
                if start + newline + 1 < end:
                    f.truncate(start + newline + 1)
                return
            pos = start
        f.truncate(0)


def generate_responses(core, prompts: list[Prompt], path: str, *, chat: bool, max_prompt_tokens: int,
                       max_new_tokens: int, temperature: float, max_in_flight: int) -> dict:
    """Answers every prompt not yet in `path` with the engine `core` (an EngineCore of the target); returns counts."""
    from tqdm import tqdm

    done = {r["key"] for r in read_responses(path)}
    todo, too_long = [], 0
    for p in prompts:
        if p.key in done:
            continue
        ids = encode_prompt(core.tokenizer, p, chat)
        if len(ids) > max_prompt_tokens or len(ids) >= core.max_model_len - 1:
            too_long += 1
            continue
        todo.append((p.key, ids))
    counts = {"prompts": len(prompts), "already_done": len(done & {p.key for p in prompts}), "skipped_long": too_long,
              "generated": 0, "tokens": 0}
    drop_cut_line(path)
    prompt_of = dict(todo)

    def requests():
        for key, ids in todo:
            sampling = SamplingParams(max_tokens=min(max_new_tokens, core.max_model_len - len(ids)),
                                      temperature=temperature, seed=int(key[:15], 16), detokenize=False)
            yield key, ids, sampling

    with open(path, "a", encoding="utf-8") as out, tqdm(total=len(todo), desc="responses", unit="prompt") as bar:
        def write(key: str, token_ids: list[int], delta: Delta) -> None:
            record = {"key": key, "prompt_token_ids": prompt_of[key], "token_ids": token_ids,
                      "finish_reason": delta.finish_reason}
            out.write(json.dumps(record) + "\n")
            out.flush()
            counts["generated"] += 1
            counts["tokens"] += len(token_ids)

        run_requests(core, requests(), write, max_in_flight, progress=bar)
    logger.info("responses: %s", counts)
    return counts


def training_sequences(path: str, max_seq_len: int) -> list[tuple[list[int], int]]:
    """(prompt + response ids truncated to max_seq_len, prompt length) of every response with at least two
    response tokens inside the limit; responses to held-out prompts are never used, whatever wrote them."""
    seqs = []
    for r in read_responses(path):
        if Prompt(r["key"]).heldout:
            continue
        prompt, response = r["prompt_token_ids"], r["token_ids"]
        ids = (prompt + response)[:max_seq_len]
        if len(ids) - len(prompt) >= 2:
            seqs.append((ids, len(prompt)))
    return seqs
