"""`python -m agents.prefill`: run the prefill agent."""

from agents.prefill.agent import main

main()
