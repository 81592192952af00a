"""The error of a rank whose batch no longer matches the conductor's."""


class DivergedError(RuntimeError):
    """This rank's batch no longer matches the conductor's (a bug: the epoch must end)."""
