"""The control plane's side of nodes: the Node model (a machine running the node agent),
placement (which node gets a sandbox), the gateway that sends a task to a node's queue and
awaits its result (``client``), and the protocol both sides share (``protocol``). The
agent itself is ``agent``; this package never imports it. ``metrics_auth``: the bearer check of
every ``/metrics``."""
