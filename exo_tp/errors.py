"""Errors meant for the user: the CLI prints them as one line, the API as OpenAI-style JSON."""


class ExoTpError(Exception):
    """A problem the user can act on; its message is one readable line."""


class PlanError(ExoTpError):
    """No shard plan fits the model and devices; the message says why."""


class UnsupportedArchitectureError(ExoTpError):
    """The model's architecture has no tensor-parallel table."""
