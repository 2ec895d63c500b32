"""Generated protobuf modules for the envd wire protocol (see generate.sh)."""
