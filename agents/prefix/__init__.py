"""Prompt-prefix reuse: K/V of prompt prefixes seen before, kept in blocks.

- `store`: the block store both roles share (chained block keys, LRU by bytes).
- `prefill_side`: the prefill agent's cache of torch K/V (computes only a suffix).
- `decode_side`: the decode agent's cache of received or computed K/V (asks only for a suffix).
"""
