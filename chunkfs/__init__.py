"""Lazily filled files over a bounded node-local chunk cache (issue 24)."""
