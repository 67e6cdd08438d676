"""The error every API of the policy endpoint raises: answered in the shape of the API that was
called (OpenAI's here; `agentgrpo.agents.anthropic` converts it to Anthropic's)."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse


class APIError(Exception):
    """A request the endpoint answers with OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status,
            message,
            param,
            code,
            kind,
        )

    def response(self) -> JSONResponse:
        return JSONResponse(
            {
                "error": {
                    "message": self.message,
                    "type": self.kind,
                    "param": self.param,
                    "code": self.code,
                }
            },
            self.status,
        )


def check_model(name: Any, served: str) -> str:
    """The model name a reply carries: the served one. No name is taken as the served one (vLLM
    does the same); another name is a 404, as OpenAI and vLLM answer."""
    if name is None:
        return served
    if name != served:
        raise APIError(
            404,
            f"The model `{name!s:.100}` does not exist: this endpoint serves `{served}`",
            param="model",
            code="model_not_found",
        )
    return served
