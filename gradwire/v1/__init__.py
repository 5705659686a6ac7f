"""Generated protobuf and gRPC stubs for the gradwire.v1 wire contract. Do not edit.

Every ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` here is generated from proto/gradwire/v1/*.proto;
change the .proto and regenerate with ``python scripts/gen_protos.py``. tests/unit/test_proto_stubs.py
fails when these files differ from a fresh regeneration. Outside ``compression/serde.py`` (and the
network layers), code works with the plain dataclasses, not these types.
"""
