"""Command-line entry point: parse options and serve the envd ASGI app with uvicorn."""

import argparse
import logging
import socket
import sys

from . import ENVD_PORT
from .state import DEFAULT_USER, ENVD_VERSION, Settings


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="envd", description="aenv in-guest agent (E2B envd compatible)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=ENVD_PORT)
    p.add_argument("--default-user", default=DEFAULT_USER,
                   help="user for requests that name none (the template file and /init may set another)")
    p.add_argument("--default-workdir", default=None, help="cwd for processes (default: user's home)")
    p.add_argument("--max-upload-bytes", type=int, default=1 << 30)
    p.add_argument("--set-clock", choices=["auto", "always", "never"], default="auto",
                   help="apply /init timestamp: auto = as root when skew > 1 s")
    p.add_argument("--credit-entropy", choices=["auto", "never"], default="auto",
                   help="/init entropySeed: auto = credit to the kernel pool (root) or mix in")
    p.add_argument("--access-token", default=None, help="require this X-Access-Token from the start")
    p.add_argument("--forward-loopback", choices=["auto", "always", "never"], default="auto",
                   help="re-expose TCP services listening only on loopback at the address of the interface "
                        "named by $AENV_ENVD_FORWARD_IFACE (default eth0); auto = when --host is a wildcard "
                        "(as in the guest) or --forward-address is given")
    p.add_argument("--forward-address", default=None,
                   help="IPv4 address to re-expose loopback services on instead of the interface's (tests)")
    p.add_argument("--forward-interval", type=float, default=1.0,
                   help="seconds between listener scans while the sandbox is in use")
    p.add_argument("--forward-idle-interval", type=float, default=None,
                   help="seconds between listener scans once no request came for a minute "
                        "(default 10, or --forward-interval if that is longer)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--version", action="version", version=ENVD_VERSION)
    args = p.parse_args(argv)
    if not args.forward_interval > 0:
        p.error("--forward-interval must be positive")
    if args.forward_idle_interval is None:
        args.forward_idle_interval = max(10.0, args.forward_interval)
    elif not args.forward_idle_interval >= args.forward_interval:
        p.error("--forward-idle-interval must be at least --forward-interval")
    if args.forward_address is not None:
        try:
            socket.inet_aton(args.forward_address)
        except OSError:
            p.error(f"--forward-address {args.forward_address!r} is not an IPv4 address")
    return args


def _port_forwarder(args):
    """The loopback forwarder envd runs, or None. Off by default when envd serves one address
    only (envd run on a host by the tests), so a host's own loopback services stay private."""
    mode = args.forward_loopback
    if mode == "never" or (mode == "auto" and args.host not in ("0.0.0.0", "::", "")
                           and args.forward_address is None):
        return None
    from .port_forward import PortForwarder

    return PortForwarder(listen_address=args.forward_address, interval=args.forward_interval,
                         idle_interval=args.forward_idle_interval,
                         skip_ports={ENVD_PORT, args.port})


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
    settings.load_template_defaults()
    settings.load_trust()
    app = EnvdApp(settings, port_forwarder=_port_forwarder(args))
    from .quiet_server import QuietServer

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            access_log=False, http=H11Protocol, loop="asyncio", ws="none", lifespan="on",
                            timeout_keep_alive=75, timeout_graceful_shutdown=2)
    server = QuietServer(config)  # uvicorn.run's Server, without the 10 Hz tick (envd.quiet_server)
    server.run()
    if not server.started:
        sys.exit(3)  # what uvicorn.run exits with when the server could not start


if __name__ == "__main__":
    main()
