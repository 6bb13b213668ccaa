"""carve's one edge to the Kubernetes API: the JSON client (`jsonclient`), the error
vocabulary every caller branches on (`errors`), read-modify-write of objects other writers
change too (`rmw`), the one way to add and remove a finalizer (`finalizers`), the one
list-and-watch loop (`listwatch`), the one Event writer (`events`) and the count of every
request a client sends (`requestcount`).

Objects cross this edge as the API serves them: plain JSON dicts with camelCase keys (`Obj`),
never the generated models, which validate strictly and lag behind the apiserver.
"""

from __future__ import annotations

from driver.apiobject import Obj  # defined in the shared core, which may not import this

__all__ = ["Obj"]
