"""The wire contract of E2B's template API (SDK 2.63 models): request bodies and query
strings in, response models out. Field names are E2B's; input types are strict (a wrong
JSON type is a 400, never guessed around); unknown fields are ignored (newer SDKs add
some, e.g. ``resolveSymlinks`` / ``gzip`` on COPY steps)."""
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from api.fields import INT32_MAX, MAX_UNIX_MS, JsonObjectField, StrictBooleanField, StrictCharField, StrictIntegerField

from template_builds.models import BuildStatus, LogLevel

# --------------------------------------------------------------------------- requests


def _text(**kwargs):
    """A JSON string kept exactly as sent (commands, paths, arguments)."""
    return StrictCharField(trim_whitespace=False, **kwargs)


class BuildRequestV3Serializer(serializers.Serializer):
    """Body of ``POST /v3/templates`` (``TemplateBuildRequestV3``)."""

    name = StrictCharField(required=False, allow_null=True, allow_blank=True)
    alias = StrictCharField(required=False, allow_null=True, allow_blank=True, help_text="deprecated: name")
    teamID = StrictCharField(required=False, allow_null=True, allow_blank=True, help_text="ignored")
    tags = serializers.ListField(child=StrictCharField(allow_blank=True), required=False, allow_null=True)
    cpuCount = StrictIntegerField(required=False, allow_null=True)
    memoryMB = StrictIntegerField(required=False, allow_null=True)
    minFreeDiskMb = StrictIntegerField(required=False, allow_null=True)

    def validate(self, data):
        name = data.get("name") or data.get("alias")
        if not name:
            raise serializers.ValidationError("name is required")
        data["name"] = name
        return data


class TemplateStepSerializer(serializers.Serializer):
    """One step (``TemplateStep``)."""

    type = StrictCharField()
    args = serializers.ListField(child=_text(allow_blank=True), required=False, allow_null=True)
    force = StrictBooleanField(required=False, allow_null=True)
    filesHash = StrictCharField(required=False, allow_null=True, allow_blank=True)
    forceUpload = StrictBooleanField(required=False, allow_null=True)


REGISTRY_FIELDS = {
    "registry": ("username", "password"),
    "aws": ("awsAccessKeyId", "awsSecretAccessKey", "awsRegion"),
    "gcp": ("serviceAccountJson",),
}


class BuildStartSerializer(serializers.Serializer):
    """Body of ``POST /v2/templates/{id}/builds/{buildID}`` (``TemplateBuildStartV2``):
    exactly one of ``fromImage`` / ``fromTemplate``."""

    fromImage = StrictCharField(required=False, allow_null=True, allow_blank=True)
    fromTemplate = StrictCharField(required=False, allow_null=True, allow_blank=True)
    fromImageRegistry = JsonObjectField(required=False, allow_null=True,
                                        help_text='{"type": "registry"|"aws"|"gcp", …credentials}')
    force = StrictBooleanField(required=False, allow_null=True)
    steps = TemplateStepSerializer(many=True, required=False, allow_null=True)
    startCmd = _text(required=False, allow_null=True, allow_blank=True)
    readyCmd = _text(required=False, allow_null=True, allow_blank=True)

    def validate_fromImageRegistry(self, value):  # noqa: N802 - wire name
        if value is None:
            return None
        kind = value.get("type")
        if kind not in REGISTRY_FIELDS:
            raise serializers.ValidationError(f"type must be one of {', '.join(REGISTRY_FIELDS)}")
        missing = [f for f in REGISTRY_FIELDS[kind] if not isinstance(value.get(f), str) or not value.get(f)]
        if missing:
            raise serializers.ValidationError(f"a {kind} registry needs {', '.join(missing)}")
        return {"type": kind, **{f: value[f] for f in REGISTRY_FIELDS[kind]}}

    def validate_steps(self, value):
        # allow_null reaches the list's items too: a null step is refused here, not a 500 later
        if value is not None and any(step is None for step in value):
            raise serializers.ValidationError("a step must be an object, not null")
        return value

    def validate(self, data):
        image, template = data.get("fromImage") or "", data.get("fromTemplate") or ""
        if bool(image) == bool(template):
            raise serializers.ValidationError("exactly one of fromImage and fromTemplate is required")
        if data.get("fromImageRegistry") and not image:
            raise serializers.ValidationError("fromImageRegistry needs fromImage")
        return data

    def to_start(self) -> dict:
        """The body in the lifecycle's snake_case form."""
        d = self.validated_data
        return {"from_image": d.get("fromImage") or "", "from_template": d.get("fromTemplate") or "",
                "from_image_registry": d.get("fromImageRegistry"), "force": bool(d.get("force")),
                "steps": [dict(s) for s in d.get("steps") or []],
                "start_cmd": d.get("startCmd") or "", "ready_cmd": d.get("readyCmd") or ""}


class BuildStatusQuerySerializer(serializers.Serializer):
    """Query of ``GET /templates/{id}/builds/{buildID}/status``."""

    logsOffset = serializers.IntegerField(required=False, min_value=0, max_value=INT32_MAX, default=0)
    limit = serializers.IntegerField(required=False, min_value=0, default=100, help_text="capped at 100")
    level = serializers.ChoiceField(choices=LogLevel.choices, required=False, help_text="minimum level")


class BuildLogsQuerySerializer(serializers.Serializer):
    """Query of ``GET /templates/{id}/builds/{buildID}/logs``."""

    cursor = serializers.IntegerField(required=False, min_value=0, max_value=MAX_UNIX_MS,
                                      help_text="Unix time in ms to start from")
    limit = serializers.IntegerField(required=False, min_value=0, default=100, help_text="capped at 100")
    direction = serializers.ChoiceField(choices=["forward", "backward"], required=False, default="forward")
    level = serializers.ChoiceField(choices=LogLevel.choices, required=False, help_text="minimum level")
    source = serializers.ChoiceField(choices=["temporary", "persistent"], required=False, help_text="ignored")


class TemplateListQuerySerializer(serializers.Serializer):
    teamID = serializers.CharField(required=False, allow_blank=True)


class TemplatePageQuerySerializer(TemplateListQuerySerializer):
    nextToken = serializers.CharField(required=False, allow_blank=True)
    limit = serializers.IntegerField(required=False, min_value=1, max_value=100, default=100)


class TemplateDetailQuerySerializer(serializers.Serializer):
    nextToken = serializers.CharField(required=False, allow_blank=True)
    limit = serializers.IntegerField(required=False, min_value=1, max_value=100, default=100)


class AssignTagsSerializer(serializers.Serializer):
    """Body of ``POST /templates/tags``."""

    target = StrictCharField()
    tags = serializers.ListField(child=StrictCharField(allow_blank=True))


class DeleteTagsSerializer(serializers.Serializer):
    """Body of ``DELETE /templates/tags``."""

    name = StrictCharField()
    tags = serializers.ListField(child=StrictCharField(allow_blank=True))


class TemplateUpdateSerializer(serializers.Serializer):
    """Body of ``PATCH /templates/{id}`` and ``PATCH /v2/templates/{id}``."""

    public = StrictBooleanField()


# --------------------------------------------------------------------------- responses


class TemplateRequestResponseV3Serializer(serializers.Serializer):
    """``POST /v3/templates`` answer: all six fields, always."""

    templateID = serializers.CharField(source="template.id")
    buildID = serializers.CharField(source="build.id")
    public = serializers.BooleanField(source="template.public")
    names = serializers.ListField(child=serializers.CharField(), source="template.names")
    tags = serializers.ListField(child=serializers.CharField())
    aliases = serializers.SerializerMethodField()

    def get_aliases(self, obj) -> list[str]:
        return [obj.template.alias]


class TemplateBuildFileUploadSerializer(serializers.Serializer):
    present = serializers.BooleanField()
    url = serializers.CharField()


class BuildLogEntrySerializer(serializers.Serializer):
    timestamp = serializers.DateTimeField()
    level = serializers.ChoiceField(choices=LogLevel.choices)
    message = serializers.CharField()
    step = serializers.CharField(required=False)

    def to_representation(self, instance):
        data = super().to_representation(instance)
        if not data.get("step"):
            data.pop("step", None)
        return data


class BuildStatusReasonSerializer(serializers.Serializer):
    message = serializers.CharField(source="reason_message")
    step = serializers.CharField(source="reason_step", required=False)

    def to_representation(self, instance):
        data = super().to_representation(instance)
        data["message"] = data["message"] or "Build failed"
        if not data.get("step"):
            data.pop("step", None)
        return data


class TemplateBuildInfoSerializer(serializers.Serializer):
    """``GET …/builds/{buildID}/status`` answer; ``instance`` is ``(build, entries)``."""

    templateID = serializers.CharField()
    buildID = serializers.CharField()
    status = serializers.ChoiceField(choices=BuildStatus.choices)
    logEntries = BuildLogEntrySerializer(many=True)
    logs = serializers.ListField(child=serializers.CharField(), help_text="always empty (legacy text lines)")
    reason = BuildStatusReasonSerializer(required=False)

    def to_representation(self, instance):
        build, entries = instance
        data = {"templateID": build.template_id, "buildID": str(build.pk), "status": build.status,
                "logEntries": BuildLogEntrySerializer(entries, many=True).data, "logs": []}
        if build.status == BuildStatus.ERROR:
            data["reason"] = BuildStatusReasonSerializer(build).data
        return data


class TemplateBuildLogsResponseSerializer(serializers.Serializer):
    logs = BuildLogEntrySerializer(many=True)


class TemplateBuildSerializer(serializers.Serializer):
    """One build in ``GET /templates/{id}`` (``TemplateBuild``)."""

    buildID = serializers.CharField(source="id")
    status = serializers.ChoiceField(choices=BuildStatus.choices)
    createdAt = serializers.DateTimeField(source="created_at")
    updatedAt = serializers.DateTimeField(source="updated_at")
    finishedAt = serializers.DateTimeField(source="finished_at", required=False)
    cpuCount = serializers.IntegerField(source="cpu_count")
    memoryMB = serializers.IntegerField(source="memory_mb")
    diskSizeMB = serializers.IntegerField(source="disk_size_mb")
    envdVersion = serializers.CharField(source="envd_version")

    def to_representation(self, instance):
        data = super().to_representation(instance)
        if data.get("finishedAt") is None:
            data.pop("finishedAt", None)
        return data


class CreatedBySerializer(serializers.Serializer):
    id = serializers.UUIDField()
    email = serializers.CharField(allow_null=True)


class TemplateSerializer(serializers.Serializer):
    """A template in ``GET /templates`` and ``GET /v2/templates`` (``Template``); ``instance``
    is a ``lifecycle.queries.TemplateView``."""

    templateID = serializers.CharField(source="template.id")
    buildID = serializers.CharField(source="build_id")
    cpuCount = serializers.SerializerMethodField()
    memoryMB = serializers.SerializerMethodField()
    diskSizeMB = serializers.SerializerMethodField()
    public = serializers.BooleanField(source="template.public")
    aliases = serializers.SerializerMethodField()
    names = serializers.ListField(child=serializers.CharField(), source="template.names")
    createdAt = serializers.DateTimeField(source="template.created_at")
    updatedAt = serializers.DateTimeField(source="template.updated_at")
    createdBy = serializers.SerializerMethodField()
    lastSpawnedAt = serializers.DateTimeField(source="last_spawned_at", allow_null=True)
    spawnCount = serializers.IntegerField(source="spawn_count")
    buildCount = serializers.IntegerField(source="build_count")
    envdVersion = serializers.SerializerMethodField()
    buildStatus = serializers.ChoiceField(choices=BuildStatus.choices, source="build_status")

    def _of(self, view, field: str):
        return getattr(view.build if view.build is not None else view.template, field)

    def get_cpuCount(self, view) -> int:  # noqa: N802 - wire name
        return self._of(view, "cpu_count")

    def get_memoryMB(self, view) -> int:  # noqa: N802
        return self._of(view, "memory_mb")

    def get_diskSizeMB(self, view) -> int:  # noqa: N802
        return self._of(view, "disk_size_mb")

    def get_envdVersion(self, view) -> str:  # noqa: N802
        return self._of(view, "envd_version")

    def get_aliases(self, view) -> list[str]:
        return [view.template.alias] if view.template.alias else []

    @extend_schema_field(CreatedBySerializer(allow_null=True))
    def get_createdBy(self, view):  # noqa: N802
        return None  # aenv does not record who registered a template


class TemplateWithBuildsSerializer(TemplateSerializer):
    """``GET /templates/{id}`` answer (``TemplateWithBuilds``)."""

    builds = TemplateBuildSerializer(many=True)


class TemplateAliasResponseSerializer(serializers.Serializer):
    templateID = serializers.CharField(source="id")
    public = serializers.BooleanField()


class TemplateTagSerializer(serializers.Serializer):
    tag = serializers.CharField()
    buildID = serializers.CharField(source="build_id")
    createdAt = serializers.DateTimeField(source="created_at")


class AssignedTemplateTagsSerializer(serializers.Serializer):
    tags = serializers.ListField(child=serializers.CharField())
    buildID = serializers.CharField(source="build_id")


class TemplateUpdateResponseSerializer(serializers.Serializer):
    names = serializers.ListField(child=serializers.CharField())
