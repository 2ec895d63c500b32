"""The unchanged E2B Python SDK 2.63's ``Volume`` (sync and async) against the real API served
by uvicorn on 127.0.0.1 (no VM: the volume and content APIs need none): create, list,
get_info, connect, the content methods with their SDK types and exceptions, destroy. The
sync SDK runs in a thread while the server runs in the test's event loop."""
import asyncio
import uuid

import pytest
from e2b import AsyncVolume, Volume, VolumeFileType
from e2b.exceptions import AuthenticationException, NotFoundException, VolumeException, VolumeNotFoundException
from tests.unit.asgi_server import served_to_sdk

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


@pytest.fixture
async def server(asgi_app, base_template, raw_key, monkeypatch, settings, tmp_path):
    """The API on a free port; the SDK pointed at it (API and volume content) with team A's key."""
    settings.AENV_VOLUMES_DIR = tmp_path / "volumes"
    async with served_to_sdk(asgi_app, monkeypatch, raw_key, volumes=True) as url:
        yield url


def sdk(fn, *args, **kwargs):
    return asyncio.to_thread(fn, *args, **kwargs)


async def test_the_sync_sdk_volume_calls(server):
    name = f"sdk-{uuid.uuid4().hex[:8]}"
    vol = await sdk(Volume.create, name)
    assert vol.name == name and vol.token
    assert [v.name for v in await sdk(Volume.list)] == [name]
    info = await sdk(Volume.get_info, vol.volume_id)
    assert (info.volume_id, info.name, info.token) == (vol.volume_id, name, vol.token)
    again = await sdk(Volume.connect, vol.volume_id)

    entry = await sdk(again.write_file, "/dir/hello.txt", "hello volume", mode=0o640)
    assert entry.type == VolumeFileType.FILE and entry.size == 12 and entry.mode == 0o640 and entry.path == "/dir/hello.txt"
    assert entry.mtime.tzinfo is not None
    assert await sdk(vol.read_file, "/dir/hello.txt") == "hello volume"
    assert await sdk(vol.read_file, "/dir/hello.txt", format="bytes") == b"hello volume"
    assert b"".join(await sdk(lambda: list(vol.read_file("/dir/hello.txt", format="stream")))) == b"hello volume"
    made = await sdk(vol.make_dir, "/a/b/c", force=True)
    assert made.type == VolumeFileType.DIRECTORY and made.name == "c"
    listed = await sdk(vol.list, "/", depth=2)
    assert sorted(e.path for e in listed) == ["/a", "/a/b", "/dir", "/dir/hello.txt"]
    assert await sdk(vol.exists, "/dir/hello.txt") is True
    assert await sdk(vol.exists, "/nope") is False
    assert (await sdk(vol.update_metadata, "/dir/hello.txt", mode=0o600)).mode == 0o600
    assert (await sdk(vol.get_info, "/dir")).type == VolumeFileType.DIRECTORY
    await sdk(vol.remove, "/dir")
    with pytest.raises(NotFoundException):
        await sdk(vol.read_file, "/dir/hello.txt")
    with pytest.raises(NotFoundException):
        await sdk(vol.make_dir, "/x/y")  # no parents without force

    stranger = Volume(vol.volume_id, name, token="not-the-token")
    with pytest.raises(AuthenticationException):
        await sdk(stranger.list, "/")

    assert await sdk(Volume.destroy, vol.volume_id) is True
    assert await sdk(Volume.destroy, vol.volume_id) is False  # 404
    with pytest.raises(VolumeNotFoundException):
        await sdk(Volume.get_info, vol.volume_id)
    with pytest.raises(VolumeException):
        await sdk(Volume.create, "not a valid name")


async def test_the_async_sdk_volume_calls(server):
    vol = await AsyncVolume.create(f"async-{uuid.uuid4().hex[:8]}")
    await vol.write_file("/f.bin", b"\x00\x01" * 1000)
    assert await vol.read_file("/f.bin", format="bytes") == b"\x00\x01" * 1000
    assert [e.name for e in await vol.list("/")] == ["f.bin"]
    await vol.remove("/f.bin")
    assert await vol.exists("/f.bin") is False
    assert await AsyncVolume.destroy(vol.volume_id) is True
