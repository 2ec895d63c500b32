"""PyInstaller entry for the real envd: runs `python -m envd` semantics inside the frozen bundle."""

import runpy

runpy.run_module("envd", run_name="__main__", alter_sys=True)
