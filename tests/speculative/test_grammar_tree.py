"""Grammar-aware DDTree on the embedded SmolLM2 (CPU): with a JSON schema, greedy DDTree output equals plain
constrained decoding token for token (n-gram drafter, and an oracle drafter whose distractors the grammar
forbids), forbidden candidates are pruned before verification (counted), and every output is schema-valid."""
from __future__ import annotations

import json

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.grammar import json_schema_grammar
from engine.speculative.oracle import OracleDrafter

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["chess", "music", "travel", "code"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
PROMPTS = ["Describe a person named Ann as JSON.", "A JSON profile of a chess player, please."]


def run(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> tuple[list[list[int]], int, list[int]]:
    """Outputs, grammar-pruned nodes and accept lengths, stepping the engine by hand to read every step's stats."""
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(**vars(sp))) for p in prompts]
    outs, pruned, accepts = {i: [] for i in ids}, 0, []
    while engine.has_unfinished():
        for delta in engine.step():
            outs[delta.request_id].extend(delta.new_token_ids)
        if engine.last_stats is not None:
            pruned += engine.last_stats.num_grammar_pruned
            accepts += engine.last_stats.accept_lengths
    return [outs[i] for i in ids], pruned, accepts


@pytest.fixture(scope="module")
def plain():
    llm = LLM()
    prompts = [llm.encode(p, chat=True) for p in PROMPTS]
    sp = SamplingParams(max_tokens=64, temperature=0, grammar=json_schema_grammar(SCHEMA))
    outs, _, _ = run(llm, prompts, sp)
    return llm, prompts, sp, outs


def test_plain_constrained_output_is_valid(plain):
    llm, _, _, outs = plain
    for out in outs:
        jsonschema.validate(json.loads(llm.tokenizer.decode(out, skip_special_tokens=True)), SCHEMA)


def test_ngram_ddtree_equals_plain_constrained(plain):
    _, prompts, sp, ref = plain
    outs, _, accepts = run(LLM(drafter="ngram", spec_budget=4, adaptive=False), prompts, sp)
    assert outs == ref and accepts


def test_oracle_distractors_are_pruned_and_output_is_unchanged(plain):
    """The oracle proposes the reference continuation at rank 0 and deterministic distractor ids below it; the
    grammar forbids most distractors, so the tree fills its budget with legal nodes only."""
    llm, prompts, sp, ref = plain
    golden = {tuple(p): p + r for p, r in zip(prompts, ref)}
    oracle = OracleDrafter(lambda r: _lookup(golden, r.token_ids), llm.engine.vocab_size, horizon=6,
                           num_distractors=6)
    outs, pruned, accepts = run(LLM(drafter=oracle, spec_budget=6, adaptive=False), prompts, sp)
    assert outs == ref
    assert pruned > 0 and sum(accepts) / len(accepts) > 2.0, (pruned, accepts)


def _lookup(golden: dict, token_ids: list[int]):
    return next((g for p, g in golden.items() if tuple(token_ids[:len(p)]) == p), None)
