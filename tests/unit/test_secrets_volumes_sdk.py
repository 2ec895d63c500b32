"""The unchanged E2B Python SDK 2.63's calls for secrets and volumes that the other SDK tests do
not make (tests/unit/test_secrets_api.py: the sync ``Secret``; test_volumes_sdk.py: the sync
and async ``Volume`` basics): ``AsyncSecret``, the ``E2B`` client's bound classes (no
``E2B_API_KEY`` / ``E2B_API_URL`` in the environment), ``volume_mounts`` at create with a
``Volume`` and with a name (sync and async), the ``AsyncVolume`` class and instance methods
not made there, and a write from a file object. The API is served by uvicorn on 127.0.0.1 and
the node is a mock: what a guest sees of a mounted volume is tests/integration/test_volumes_e2e.py's."""
import asyncio
import io
import uuid

import pytest
from e2b import E2B, AsyncSandbox, AsyncSecret, AsyncVolume, Sandbox, Volume, VolumeFileType
from e2b.exceptions import AuthenticationException, SecretNotFoundException, VolumePathNotFoundException

from tests.unit.asgi_server import served

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]
VALUE = "sdk-secret-value-never-shown"


@pytest.fixture
async def server(asgi_app, base_template, nodes_mock, settings, tmp_path, monkeypatch):
    """The API on a free port; the volume content API at the same URL (E2B_VOLUME_API_URL);
    no key in the environment: each test says which it uses."""
    settings.AENV_VOLUMES_DIR = tmp_path / "volumes"
    for name in ("E2B_API_KEY", "E2B_API_URL", "E2B_ACCESS_TOKEN", "E2B_DOMAIN"):
        monkeypatch.delenv(name, raising=False)
    async with served(asgi_app) as url:
        monkeypatch.setenv("E2B_VOLUME_API_URL", url)
        yield url


@pytest.fixture
def with_env_key(server, raw_key, monkeypatch):
    monkeypatch.setenv("E2B_API_URL", server)
    monkeypatch.setenv("E2B_API_KEY", raw_key)


def sdk(fn, *args, **kwargs):
    return asyncio.to_thread(fn, *args, **kwargs)


def mounts_told(nodes_mock) -> list[str]:
    return [v["path"] for v in nodes_mock.client.boot_sandbox.await_args.kwargs["volumes"]]


async def test_async_secret(with_env_key, api):
    made = await AsyncSecret.create("Async-Key", VALUE, metadata={"by": "async"})
    assert made.secret_id.startswith("sec_") and made.name == "async-key" and made.version == 1
    assert (await AsyncSecret.get_info("ASYNC-KEY")).secret_id == made.secret_id
    assert await AsyncSecret.exists(made.secret_id) is True
    assert await AsyncSecret.exists("absent") is False
    updated = await AsyncSecret.update("async-key", VALUE + "-2", metadata={"by": "update"})
    assert (updated.version, updated.metadata) == (2, {"by": "update"})
    await AsyncSecret.create("async-other", VALUE)
    pages, seen = AsyncSecret.list(limit=1), []
    while pages.has_next:
        seen += await pages.next_items()
    assert sorted(s.name for s in seen) == ["async-key", "async-other"]
    for path in ("/secrets", "/secrets/async-key", "/secrets/async-key/versions"):
        assert VALUE not in (await api.get(path)).text
    assert await AsyncSecret.destroy("async-key") is True
    assert await AsyncSecret.destroy("async-key") is False
    with pytest.raises(SecretNotFoundException):
        await AsyncSecret.get_info("async-key")


async def test_the_e2b_clients_bound_classes(server, raw_key, other_key, nodes_mock):
    """Two clients, two teams, nothing in the environment: each sees only its own."""
    mine, theirs = E2B(api_key=raw_key, api_url=server), E2B(api_key=other_key, api_url=server)
    made = await sdk(mine.Secret.create, "bound", VALUE)
    assert await sdk(mine.Secret.exists, "bound") is True
    assert await sdk(theirs.Secret.exists, "bound") is False
    vol = await sdk(mine.Volume.create, f"bound-{uuid.uuid4().hex[:6]}")
    await sdk(vol.write_file, "/hello.txt", "bound")
    assert [v.volume_id for v in await sdk(mine.Volume.list)] == [vol.volume_id]
    assert await sdk(theirs.Volume.list) == []
    sbx = await sdk(mine.Sandbox.create, volume_mounts={"/home/user/data": vol})
    assert mounts_told(nodes_mock) == ["/home/user/data"]
    assert [s.sandbox_id for s in await sdk(mine.Sandbox.list().next_items)] == [sbx.sandbox_id]
    assert await sdk(theirs.Sandbox.list().next_items) == []
    asbx = await mine.AsyncSandbox.create(volume_mounts={"/mnt/v": vol.name})
    assert mounts_told(nodes_mock) == ["/mnt/v"]
    assert (await mine.AsyncVolume.get_info(vol.volume_id)).name == vol.name
    assert (await mine.AsyncSecret.get_info("bound")).secret_id == made.secret_id
    with pytest.raises(AuthenticationException):
        await sdk(E2B(api_key="e2b_" + "0" * 40, api_url=server).Secret.exists, "bound")
    await asbx.kill()
    await sdk(sbx.kill)
    assert await sdk(mine.Volume.destroy, vol.volume_id) is True


async def test_volume_mounts_at_create_show_in_get_info(with_env_key, nodes_mock):
    vol = await sdk(Volume.create, "mounted")
    sbx = await sdk(Sandbox.create, volume_mounts={"/home/user/a": vol, "/mnt/b": "mounted"})
    assert mounts_told(nodes_mock) == ["/home/user/a", "/mnt/b"]
    assert (await sdk(sbx.get_info)).volume_mounts == [{"name": "mounted", "path": "/home/user/a"},
                                                       {"name": "mounted", "path": "/mnt/b"}]
    asbx = await AsyncSandbox.create(volume_mounts={"/data": await AsyncVolume.connect(vol.volume_id)})
    assert (await asbx.get_info()).volume_mounts == [{"name": "mounted", "path": "/data"}]


async def test_the_async_volume_methods(with_env_key):
    made = await AsyncVolume.create("async-vol")
    vol = await AsyncVolume.connect(made.volume_id)
    assert (vol.name, vol.token) == ("async-vol", made.token)
    assert [v.name for v in await AsyncVolume.list()] == ["async-vol"]
    assert (await AsyncVolume.get_info(made.volume_id)).token == made.token
    made_dir = await vol.make_dir("/a/b", force=True, mode=0o750)
    assert made_dir.type == VolumeFileType.DIRECTORY and made_dir.mode == 0o750
    stat = await vol.write_file("/a/b/f.txt", "text", mode=0o640)
    assert (stat.size, stat.mode) == (4, 0o640)
    assert (await vol.get_info("/a/b/f.txt")).size == 4
    assert (await vol.update_metadata("/a/b/f.txt", mode=0o600)).mode == 0o600
    assert await vol.read_file("/a/b/f.txt") == "text"
    chunks = [c async for c in await vol.read_file("/a/b/f.txt", format="stream")]
    assert b"".join(chunks) == b"text"
    assert sorted(e.path for e in await vol.list("/", depth=3)) == ["/a", "/a/b", "/a/b/f.txt"]
    with pytest.raises(VolumePathNotFoundException):
        await vol.get_info("/absent")
    await vol.remove("/a")
    assert await vol.list("/") == []
    assert await AsyncVolume.destroy(made.volume_id) is True


async def test_a_sync_write_from_a_file_object(with_env_key):
    vol = await sdk(Volume.create, "from-io")
    data = bytes(range(256)) * 4096  # 1 MiB, streamed in chunks by the SDK
    stat = await sdk(vol.write_file, "/big.bin", io.BytesIO(data))
    assert stat.size == len(data)
    assert await sdk(vol.read_file, "/big.bin", format="bytes") == data
    with pytest.raises(VolumePathNotFoundException):
        await sdk(vol.update_metadata, "/absent", mode=0o600)
