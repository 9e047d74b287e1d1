"""`python -m agents.decode`: run the decode agent."""

from agents.decode.agent import main

main()
