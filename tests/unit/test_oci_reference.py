"""vmm.oci without registries or root: references, error classification, the disk epoch and geometry."""

import pytest

from vmm.oci import disks, ext4, reference, store
from vmm.oci.errors import ImagePullError
from vmm.oci.store import PulledImage


@pytest.mark.parametrize("text, expected", [
    ("python", "docker.io/library/python:latest"),
    ("python:3.11", "docker.io/library/python:3.11"),
    ("docker://python:3.11-slim", "docker.io/library/python:3.11-slim"),
    ("e2bdev/base", "docker.io/e2bdev/base:latest"),
    ("ghcr.io/org/team/app:v1.2", "ghcr.io/org/team/app:v1.2"),
    ("localhost/app", "localhost/app:latest"),
    ("127.0.0.1:5000/t/app:v1", "127.0.0.1:5000/t/app:v1"),
    ("registry.example.com:8443/a_b/c-d__e:tag_1", "registry.example.com:8443/a_b/c-d__e:tag_1"),
    ("app@sha256:" + "a" * 64, "docker.io/library/app@sha256:" + "a" * 64),
    ("r.io/app:v1@sha256:" + "B" * 64, "r.io/app:v1@sha256:" + "b" * 64),
])
def test_references_are_normalised_like_docker(text, expected):
    assert str(reference.parse(text)) == expected
    assert reference.parse(text).transport == f"docker://{expected}"


def test_parts():
    ref = reference.parse("127.0.0.1:5000/team/app:v2")
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == ("127.0.0.1:5000", "team/app", "v2", "")
    assert reference.parse("foo:5000").tag == "5000"  # no slash: a tag, not a registry port


@pytest.mark.parametrize("text", ["", "  ", "Upper/Case", "a b", "app:", "app:-bad", "app@sha256:xyz",
                                  "r.io//app", "app/", "-app", "ex ample.com/app", "a" * 300])
def test_invalid_references(text):
    with pytest.raises(ImagePullError) as e:
        reference.parse(text)
    assert e.value.kind == "invalid" and e.value.message


@pytest.mark.parametrize("message, kind", [
    ("reading manifest v1 in r/t/app: manifest unknown: manifest unknown", "not_found"),
    ("reading manifest latest in docker.io/library/nope: requested access to the resource is denied", "unauthorized"),
    ("reading manifest v1 in r/t/app: unauthorized: authentication required", "unauthorized"),
    ('pinging container registry 127.0.0.1:1: Get "http://127.0.0.1:1/v2/": dial tcp: connect: connection refused',
     "unreachable"),
    ("dial tcp: lookup nope.invalid on 10.0.0.1:53: no such host", "unreachable"),
    ("writing blob: disk quota exceeded", "failed"),
])
def test_classify(message, kind):
    assert store.classify(message) == kind


def test_registry_message_drops_skopeo_logging_frame():
    stderr = ('Getting image source signatures\n'
              'time="2026-01-01T00:00:00Z" level=fatal msg="initializing source docker://r/t:v1: reading manifest '
              'v1 in r/t: manifest unknown: \\"v1\\" not here"\n')
    assert store._registry_message(stderr) == 'initializing source docker://r/t:v1: reading manifest v1 in r/t: ' \
                                              'manifest unknown: "v1" not here'
    assert store._registry_message("") == "skopeo failed without a message"
    assert store._registry_message("plain last line\n") == "plain last line"


@pytest.mark.parametrize("created, epoch", [
    ("2024-05-01T12:00:00Z", 1714564800),
    ("2024-05-01T12:00:00.123456789Z", 1714564800),
    ("2024-05-01T14:00:00.5+02:00", 1714564800),
    ("", 0),
    ("yesterday", 0),
    ("1960-01-01T00:00:00Z", 0),
])
def test_epoch_is_the_image_creation_time(created, epoch):
    image = PulledImage(digest="sha256:" + "0" * 64, layout=None, created=created)
    assert disks.epoch_of(image) == epoch


def test_geometry_depends_on_usage_only():
    assert ext4.geometry(0, 10) == (ext4.MIN_SIZE_MB, (ext4.MIN_SIZE_MB << 20) // ext4.BYTES_PER_INODE)
    size, inodes = ext4.geometry(5 << 30, 200_000)
    assert size % ext4.ROUND_MB == 0 and size >= (5 << 10) * 1.1 + ext4.FREE_MB
    assert inodes >= 300_000
    assert ext4.geometry(5 << 30, 200_000) == (size, inodes)


def test_ids_are_derived_from_the_seed():
    a, b = ext4.ids("sha256:abc/key")
    assert (a, b) == ext4.ids("sha256:abc/key") and a != b
    assert ext4.ids("sha256:abd/key")[0] != a
    assert a[14] == "4"  # a well-formed v4 UUID


def test_pulled_image_views():
    image = PulledImage(digest="sha256:" + "ab" * 32, layout=None,
                        config={"Env": ["A=1", "PATH=/bin", "A=2", "EMPTY="], "WorkingDir": "/w", "User": "u",
                                "Cmd": ["x"], "Entrypoint": None},
                        layers=(store.Layer("sha256:1", 10, "t"), store.Layer("sha256:2", 5, "t")))
    assert image.env == {"A": "2", "PATH": "/bin", "EMPTY": ""}
    assert (image.workdir, image.user, image.cmd, image.entrypoint) == ("/w", "u", ["x"], [])
    assert image.size == 15 and image.layout_ref == "sha256-" + "ab" * 32
