"""`Obj`: a Kubernetes API object as JSON (camelCase keys), the shape every module reads.

It lives in the shared core so that `driver/` (which may import nothing of `process/`) and
`process.kube`, which re-exports it as the API edge's object type, name one type.
"""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]
"""An API object as JSON (camelCase keys), the shape both programs read and write."""
