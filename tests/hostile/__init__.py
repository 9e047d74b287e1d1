"""Hostile input, by what it attacks: the gateway, the agents, the wire, the fleet."""
