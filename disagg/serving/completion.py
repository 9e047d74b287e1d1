"""An answer as the control plane hands it out, one shape at every layer.

The wire client (`wireclient.generate`), the router (`Router.run`) and the Python
API (`Client.generate`) return a `Completion`, read from the decode agent's DONE
frame (`disagg_agents.wire.answer.Done`) and completed on the way: the client's own
timings, the route, the pipeline's name, a stop sequence's cut. A stream
(`Client.generate(stream=True)`) yields `Chunk`s, the pieces of one Completion:
answer and reasoning text as they come, and last a chunk with done=True holding
the whole Completion.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from disagg_agents.wire.answer import Done, Metrics, ToolCall


@dataclass
class Completion:
    text: str  # the answer: never the model's reasoning nor its tool-call markup
    token_ids: list[int]
    metrics: Metrics
    # "stop" (EOS or a stop sequence), "length", "tool_calls", or "cancelled" (the
    # caller left: `cancel` was set)
    finish_reason: str = "stop"
    model: str = ""  # the pipeline that answered ("" from the bare wire client)
    reasoning: str = ""  # the model's private reasoning (harmony analysis, <think>)
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)  # one per token, when asked
    prompt_ids: list[int] | None = None  # the prompt's token ids, when asked
    stop_sequence: str | None = None  # the stop sequence that ended the answer, if one did

    @classmethod
    def from_done(cls, done: Done, logprobs: list[np.ndarray] | None = None) -> Completion:
        """The decode agent's DONE, with the LOGPROBS frames that came before it."""
        return cls(
            done.text,
            done.token_ids,
            done.metrics,
            done.finish_reason or "stop",
            reasoning=done.reasoning,
            tool_calls=done.tool_calls,
            logprobs=logprobs or [],
            prompt_ids=done.prompt_ids,
        )


@dataclass
class Chunk:
    """A piece of a streamed Completion."""

    text: str  # answer text since the previous chunk
    done: bool = False  # the last chunk: `completion` holds the whole answer
    completion: Completion | None = None
    reasoning: str = ""  # reasoning text since the previous chunk, apart from the answer
    # The first token's metrics (the prompt's side: which path ran), on a chunk of
    # their own before its text: what a gateway's verdict header says for a stream.
    metrics: Metrics | None = None
