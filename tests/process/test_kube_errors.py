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
    message_of,
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


def test_the_apiservers_sentence_is_read_from_either_client_and_nothing_else_is_invented() -> None:
    status = '{"kind": "Status", "message": "resourceclaims \\"c\\" is forbidden: no"}'
    theirs = ApiException(status=403, reason="Forbidden")
    theirs.body = status
    assert message_of(theirs) == 'resourceclaims "c" is forbidden: no'
    assert message_of(api_error(403, status)) == 'resourceclaims "c" is forbidden: no'
    assert message_of(api_error(502, "<html>bad gateway</html>")) == "<html>bad gateway</html>"
    assert message_of(api_error(500, "x" * 1000)) == "x" * 300
    assert message_of(ConnectionResetError("reset by peer")) == "reset by peer"
