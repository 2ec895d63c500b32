"""``python -m code_interpreter``: the server on 0.0.0.0:49999 (the guest's start command
in the ``code-interpreter-v1`` template) or wherever ``--host``/``--port`` say."""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
from pathlib import Path

import uvicorn

from .app import create_app
from .contexts import Contexts

PORT = 49999  # the port the SDKs assume (e2b_code_interpreter.constants.JUPYTER_PORT)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m code_interpreter", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=PORT)
    parser.add_argument("--cwd", default="/home/user", help="working directory of the default contexts")
    parser.add_argument("--runtime-dir", type=Path, default=None,
                        help="where the kernels' connection files and IPC sockets go (default: a temp dir)")
    parser.add_argument("--envd-url", default=None, help="envd, for the sandbox-wide env vars (GET /envs)")
    parser.add_argument("--preload", default=os.environ.get("AENV_CI_PRELOAD", ""),
                        help="comma-separated modules the default Python context imports at start")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runtime = args.runtime_dir or Path(tempfile.mkdtemp(prefix="code-interpreter-"))
    temporary = args.runtime_dir is None
    contexts = Contexts(runtime, default_cwd=args.cwd, envd_url=args.envd_url,
                        preload=[m for m in args.preload.split(",") if m.strip()])
    try:
        uvicorn.run(create_app(contexts), host=args.host, port=args.port, access_log=False, use_colors=False,
                    timeout_keep_alive=640, log_level="info")
    finally:
        if temporary:
            shutil.rmtree(runtime, ignore_errors=True)


if __name__ == "__main__":
    main()
