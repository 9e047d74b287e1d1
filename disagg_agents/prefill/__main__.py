"""`python -m disagg_agents.prefill`: run the prefill agent."""

from disagg_agents.quant import check_supported
from disagg_agents.runtime.args import preflight

# A bad token file or checkpoint: one line before torch loads.
preflight("prefill", check_supported)

from disagg_agents.prefill.agent import main  # noqa: E402

main()
