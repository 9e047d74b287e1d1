"""`python -m disagg_agents.decode`: run the decode agent."""

import sys

# The decode role runs on mlx and needs no torch. Where torch is installed as well
# (a host that can run both roles), transformers, which mlx-lm's tokenizers import,
# would import it anyway: 2-3 s of every start. Hidden, transformers finds no torch,
# as on a decode-only host.
sys.modules.setdefault("torch", None)  # type: ignore[arg-type]

from disagg_agents.quant import check_supported  # noqa: E402
from disagg_agents.runtime.args import preflight  # noqa: E402

# A bad token file or checkpoint: one line before mlx loads.
preflight("decode", check_supported)

from disagg_agents.decode.agent import main  # noqa: E402

main()
