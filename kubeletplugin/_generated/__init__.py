"""Generated gRPC stubs for the kubelet plugin contracts. Do not edit.

Produced by hack/gen_protos.py from proto/*.proto.
"""
