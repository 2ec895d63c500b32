"""``python -m chunkfs serve ...``: the node's chunkfs daemon (chunkfs.daemon)."""
import logging
import os
import sys

from .daemon import main

code = main()
# Not sys.exit: fetches still blocked in a dead source (bounded by its timeouts) must not
# hold the exit of a daemon that has already unmounted and saved its cache.
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
