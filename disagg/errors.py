"""One exception root; the CLI turns any of these into one red line and exit 1."""


class DisaggError(Exception):
    """Base of every error a user can act on. The message says what to do."""


class UsageError(DisaggError):
    """Bad arguments or request parameters; `param` names the request field, if one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelError(DisaggError):
    """A model dir that is missing, unreadable, or of an unsupported architecture."""


class AgentError(DisaggError):
    """An agent failed to start, crashed, or answered with an error."""


class RequestTimeout(AgentError):
    """A request ran past the total deadline its caller set (the agent was still
    working: it is not marked down)."""


class ModelMismatch(AgentError):
    """Prefill and decode agents hold different models."""


class Overloaded(DisaggError):
    """The gateway is at its admission limit: retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ConnectError(DisaggError):
    """An agent or host could not be reached."""


class AuthError(DisaggError):
    """An agent refused our token, or we have none for an agent that wants one."""
