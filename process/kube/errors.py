"""What the apiserver said when it refused: one hierarchy both programs branch on.

Callers catch the condition they handle (`NotFoundError`, `ConflictError`, `GoneError`,
`ForbiddenError`) instead of comparing status numbers. `status_of` and `message_of` also read
the official client's `ApiException` (the tests' own typed clients raise it), so one function
answers for both.
"""

from __future__ import annotations

import json


class ApiError(Exception):
    """A non-2xx answer from the apiserver; `status` is the HTTP status, `body` its text."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status
        self.body = body

    @property
    def message(self) -> str:
        """The apiserver's own sentence (its Status object's `message`), for a user to read;
        the body's start where the answer is not a Status."""
        return _status_message(self.body)


class ForbiddenError(ApiError):
    """403: RBAC or an admission policy refused (the body says which)."""


class NotFoundError(ApiError):
    """404: no such object (or no such resource on this apiserver)."""


class ConflictError(ApiError):
    """409: the object changed since it was read, or already exists."""


class GoneError(ApiError):
    """410: a watch's resourceVersion is too old; list again."""


_BY_STATUS: dict[int, type[ApiError]] = {
    403: ForbiddenError,
    404: NotFoundError,
    409: ConflictError,
    410: GoneError,
}


def api_error(status: int, body: str) -> ApiError:
    """The error for an answer with this status: the specific class where there is one."""
    return _BY_STATUS.get(status, ApiError)(status, body)


def message_of(exc: BaseException) -> str:
    """What an API error says, for a user to read: the apiserver's own sentence from an
    `ApiError` or the official client's `ApiException` (it names the object and the field),
    ``str(exc)`` for anything else (a dropped connection)."""
    body = getattr(exc, "body", None)
    return _status_message(str(body)) if body else str(exc)


def _status_message(body: str) -> str:
    try:
        status = json.loads(body)
    except ValueError:
        return body[:300]
    text = status.get("message") if isinstance(status, dict) else None
    return str(text) if text else body[:300]


def status_of(exc: BaseException) -> int | None:
    """The HTTP status an API error carries (`ApiError`, or the official client's
    `ApiException`), None for anything else (a dropped connection has none)."""
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None
