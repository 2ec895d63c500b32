"""Command-line entry point: parse options and serve the envd ASGI app with uvicorn."""

import argparse
import logging

from . import ENVD_PORT
from .state import ENVD_VERSION, Settings


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="envd", description="aenv in-guest agent (E2B envd compatible)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=ENVD_PORT)
    p.add_argument("--default-user", default="user", help="user for requests that name none")
    p.add_argument("--default-workdir", default=None, help="cwd for processes (default: user's home)")
    p.add_argument("--max-upload-bytes", type=int, default=1 << 30)
    p.add_argument("--set-clock", choices=["auto", "always", "never"], default="auto",
                   help="apply /init timestamp: auto = as root when skew > 1 s")
    p.add_argument("--credit-entropy", choices=["auto", "never"], default="auto",
                   help="/init entropySeed: auto = credit to the kernel pool (root) or mix in")
    p.add_argument("--access-token", default=None, help="require this X-Access-Token from the start")
    p.add_argument("--log-level", default="info")
    p.add_argument("--version", action="version", version=ENVD_VERSION)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    # Static imports of what uvicorn would load by name, so PyInstaller bundles them.
    import uvicorn.lifespan.on  # noqa: F401
    import uvicorn.loops.asyncio  # noqa: F401
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from .app import EnvdApp

    settings = Settings(default_user=args.default_user, default_workdir=args.default_workdir,
                        max_upload_bytes=args.max_upload_bytes, set_clock=args.set_clock,
                        access_token=args.access_token, credit_entropy=args.credit_entropy)
    uvicorn.run(EnvdApp(settings), host=args.host, port=args.port, log_level=args.log_level.lower(),
                access_log=False, http=H11Protocol, loop="asyncio", ws="none", lifespan="on",
                timeout_keep_alive=75, timeout_graceful_shutdown=2)


if __name__ == "__main__":
    main()
