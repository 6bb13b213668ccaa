"""A refusal is the error class of its status, whoever raised it."""

from __future__ import annotations

import pytest
from kubernetes.client.exceptions import ApiException

from process.kube.errors import (
    ApiError,
    ConflictError,
    ForbiddenError,
    GoneError,
    NotFoundError,
    api_error,
    status_of,
)


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (403, ForbiddenError),
        (404, NotFoundError),
        (409, ConflictError),
        (410, GoneError),
        (422, ApiError),
        (500, ApiError),
    ],
)
def test_each_status_gets_its_class_and_keeps_the_body(status: int, kind: type) -> None:
    err = api_error(status, '{"message": "nope"}')
    assert type(err) is kind
    assert err.status == status and "nope" in str(err)


def test_status_is_read_from_the_official_client_and_from_ours() -> None:
    assert status_of(ApiException(status=409, reason="Conflict")) == 409
    assert status_of(api_error(404, "")) == 404
    assert status_of(ConnectionResetError()) is None
