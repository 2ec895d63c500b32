"""Generated protobuf modules for the envd wire protocol (see generate.sh).

The generated filesystem_pb2 refers to google/protobuf/timestamp.proto without
importing it, so the well-known type is loaded into the pool here first."""
from google.protobuf import timestamp_pb2 as _timestamp_pb2  # noqa: F401
