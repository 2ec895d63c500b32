#!/bin/sh
# Regenerate process_pb2.py / filesystem_pb2.py from the .proto files here.
# Needs grpcio-tools (test extra). Output is committed so envd needs no protoc at runtime.
set -eu
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
"$PY" -m grpc_tools.protoc -I. --python_out=. process.proto filesystem.proto
