"""The client's base error, in a module of its own so that every other module can raise it
without importing the client."""


class StokerError(RuntimeError):
    """Base class of the client's errors."""
