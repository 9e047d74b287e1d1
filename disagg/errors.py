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


class ModelMismatch(AgentError):
    """Prefill and decode agents hold different models."""


class ConnectError(DisaggError):
    """An agent or host could not be reached."""


class AuthError(DisaggError):
    """An agent refused our token, or we have none for an agent that wants one."""
