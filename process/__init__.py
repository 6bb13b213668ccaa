"""What every carve binary needs around its domain logic.

`carve-controller` and `carve-kubelet-plugin` decide different things, but they start, are
configured, log, answer probes and write to the apiserver the same way. Keeping that here, once,
is what keeps the two consistent for an operator (one flag syntax, one log shape, one set of
probe paths) and keeps `driver/` the shared domain core it is meant to be.

- `flags`: flags declared once with their `CARVE_<FLAG>` environment twin, default and help;
  the groups both binaries share; deprecated spellings; usage errors (exit 2).
- `kubeconfig`: the API client from a kubeconfig file, else the in-cluster config.
- `rmw`: read-modify-write of one API object with conflict retries, a fence and clear errors.
- `logformat`: JSON-lines or text logs, one shape for every process.
- `opshttp`: /healthz, /readyz and /metrics.
"""
