"""The parts of template builds on their own: the name grammar, the build transition
table and its log numbering under concurrent writers, the COPY file stores (posix and a
real S3 API), archive checks, upload tokens and the upload path's body rules."""
import gzip
import io
import tarfile
import threading
import uuid

import pytest
from django.core import signing
from django.db import connections

from sandboxes.models import Team, Template
from template_builds import files
from template_builds.models import BuildLogEntry, TemplateBuild
from template_builds.names import InvalidName, Name, check_tag, new_template_id, parse
from template_builds.transitions import IllegalTransition, Log, append_sync, transition_sync
from harness.moto_s3 import moto_server, default_credentials

HASH = "c" * 64


# --------------------------------------------------------------------------- names


@pytest.mark.parametrize("ref, name", [
    ("my-app", Name(None, "my-app", None)),
    ("  My_App:V1.2 ", Name(None, "my_app", "v1.2")),
    ("team/app:default", Name("team", "app", None)),
    ("team/app", Name("team", "app", None)),
    ("app:" + "0" * 8 + "-0000-0000-0000-" + "0" * 12, Name(None, "app", "0" * 8 + "-0000-0000-0000-" + "0" * 12)),
])
def test_names_parse(ref, name):
    assert parse(ref) == name


@pytest.mark.parametrize("ref", ["", " ", "a b", "a/b/c", "a:", ":x", "/a", "a/", "a:b:c", "é", "a" * 129, 5, None])
def test_bad_names(ref):
    with pytest.raises(InvalidName):
        parse(ref)


def test_tags_and_ids():
    assert check_tag(" Prod ") == "prod"
    for bad in ("", "a b", "a:", ":x", str(uuid.uuid4())):
        with pytest.raises(InvalidName):
            check_tag(bad)
    assert check_tag(str(uuid.uuid4()), assigning=False)
    ids = {new_template_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 20 and i.startswith("t") and i.isalnum() and i.islower() for i in ids)


# --------------------------------------------------------------------------- transitions


@pytest.fixture
def build(db):
    team = Team.objects.create(name="T", slug="t")
    template = Template.objects.create(id="tparts", team=team, alias="parts", public=False)
    return TemplateBuild.objects.create(template=template)


def test_transition_table(build):
    assert not transition_sync(build.pk, "succeed")  # waiting → ready is not an edge
    assert transition_sync(build.pk, "start", logs=[Log("info", "started", "base")])
    assert not transition_sync(build.pk, "start")
    assert transition_sync(build.pk, "requeue")
    assert transition_sync(build.pk, "start")
    assert transition_sync(build.pk, "succeed", image="x")
    assert not transition_sync(build.pk, "fail")  # finished is final
    with pytest.raises(IllegalTransition):
        transition_sync(build.pk, "resurrect")
    with pytest.raises(ValueError):
        append_sync(build.pk, [Log("fatal", "x")])
    assert not append_sync(build.pk, [Log("info", "late")])  # not while finished
    build.refresh_from_db()
    assert build.status == "ready" and build.log_count == 1


@pytest.mark.django_db(transaction=True)
def test_concurrent_appends_get_consecutive_unique_indices():
    team = Team.objects.create(name="T", slug="t")
    template = Template.objects.create(id="tconc", team=team, alias="conc", public=False)
    build = TemplateBuild.objects.create(template=template, status="building")
    errors = []

    def writer(n):
        try:
            for i in range(20):
                append_sync(build.pk, [Log("info", f"w{n}-{i}"), Log("debug", f"w{n}-{i}b")])
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    indices = list(BuildLogEntry.objects.filter(build=build).order_by("index").values_list("index", flat=True))
    assert indices == list(range(160))
    build.refresh_from_db()
    assert build.log_count == 160
    # each writer's pair stays adjacent (one append, one transaction)
    messages = list(BuildLogEntry.objects.filter(build=build).order_by("index").values_list("message", flat=True))
    assert all(messages[i + 1] == messages[i] + "b" for i in range(0, 160, 2))


# --------------------------------------------------------------------------- archives and tokens


def _tar(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_check_archive(tmp_path):
    path = tmp_path / "a.tar"
    path.write_bytes(gzip.compress(_tar({"app/x.py": b"1", "app/y": b"22"})))
    assert files.check_archive(path, 100) is True
    path.write_bytes(_tar({"x": b"1"}))
    assert files.check_archive(path, 100) is False
    link = tarfile.TarInfo("evil")
    link.type, link.linkname = tarfile.LNKTYPE, "../../etc/shadow"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.addfile(link)
    path.write_bytes(buf.getvalue())
    with pytest.raises(files.InvalidArchive, match="outside"):
        files.check_archive(path, 100)
    symlink = tarfile.TarInfo("py")
    symlink.type, symlink.linkname = tarfile.SYMTYPE, "/usr/bin/python3"  # a guest path: fine
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.addfile(symlink)
    path.write_bytes(buf.getvalue())
    assert files.check_archive(path, 100) is False


def test_spool_limits_and_cleans_up(tmp_path):
    path, size = files.spool([b"ab", b"cd"], tmp_path, 4)
    assert path.read_bytes() == b"abcd" and size == 4
    with pytest.raises(files.InvalidArchive):
        files.spool([b"abc", b"de"], tmp_path, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_upload_tokens(settings):
    team = uuid.uuid4()
    token = files.upload_token(team, HASH, "tpl")
    assert files.check_upload_token(token, HASH, 60) == (str(team), "tpl")
    with pytest.raises(ValueError):
        files.check_upload_token(token, "d" * 64, 60)
    with pytest.raises(signing.BadSignature):
        files.check_upload_token(token[:-2] + "xx", HASH, 60)
    with pytest.raises(signing.SignatureExpired):
        files.check_upload_token(token, HASH, -1)


# --------------------------------------------------------------------------- stores


def _exercise(store, tmp_path):
    team = uuid.uuid4()
    assert not store.exists(team, HASH)
    src = store.staging_dir() / "upload.part"
    src.write_bytes(b"archive-1")
    store.save(team, HASH, src)
    assert store.exists(team, HASH) and not src.exists()
    src.write_bytes(b"archive-2")
    store.save(team, HASH, src)  # replaced whole
    assert store.fetch(team, HASH, tmp_path / "got" / "x.tar").read_bytes() == b"archive-2"
    assert not store.exists(uuid.uuid4(), HASH)  # per team
    with pytest.raises(files.FileStoreError):
        store.fetch(uuid.uuid4(), HASH, tmp_path / "none.tar")
    with pytest.raises(files.FileStoreError):
        store.exists(team, "../../etc/passwd")
    assert store.delete(team, HASH) and not store.delete(team, HASH)
    assert not store.exists(team, HASH)


def test_posix_store(settings, tmp_path):
    settings.AENV_HOME = tmp_path
    settings.AENV_SNAPSHOT_BACKEND = "posix_fs"
    store = files.get_file_store()
    assert isinstance(store, files.PosixFileStore) and store.root == tmp_path / "template-files"
    _exercise(store, tmp_path)


def test_s3_store(settings, tmp_path):
    default_credentials()
    with moto_server("aenv-files") as url:
        settings.AENV_HOME = tmp_path
        settings.AENV_SNAPSHOT_BACKEND = "s3"
        settings.AENV_S3_BUCKET, settings.AENV_S3_ENDPOINT = "aenv-files", url
        settings.AENV_S3_REGION, settings.AENV_S3_PREFIX = "us-east-1", "dep1/"
        store = files.get_file_store()
        assert isinstance(store, files.S3FileStore)
        team = uuid.uuid4()
        src = store.staging_dir() / "u.part"
        src.write_bytes(b"zz")
        store.save(team, HASH, src)
        keys = [o["Key"] for o in store.client.list_objects_v2(Bucket="aenv-files")["Contents"]]
        assert keys == [f"dep1/template-files/{team}/{HASH}.tar"]
        store.delete(team, HASH)
        _exercise(store, tmp_path)


# --------------------------------------------------------------------------- the upload path's body rules


async def test_upload_path_needs_a_length_and_has_its_own_limit(settings):
    from config.request_body import BoundedRequestBody  # noqa: PLC0415

    seen = []

    async def app(scope, receive, send):
        seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    settings.AENV_API_MAX_BODY_BYTES, settings.AENV_TEMPLATE_FILE_MAX_BYTES = 10, 1000
    middleware = BoundedRequestBody(app)
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"x" * 50, "more_body": False}

    def scope(path, length=None):
        headers = [(b"content-length", str(length).encode())] if length is not None else []
        return {"type": "http", "method": "PUT", "path": path, "headers": headers}

    await middleware(scope("/template-files/" + HASH), receive, send)
    assert sent[0]["status"] == 411 and not seen
    sent.clear()
    await middleware(scope("/template-files/" + HASH, 500), receive, send)
    assert sent[0]["status"] == 200 and seen
    sent.clear()
    await middleware(scope("/template-files/" + HASH, 1001), receive, send)
    assert sent[0]["status"] == 413
    sent.clear()
    await middleware(scope("/v3/templates", 50), receive, send)
    assert sent[0]["status"] == 413  # everything else keeps the API's limit
