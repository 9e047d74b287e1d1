"""Prompt-prefix reuse: the block store both roles share (chained block keys, LRU
by bytes; store: memory, disk: its tier on disk). Each role's prefix cache over it,
which reuses a request's K/V rows, lives with its process:
`disagg_agents.prefill.prefixcache` (torch K/V: computes only a suffix) and
`disagg_agents.decode.prefixcache` (received or computed K/V: asks only for a suffix).
"""
