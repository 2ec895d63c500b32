"""aenv's in-guest agent: an E2B-envd-compatible HTTP + Connect-RPC server."""
