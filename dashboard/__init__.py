"""The team dashboard: server-rendered pages (``views``), the actions that call the
lifecycle (``actions``) and the terminal (``terminal``: a Channels consumer bridging the
browser's xterm.js to a PTY in the sandbox through ``envd_client``)."""
