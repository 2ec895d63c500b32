"""Starts the node egress proxy: mitmproxy's proxy core with aenv's addon and nothing else.

Why not ``mitmdump -s addon.py``: mitmdump loads some thirty addons (replay, blocklists,
header maps, saving, the flow dumper…) and every hook of every connection passes through
each of them; the egress proxy needs only the core, the proxy server, the layer decisions and
the TLS handling, so a new connection costs a good part less CPU (docs/benchmarks.md).

Run by vmm.net.egress with mitmproxy's own Python (``.venv-egress``):
``python run.py --listen IP:PORT --dir DIR --confdir DIR``.
"""
from __future__ import annotations

import argparse
import asyncio

from mitmproxy import options
from mitmproxy.addons import core, errorcheck, next_layer, proxyserver, tlsconfig
from mitmproxy.master import Master

import addon  # this folder's addon.py (its folder is first on sys.path)


async def serve(listen: str, directory: str, confdir: str) -> None:
    opts = options.Options(confdir=confdir)
    master = Master(opts, event_loop=asyncio.get_running_loop(), with_termlog=True)
    master.addons.add(core.Core(), proxyserver.Proxyserver(), next_layer.NextLayer(), tlsconfig.TlsConfig(),
                      errorcheck.ErrorCheck(), *addon.addons)
    # the addons define these options; the listener (mode) last, once everything is set
    opts.update(connection_strategy="lazy", stream_large_bodies="64k", termlog_verbosity="warn",
                aenv_egress_dir=directory)
    opts.update(mode=[f"transparent@{listen}"])
    await master.run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="IP:PORT")
    parser.add_argument("--dir", required=True, help="the directory with node.json and slots/")
    parser.add_argument("--confdir", required=True, help="mitmproxy's own files")
    args = parser.parse_args()
    asyncio.run(serve(args.listen, args.dir, args.confdir))


if __name__ == "__main__":
    main()
