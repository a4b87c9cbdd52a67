"""DDTree speculative decoding: draft trees (tree.py) and their verification (verify.py)."""
