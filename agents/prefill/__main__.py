"""`python -m agents.prefill`: run the prefill agent."""

from agents.quant import check_supported
from agents.runtime.server import preflight

# A bad token file or checkpoint: one line before torch loads.
preflight("prefill", check_supported)

from agents.prefill.agent import main  # noqa: E402

main()
