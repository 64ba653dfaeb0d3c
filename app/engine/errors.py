"""Typed errors of the engine. Every error a caller can cause is an InvalidRequestError."""


class InvalidRequestError(ValueError):
    """The request is invalid; the message says which field and what to do. Nothing was changed."""
