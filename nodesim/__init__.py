"""Test tooling that plays the node's other parties (the kubelet's DRA side); never shipped."""
