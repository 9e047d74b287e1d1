"""`python -m agents.prefill`: run the prefill agent."""

from agents.runtime.server import preflight

preflight("prefill")  # a bad token file or checkpoint: one line before torch loads

from agents.prefill.agent import main  # noqa: E402

main()
