"""Generated protobuf and gRPC stubs of splitspec.v1 (do not edit; run protos/generate.py)."""
