"""The error a request that the engine refuses before queueing raises."""


class InvalidRequestError(ValueError):
    """A request is refused before anything is queued. `param`: the request field it is about (the
    OpenAI error's `param`); `code`: an OpenAI error code ("context_length_exceeded") or None."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code
