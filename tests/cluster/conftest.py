"""The control-plane regression suite shares one cluster per session (devcluster plugin)."""

pytest_plugins = ["devcluster.pytest_plugin"]
