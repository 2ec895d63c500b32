"""aenv's in-guest agent: an E2B-envd-compatible HTTP + Connect-RPC server."""

# The guest TCP port envd listens on (E2B's SDKs assume it: ConnectionConfig.envdPort). The one
# definition: the host side (vmm.net, the CLI) imports it from here; the guest's init passes it.
ENVD_PORT = 49983
