"""The code interpreter's server: what the unchanged ``e2b-code-interpreter`` SDKs (PyPI,
npm ``@e2b/code-interpreter``) talk to on guest port 49999 of a ``code-interpreter-v1``
sandbox (spec e2b-code-interpreter.md), backed by Jupyter kernels driven with
``jupyter_client``. It runs in the guest with its own small dependencies (starlette,
uvicorn, jupyter_client, ipykernel): nothing here imports aenv.

| module | job |
|---|---|
| ``app`` | the HTTP routes, request checks, the streamed ``/execute`` body |
| ``contexts`` | contexts (one kernel each), defaults per language, one execution at a time per context |
| ``kernel`` | one kernel: start, a cell's messages → events, interrupt, restart |
| ``events`` | the wire events (JSON lines) made from kernel messages |
| ``languages`` | the kernel and the silent snippets (cwd, env vars) of each language |
| ``envs`` | the sandbox-wide env vars, from envd |
| ``ipython_extension`` | the Python kernel's extra formats: charts, DataFrames, JSON, PIL images |
| ``js_kernel`` | a small JavaScript kernel on the guest's Node.js |
"""
