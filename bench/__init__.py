"""Benchmarks: scripts that print a table and write JSON under bench/results/ (never timed
assertions in tests)."""
