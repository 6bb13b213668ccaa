"""A process that owns one real node with a running pod, then waits to be killed.

tests/realnode/test_teardown.py SIGKILLs it: nothing it started may survive it.

    python -m tests.realnode.owner_worker KUBECONFIG NODE_NAME READY_FILE
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from devcluster.cluster import api_client_for
from devcluster.waiting import wait_for
from process.kube.jsonclient import KubeJson
from realnode.cluster import RealNodes
from realnode.images import TEST_IMAGE
from realnode.node import RealNodeSpec


def main(kubeconfig: str, node_name: str, ready_file: str) -> int:
    api = api_client_for(Path(kubeconfig))
    nodes = RealNodes(Path(kubeconfig), api)
    node = nodes.add_node(RealNodeSpec(node_name, ("A100-SXM4-40GB",)))
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{node_name}-sleeper"},
        "spec": {
            "nodeName": node_name,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "c",
                    "image": TEST_IMAGE,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["sleep", "3600"],
                }
            ],
        },
    }
    json_api = KubeJson(api)
    path = f"/api/v1/namespaces/default/pods/{node_name}-sleeper"
    json_api.request("POST", "/api/v1/namespaces/default/pods", body=pod)

    def running() -> bool:
        return json_api.request("GET", path).get("status", {}).get("phase") == "Running"

    wait_for("the sleeper pod to run", running, timeout=90)
    Path(ready_file).write_text(
        json.dumps(
            {
                "root": str(nodes.root),
                "node_root": str(node.layout.root),
                "bridge": node.layout.bridge,
                "node_ip": node.layout.node_ip,
            }
        )
    )
    while True:
        time.sleep(60)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
