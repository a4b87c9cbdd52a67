"""DDTree speculative decoding: drafters (drafter.py protocol; ngram, dflash, oracle), draft trees (tree.py),
their verification (verify.py) and the runner-side round (speculator.py)."""
