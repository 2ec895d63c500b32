"""The E2B wire contract: request bodies in, response models out.

Field names are E2B's (camelCase, plus the snake_case ``allow_internet_access``
the SDK really sends). Input fields are strict about JSON types — DRF would
happily turn ``"120"`` into 120 or ``1`` into True, but a client sending the wrong
type has a bug we should report (400), not guess around. Unknown fields are
ignored: newer SDKs add fields (``mcp``, ``iam``…) and must keep working."""
from django.conf import settings
from rest_framework import serializers
from rest_framework.settings import api_settings

from lifecycle.sandboxes import egress_proxy
from lifecycle.sandboxes import network as sandbox_network
from sandboxes.errors import Invalid
from lifecycle.sandboxes.options import SandboxOptions
from api.serializer_base import Serializer
from api.fields import AutoResumeField, EnvVarsField, JsonObjectField, StrictBooleanField, StrictCharField, StringMapField, TimeoutField, default_timeout


# --------------------------------------------------------------------------- requests


def _checked(check, *args):
    """A ``lifecycle.sandboxes.network`` check at the edge: its Invalid becomes a 400 whose
    message is exactly the check's (E2B's for a bad egress policy)."""
    try:
        return check(*args)
    except Invalid as exc:
        raise serializers.ValidationError({api_settings.NON_FIELD_ERRORS_KEY: [exc.message]}) from None


class NewSandboxV2Serializer(Serializer):
    """Body of ``POST /v2/sandboxes`` (SDK ≥2.51)."""

    templateID = StrictCharField(max_length=255)
    timeout = TimeoutField(required=False)
    metadata = StringMapField()
    envVars = EnvVarsField()
    # What happens at the end of the TTL: absent → pause (aenv keeps work by default),
    # false → kill (old SDKs always send false, which keeps E2B's kill for them).
    autoPause = StrictBooleanField(required=False, default=True)
    # false: the expiry pause is filesystem-only (processes are gone after a resume).
    autoPauseMemory = StrictBooleanField(required=False, allow_null=True, default=None)
    autoResume = AutoResumeField(required=False, default=False)
    allow_internet_access = StrictBooleanField(required=False, allow_null=True, default=None)
    network = JsonObjectField(required=False, allow_null=True, default=None)
    # E2B's [{name, path}]: checked against the team's volumes by lifecycle.volumes.mounts.
    volumeMounts = serializers.JSONField(required=False, allow_null=True, default=None)
    # v2 dropped `secure` because every sandbox is secure; accept it if a client sends it.
    secure = StrictBooleanField(required=False, default=True)

    def validate(self, data):
        # What aenv enforces (egress allow / deny, no internet, private ports) is stored as
        # checked; what it cannot (httpsPorts, egressProxy.tls) is a 400, never ignored.
        data["network"] = _checked(sandbox_network.checked_create, data.get("network"),
                                   data.get("allow_internet_access"))
        return data

    def to_create(self) -> tuple[str, int | None, SandboxOptions]:
        """(templateID, timeout or None for the default, the sandbox's options)."""
        d = self.validated_data
        return d["templateID"], d.get("timeout"), SandboxOptions(
            metadata=d.get("metadata") or {}, env_vars=d.get("envVars") or {}, secure=d["secure"],
            auto_pause=d["autoPause"], auto_pause_memory=d.get("autoPauseMemory") is not False,
            auto_resume=d["autoResume"], allow_internet_access=d["allow_internet_access"],
            network=d["network"],
        )


class NewSandboxSerializer(NewSandboxV2Serializer):
    """Body of ``POST /sandboxes`` (SDK ≤2.50): same fields, ``secure`` defaults to false."""

    secure = StrictBooleanField(required=False, default=False)


class NetworkUpdateSerializer(Serializer):
    """Body of ``PUT /sandboxes/{id}/network`` (E2B ``SandboxNetworkUpdateConfig``): the
    egress config that replaces the sandbox's; omitted fields are cleared, ``{}`` allows all.
    The fields below document it; the check itself is ``lifecycle.sandboxes.network``'s
    (snake_case spellings accepted), shared with create."""

    allowOut = serializers.ListField(child=serializers.CharField(), required=False)
    denyOut = serializers.ListField(child=serializers.CharField(), required=False)
    dnsServers = serializers.ListField(child=serializers.CharField(), required=False,
                                       help_text="IPv4 resolvers the sandbox's DNS (53, 853) may reach whatever the "
                                                 "CIDRs say; omitted: 8.8.8.8 when allowOut names domains, []: none")
    egressProxy = serializers.JSONField(required=False, allow_null=True,
                                        help_text="{address, username, password}: an upstream SOCKS5 (or http://) "
                                                  "proxy every allowed TCP connection leaves through; tls refused")
    rules = serializers.JSONField(required=False,
                                  help_text="{host: [{transform: {headers}}]}: needs allowOut to name domains")
    allow_internet_access = serializers.BooleanField(required=False, allow_null=True)

    def to_internal_value(self, data):
        return _checked(sandbox_network.checked_update, data)


class TimeoutSerializer(Serializer):
    """Body of ``POST /sandboxes/{id}/timeout``."""

    timeout = TimeoutField()


class RefreshSerializer(Serializer):
    """Body of ``POST /sandboxes/{id}/refreshes`` (extend-only keep-alive)."""

    duration = TimeoutField(required=False, default=default_timeout)


class PauseSerializer(Serializer):
    """Body of ``POST /sandboxes/{id}/pause``: empty, ``{}``, ``{"memory": bool}`` and
    ``requireHealthyGuest`` (SDK ``pause(strict=True)``: refuse with 503 when the guest
    agent does not answer, instead of pausing and marking the pause)."""

    memory = StrictBooleanField(required=False, allow_null=True, default=None)
    requireHealthyGuest = StrictBooleanField(required=False, allow_null=True, default=None)


class ResumeSerializer(Serializer):
    """Body of ``POST /sandboxes/{id}/resume`` (legacy) and ``/connect`` (v1): ``{"timeout": N}``;
    a missing timeout means the default."""

    timeout = TimeoutField(required=False, allow_null=True, default=None)
    autoPause = StrictBooleanField(required=False, allow_null=True, default=None)


class ConnectV2Serializer(ResumeSerializer):
    """Body of ``POST /v2/sandboxes/{id}/connect``: ``timeout`` and ``memory`` optional
    (``memory: false`` = cold boot on the disk, ignoring the memory snapshot)."""

    memory = StrictBooleanField(required=False, allow_null=True, default=None)


class ListQuerySerializer(Serializer):
    """Query string of ``GET /v2/sandboxes``."""

    metadata = serializers.CharField(required=False, allow_blank=True)
    state = serializers.CharField(required=False, allow_blank=True)
    order = serializers.ChoiceField(choices=["asc", "desc"], required=False, default="desc")
    startedAfter = serializers.DateTimeField(required=False)
    template = serializers.CharField(required=False, allow_blank=True)
    nextToken = serializers.CharField(required=False, allow_blank=True)
    limit = serializers.IntegerField(required=False, min_value=1, max_value=100, default=100)

    def validate_state(self, value):
        states = [s.strip() for s in value.split(",") if s.strip()]
        bad = sorted(set(states) - {"running", "paused"})
        if bad:
            raise serializers.ValidationError(f"unknown state {', '.join(bad)}; use running and/or paused")
        return states

    def to_internal_value(self, data):
        # A '+' in an unencoded offset arrives as a space; put it back.
        if "startedAfter" in data:
            data = data.copy()
            data["startedAfter"] = data["startedAfter"].replace(" ", "+")
        return super().to_internal_value(data)


# --------------------------------------------------------------------------- responses


def _domain(_obj=None):
    return settings.AENV_SANDBOX_DOMAIN


def traffic_access_token(sandbox) -> str | None:
    """E2B's ``trafficAccessToken``: the token the data plane requires on the sandbox's ports
    (all but envd's) when it was created with ``allowPublicTraffic: false``; null when public."""
    return sandbox.traffic_access_token or None


# The answers below are plain Serializers over a ``Sandbox`` row, every field declared: a
# ModelSerializer would read the model's fields again for each answer (issue 26: ~1 ms of the
# API's CPU per create, resume or connect on a loaded host), to add none.


class SandboxSerializer(Serializer):
    """Model ``Sandbox``: the answer to create (and, later, connect)."""

    sandboxID = serializers.CharField(source="id")
    templateID = serializers.CharField(source="template_id")
    clientID = serializers.CharField(source="client_id")
    envdVersion = serializers.CharField(source="envd_version")
    envdAccessToken = serializers.CharField(source="envd_access_token", required=False)
    trafficAccessToken = serializers.SerializerMethodField()
    domain = serializers.SerializerMethodField()
    alias = serializers.CharField()

    def get_trafficAccessToken(self, obj) -> str | None:  # noqa: N802 - wire name
        return traffic_access_token(obj)

    def get_domain(self, obj) -> str | None:
        return _domain()

    def to_representation(self, instance):
        data = super().to_representation(instance)
        if not instance.secure:
            data.pop("envdAccessToken", None)  # only secure sandboxes have a token
        return data


class ListedSandboxSerializer(Serializer):
    """Model ``ListedSandbox``: every field the SDK requires is always present."""

    sandboxID = serializers.CharField(source="id")
    templateID = serializers.CharField(source="template_id")
    clientID = serializers.CharField(source="client_id")
    alias = serializers.CharField()
    startedAt = serializers.DateTimeField(source="started_at")
    endAt = serializers.DateTimeField(source="end_at")
    cpuCount = serializers.IntegerField(source="cpu_count")
    memoryMB = serializers.IntegerField(source="memory_mb")
    diskSizeMB = serializers.IntegerField(source="disk_size_mb")
    state = serializers.ChoiceField(choices=["running", "paused"], source="e2b_state")
    envdVersion = serializers.CharField(source="envd_version")
    metadata = serializers.DictField(child=serializers.CharField())

    def to_representation(self, instance):
        data = super().to_representation(instance)
        # E2B's volumeMounts ([{name, path}]), when the view read them (serializer context)
        volume_mounts = self.context.get("volume_mounts")
        if volume_mounts is not None:
            data["volumeMounts"] = volume_mounts.get(instance.id, [])
        # E2B's envdUnresponsiveAtPause: only for a paused sandbox whose guest agent did not
        # answer at its pause (omitted otherwise, as E2B does)
        if instance.envd_unresponsive_at_pause and data.get("state") == "paused":
            data["envdUnresponsiveAtPause"] = True
        return data


class LifecycleSerializer(Serializer):
    autoResume = serializers.BooleanField(source="auto_resume")
    onTimeout = serializers.SerializerMethodField()

    def get_onTimeout(self, obj) -> str:  # noqa: N802 - wire name
        return "pause" if obj.auto_pause else "kill"


class SandboxDetailSerializer(ListedSandboxSerializer):
    """Model ``SandboxDetail``: ListedSandbox plus token, domain, network and lifecycle."""

    envdAccessToken = serializers.CharField(source="envd_access_token", required=False)
    domain = serializers.SerializerMethodField()
    allowInternetAccess = serializers.BooleanField(source="allow_internet_access", allow_null=True)
    network = serializers.JSONField(allow_null=True)
    lifecycle = LifecycleSerializer(source="*")
    # Not in E2B 2.63's SandboxDetail (only its Sandbox model, the create / connect answer,
    # carries it; the SDK keeps unknown detail fields aside): aenv also shows it here, next
    # to envdAccessToken, so a client that only has the id can reach a private sandbox.
    trafficAccessToken = serializers.SerializerMethodField()

    def get_domain(self, obj) -> str | None:
        return _domain()

    def get_trafficAccessToken(self, obj) -> str | None:  # noqa: N802 - wire name
        return traffic_access_token(obj)

    def to_representation(self, instance):
        data = super().to_representation(instance)
        if not instance.secure:
            data.pop("envdAccessToken", None)
        if data.get("network") is None:
            data.pop("network", None)  # optional object: omit rather than send null
        else:
            data["network"] = egress_proxy.public(data["network"])  # never the sealed password
        return data
