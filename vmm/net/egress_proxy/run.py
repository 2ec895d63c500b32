"""Starts the node egress proxy: mitmproxy's proxy core with aenv's addon and nothing else.

Why not ``mitmdump -s addon.py``: mitmdump loads some thirty addons (replay, blocklists,
header maps, saving, the flow dumper…) and every hook of every connection passes through
each of them; the egress proxy needs only the core, the proxy server, the layer decisions and
the TLS handling, so a new connection costs a good part less CPU (docs/benchmarks.md).

Run by vmm.net.egress with mitmproxy's own Python (``.venv-egress``):
``python run.py --listen IP:PORT --dir DIR --confdir DIR [--upstream-ca PEM]``. The confdir
holds the node's CA as ``mitmproxy-ca.pem`` (what intercepted TLS is signed with) and, when
the node gave it, ``secrets.json`` (how to ask the API for secret values); ``--upstream-ca``
replaces the CA bundle the proxy verifies upstream servers of intercepted connections with
(``AENV_EGRESS_UPSTREAM_CA``; tests point it at their own test CA).
"""
from __future__ import annotations

import argparse
import asyncio

from mitmproxy import options
from mitmproxy.addons import core, errorcheck, next_layer, proxyserver, tlsconfig
from mitmproxy.master import Master

import addon  # this folder's addon.py (its folder is first on sys.path)


async def serve(listen: str, directory: str, confdir: str, upstream_ca: str | None = None) -> None:
    opts = options.Options(confdir=confdir)
    master = Master(opts, event_loop=asyncio.get_running_loop(), with_termlog=True)
    master.addons.add(core.Core(), proxyserver.Proxyserver(), next_layer.NextLayer(), tlsconfig.TlsConfig(),
                      errorcheck.ErrorCheck(), *addon.addons)
    # the addons define these options; the listener (mode) last, once everything is set
    opts.update(connection_strategy="lazy", stream_large_bodies="64k", termlog_verbosity="warn",
                aenv_egress_dir=directory, ssl_insecure=False)
    if upstream_ca:
        opts.update(ssl_verify_upstream_trusted_ca=upstream_ca)
    opts.update(mode=[f"transparent@{listen}"])
    await master.run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="IP:PORT")
    parser.add_argument("--dir", required=True, help="the directory with node.json and slots/")
    parser.add_argument("--confdir", required=True, help="mitmproxy's own files")
    parser.add_argument("--upstream-ca", help="CA bundle (PEM) that upstream servers of intercepted TLS must chain to")
    args = parser.parse_args()
    asyncio.run(serve(args.listen, args.dir, args.confdir, args.upstream_ca))


if __name__ == "__main__":
    main()
