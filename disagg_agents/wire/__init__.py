"""The wire between agents and clients: frames, auth and seal, the request and
answer types, K/V codecs. Standard library and numpy only: no torch, no mlx."""
