"""The one error the API conversions raise: a body field the engine's request model
refuses. The router answers it as a 400 of its own; the simulated engine as vLLM's
validation does (``bench.sim.request_fields``)."""

from __future__ import annotations


class InvalidBody(ValueError):
    """``field`` (a body field, "" for the body itself) refused with ``message``.

    ``validation``: refused by the request model's validation (vLLM answers those in
    pydantic's words, with ``error_type``); else by the server's own check after it.
    """

    def __init__(
        self, field: str, message: str, error_type: str = "value_error", validation: bool = True
    ) -> None:
        super().__init__(message)
        self.field = field
        self.message = message
        self.error_type = error_type
        self.validation = validation
