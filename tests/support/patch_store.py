"""A stand-in for the apiserver's patches of one collection of objects, behind the JSON
client's `request`: merge patches guarded by `metadata.resourceVersion` (409 when stale), JSON
patches (422 when a `test` fails) and strategic merges of the finalizer list. For the writers of
both programs (tests/controller/test_status.py, tests/kubeletplugin/test_claims_finalizers.py,
tests/process/test_kube_finalizers.py); the real apiserver is in the cluster suites."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from driver.apiobject import Obj
from process.kube.errors import api_error


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch, as the apiserver applies `application/merge-patch+json`."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _pointer(path: str) -> list[str]:
    """An RFC 6901 pointer's reference tokens, unescaped."""
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def json_patch(target: Obj, ops: list[Obj]) -> Obj:
    """RFC 6902 `test`, `replace`, `remove` and `add` as the apiserver applies them (422 on a
    failed test or a missing path)."""
    out = copy.deepcopy(target)
    for op in ops:
        *parents, last = _pointer(op["path"])
        node: Any = out
        try:
            for part in parents:
                node = node[int(part)] if isinstance(node, list) else node[part]
            key: Any = int(last) if isinstance(node, list) and last != "-" else last
            if op["op"] == "test" and op["value"] is None and isinstance(node, dict):
                # The apiserver's json-patch: a null value tests a member missing (or null).
                if node.get(key) is not None:
                    raise KeyError(op["path"])
                continue
            if op["op"] == "test" and node[key] != op["value"]:
                raise KeyError(op["path"])
            if op["op"] == "replace":
                if key not in (range(len(node)) if isinstance(node, list) else node):
                    raise KeyError(op["path"])  # RFC 6902: the target must exist
                node[key] = copy.deepcopy(op["value"])
            if op["op"] == "remove":
                del node[key]
            if op["op"] == "add" and isinstance(node, dict):
                node[key] = copy.deepcopy(op["value"])
            elif op["op"] == "add":
                node.append(op["value"]) if key == "-" else node.insert(key, op["value"])
        except (KeyError, IndexError, TypeError) as exc:
            raise api_error(422, "Unprocessable Entity") from exc
    return out


class VersionedStore:
    """Merge patches guarded by `metadata.resourceVersion` (409 when stale), JSON patches
    (their `test` operations guard them) and strategic merges of the finalizer list (a union,
    new entries first; the uid they carry must match); only the status subresource changes
    status, and nothing may change a claim's spec."""

    def __init__(self) -> None:
        self.objs: dict[tuple[str, str], Obj] = {}
        self.rv = 10
        self.puts = 0
        self.kinds: list[str] = []  # the content type of every patch, in order
        self.before_put: Callable[[Obj], None] | None = None

    def add(self, obj: Obj) -> Obj:
        self.rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.objs[(obj["metadata"]["namespace"], obj["metadata"]["name"])] = obj
        return copy.deepcopy(obj)

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: Sequence[tuple[str, str]] = (),
        content_type: str = "application/json",
    ) -> Obj:
        """The JSON client's one call: a GET or a PATCH of a claim or pod (`/status` too)."""
        parts = path.strip("/").split("/")
        i = parts.index("namespaces")
        ns, name, status = parts[i + 1], parts[i + 3], parts[-1] == "status"
        if method == "GET":
            return self._read(name, ns)
        assert method == "PATCH", (method, path)
        return self._patch(name, ns, body, status, content_type)

    def _read(self, name: str, ns: str) -> Obj:
        if (ns, name) not in self.objs:
            raise api_error(404, "Not Found")
        return copy.deepcopy(self.objs[(ns, name)])

    def _patch(self, name: str, ns: str, body: Any, status: bool, content_type: str) -> Obj:
        self.puts += 1
        self.kinds.append(content_type)
        if self.before_put is not None:
            hook, self.before_put = self.before_put, None
            hook(self.objs[(ns, name)])
        cur = self.objs.get((ns, name))
        if cur is None:
            raise api_error(404, "Not Found")
        if content_type == "application/json-patch+json":
            return self.add(json_patch(cur, body))
        if content_type == "application/strategic-merge-patch+json":
            if body["metadata"].get("uid") != cur["metadata"]["uid"]:
                raise api_error(422, "metadata.uid: field is immutable")
            new = copy.deepcopy(cur)
            have = new["metadata"].get("finalizers") or []
            added = [f for f in body["metadata"]["finalizers"] if f not in have]
            if added and cur["metadata"].get("deletionTimestamp"):
                raise api_error(422, "no new finalizers while deleting")
            new["metadata"]["finalizers"] = added + have  # the apiserver puts new entries first
            return self.add(new)
        assert content_type == "application/merge-patch+json"
        if body["metadata"]["resourceVersion"] != cur["metadata"]["resourceVersion"]:
            raise api_error(409, "Conflict")
        assert "spec" not in body or "schedulingGates" in body["spec"], "spec patched"
        new = merge_patch(cur, body)
        if status:
            new["metadata"] = cur["metadata"]
        else:
            new["status"] = cur.get("status", {})
        return self.add(new)
