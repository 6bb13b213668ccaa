"""`carve status` when the cluster cannot answer: one sentence a user can act on, exit 1."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from carvecli.main import _taint_rules, main
from process.kube.errors import api_error


def _kubeconfig(tmp_path: Path, server: str) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    return str(path)


def test_an_unreachable_apiserver_is_named_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Port 1 on the loopback: nothing listens, the connection is refused at once.
    code = main(
        ["status", "--kubeconfig", _kubeconfig(tmp_path, "http://127.0.0.1:1")], io.StringIO()
    )
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("carve: cannot reach the apiserver:") and "refused" in err, err


def test_a_missing_kubeconfig_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["status", "--kubeconfig", str(tmp_path / "absent")], io.StringIO())
    assert code == 1
    assert f"cannot load kubeconfig {tmp_path / 'absent'}" in capsys.readouterr().err


class _Refusing:
    def __init__(self, status: int, message: str) -> None:
        self.status, self.message = status, message

    def request(self, method: str, path: str, **_: Any) -> dict[str, Any]:
        body = json.dumps({"kind": "Status", "message": self.message, "code": self.status})
        raise api_error(self.status, body)


def test_taint_rules_not_served_are_none_and_not_a_warning() -> None:
    warnings: list[str] = []
    assert (
        _taint_rules(_Refusing(404, "the server could not find the requested resource"), warnings)
        == []
    )
    assert warnings == []


def test_taint_rules_the_user_may_not_list_are_a_warning_in_the_servers_words() -> None:
    warnings: list[str] = []
    said = 'devicetaintrules.resource.k8s.io is forbidden: User "alice" cannot list resource'
    assert _taint_rules(_Refusing(403, said), warnings) == []
    assert warnings == [f"DeviceTaintRules not shown (HTTP 403): {said}"]
