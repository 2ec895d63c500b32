"""Wire models of the volume endpoints (E2B names: ``volumeID``, ``name``, ``token``)."""
from rest_framework import serializers

from api.fields import StrictCharField
from volumes.models import Volume


class NewVolumeSerializer(serializers.Serializer):
    """Body of ``POST /volumes``; the name's own rule is checked by ``lifecycle.volumes``."""

    name = StrictCharField(max_length=128)


class VolumeSerializer(serializers.ModelSerializer):
    """Model ``Volume`` (the list): ``volumeID`` and ``name``."""

    volumeID = serializers.CharField(source="id")

    class Meta:
        model = Volume
        fields = ["volumeID", "name"]


class VolumeAndTokenSerializer(VolumeSerializer):
    """Model ``VolumeAndToken`` (create, get): plus the content API's bearer token. No
    ``domain``: the content API is served by this API (``E2B_VOLUME_API_URL``)."""

    class Meta(VolumeSerializer.Meta):
        fields = ["volumeID", "name", "token"]


class PathQuerySerializer(serializers.Serializer):
    path = serializers.CharField(allow_blank=True, trim_whitespace=False, max_length=4096)


class ListQuerySerializer(PathQuerySerializer):
    depth = serializers.IntegerField(required=False, min_value=1, max_value=32, default=1)


class OwnerFields(serializers.Serializer):
    uid = serializers.IntegerField(required=False, min_value=0, max_value=2**32 - 2)
    gid = serializers.IntegerField(required=False, min_value=0, max_value=2**32 - 2)
    mode = serializers.IntegerField(required=False, min_value=0, max_value=0o7777)


class WriteQuerySerializer(PathQuerySerializer, OwnerFields):
    """Query of ``POST …/dir`` and ``PUT …/file``: ``force`` makes missing parents (a write
    always makes them, as envd's does)."""

    force = serializers.BooleanField(required=False, default=False)


class MetadataSerializer(OwnerFields):
    """Body of ``PATCH …/path``."""


class EntrySerializer(serializers.Serializer):
    """Model ``VolumeEntryStat`` (documentation only: the store returns it as a dict)."""

    name = serializers.CharField()
    type = serializers.ChoiceField(choices=["file", "directory", "symlink", "unknown"])
    path = serializers.CharField()
    size = serializers.IntegerField()
    mode = serializers.IntegerField()
    uid = serializers.IntegerField()
    gid = serializers.IntegerField()
    atime = serializers.DateTimeField()
    mtime = serializers.DateTimeField()
    ctime = serializers.DateTimeField()
    target = serializers.CharField(required=False)
