"""envd's /init entropySeed: decoding limits and the RNDADDENTROPY request it makes."""
import base64
import os
import struct

import pytest

from envd import entropy


def test_decode_seed_limits():
    assert entropy.decode_seed(base64.b64encode(b"a" * 64).decode()) == b"a" * 64
    for bad in ("***", "YQ", base64.b64encode(b"a" * 15).decode(), base64.b64encode(b"a" * 513).decode(), 7, None):
        with pytest.raises(ValueError):
            entropy.decode_seed(bad)


def test_pool_info_layout():
    info = entropy.pool_info(b"\x01\x02\x03\x04\x05")
    count, size = struct.unpack("ii", info[:8])
    assert (count, size) == (40, 5)
    assert info[8:] == b"\x01\x02\x03\x04\x05\0\0\0"  # padded to whole u32 words


def test_credit_as_root_uses_rndaddentropy(tmp_path, monkeypatch):
    calls = []
    dev = tmp_path / "urandom"
    dev.write_bytes(b"")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    seed = os.urandom(64)
    result = entropy.credit(seed, device=str(dev), ioctl=lambda fd, req, arg: calls.append((req, arg)))
    assert result == "credited"
    assert calls == [(0x40085203, struct.pack("ii", 512, 64) + seed), (0x5207, 0)]  # credit, then reseed
    assert dev.read_bytes() == b""  # credited, not written


def test_credit_falls_back_to_mixing_in(tmp_path, monkeypatch):
    dev = tmp_path / "urandom"
    dev.write_bytes(b"")
    seed = os.urandom(32)

    def refuse(fd, req, arg):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert entropy.credit(seed, device=str(dev), ioctl=refuse) == "mixed"
    assert dev.read_bytes() == seed
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert entropy.credit(seed, device=str(dev), ioctl=refuse) == "mixed"
    assert entropy.credit(seed, mode="never", device=str(dev)) == "skipped"
    assert entropy.credit(seed, device=str(tmp_path / "missing" / "dev")) == "failed"
