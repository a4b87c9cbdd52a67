"""Cost of structured output on the host (llguidance, engine/structured.py): the tokenizer's llguidance view
(once per engine), compiling a schema into a request's matcher (once per request, over the 20 schemas of
tests/server/test_structured.py), and one token bitmask (every constrained row of every step), on the embedded
SmolLM2 tokenizer (49,152 tokens). Prints three lines; not a test.

    .venv/bin/python bench/grammar.py
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers import AutoTokenizer  # noqa: E402

from engine.grammar import json_schema_grammar  # noqa: E402
from engine.model.embedded import embedded_model_dir  # noqa: E402
from engine.structured import Constraint, grammar_tokenizer  # noqa: E402
from tests.server.test_structured import SCHEMAS  # noqa: E402

DOC = '{"name": "Ada Lovelace", "age": 36, "hobbies": ["math", "poetry"], "city": "London"}'
DOC_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                "hobbies": {"type": "array", "items": {"type": "string"}},
                                                "city": {"type": "string"}},
              "required": ["name", "age", "hobbies", "city"]}


def main() -> None:
    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    t0 = time.perf_counter()
    ll = grammar_tokenizer(tok, len(tok), [tok.eos_token_id])
    print(f"tokenizer view: {time.perf_counter() - t0:.3f} s")
    compile_s = []
    for _, schema in SCHEMAS:
        t0 = time.perf_counter()
        Constraint(ll, json_schema_grammar(schema))
        compile_s.append(time.perf_counter() - t0)
    print(f"schema -> matcher: median {statistics.median(compile_s) * 1e3:.2f} ms, max {max(compile_s) * 1e3:.2f} ms "
          f"({len(compile_s)} schemas)")
    ids, mask_s = tok.encode(DOC, add_special_tokens=False), []
    grammar = json_schema_grammar(DOC_SCHEMA)
    for _ in range(5):
        c = Constraint(ll, grammar)
        for t in ids:
            t0 = time.perf_counter()
            c.mask()
            mask_s.append(time.perf_counter() - t0)
            assert c.commit(t)
    mask_s.sort()
    print(f"bitmask per token: median {statistics.median(mask_s) * 1e6:.1f} us, p90 "
          f"{mask_s[int(0.9 * len(mask_s))] * 1e6:.1f} us, max {mask_s[-1] * 1e6:.1f} us ({len(mask_s)} tokens)")


if __name__ == "__main__":
    main()
