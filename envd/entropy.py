"""Credit /init's `entropySeed` to the guest kernel's random pool.

Why: every sandbox restored or forked from one memory snapshot starts with the same kernel RNG
state. The host sends fresh random bytes with /init and envd adds them with RNDADDENTROPY, so
each child's /dev/urandom and getrandom() diverge from its siblings' from then on.
"""

import base64
import binascii
import fcntl
import logging
import os
import struct

log = logging.getLogger("envd.entropy")

RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2])
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07): once the crng is initialized, added entropy only reaches
# /dev/urandom at the next scheduled reseed (up to 60 s later); this makes it immediate.
MIN_SEED_BYTES = 16
MAX_SEED_BYTES = 512


def decode_seed(value):
    """The seed's bytes; ValueError (-> 400) for anything but base64 of 16..512 bytes."""
    if not isinstance(value, str):
        raise ValueError("entropySeed must be a base64 string")
    try:
        seed = base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise ValueError("entropySeed is not valid base64") from None
    if not MIN_SEED_BYTES <= len(seed) <= MAX_SEED_BYTES:
        raise ValueError(f"entropySeed must decode to {MIN_SEED_BYTES}..{MAX_SEED_BYTES} bytes, not {len(seed)}")
    return seed


def pool_info(seed):
    """struct rand_pool_info {int entropy_count (bits); int buf_size (bytes); u32 buf[]}."""
    padded = seed + b"\0" * (-len(seed) % 4)
    return struct.pack("ii", len(seed) * 8, len(seed)) + padded


def credit(seed, mode="auto", device="/dev/urandom", ioctl=fcntl.ioctl):
    """Adds the seed to the kernel pool. `auto`: credited with RNDADDENTROPY as root, otherwise
    (or if the ioctl is refused) only mixed in by writing it to the device; `never`: nothing.
    Credited entropy is followed by RNDRESEEDCRNG so the new seed is used at once.
    Never raises: a failed credit must not fail /init. Returns what was done."""
    if mode == "never":
        return "skipped"
    try:
        fd = os.open(device, os.O_WRONLY)
    except OSError as exc:
        log.warning("entropy: cannot open %s: %s", device, exc)
        return "failed"
    try:
        if os.geteuid() == 0:
            try:
                ioctl(fd, RNDADDENTROPY, pool_info(seed))
                try:
                    ioctl(fd, RNDRESEEDCRNG, 0)
                except OSError as exc:  # ENODATA: crng not ready yet, it will seed from the pool
                    log.info("entropy: no immediate reseed (%s)", exc)
                log.info("entropy: credited %d bits", len(seed) * 8)
                return "credited"
            except OSError as exc:
                log.warning("entropy: RNDADDENTROPY refused (%s); mixing in only", exc)
        os.write(fd, seed)
        log.info("entropy: mixed in %d bytes (not credited)", len(seed))
        return "mixed"
    except OSError as exc:
        log.warning("entropy: could not add seed: %s", exc)
        return "failed"
    finally:
        os.close(fd)
