"""Real nodes: the upstream kubelet and containerd running carve's plugin on this machine."""
