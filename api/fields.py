"""The field types every request body of the REST API uses, strict about JSON types
(DRF would turn ``"120"`` into 120 or ``1`` into True; a client sending the wrong type
has a bug we report with a 400), and the one error body of every non-2xx answer."""
from django.conf import settings
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers


# --------------------------------------------------------------------------- strict fields


class StrictCharField(serializers.CharField):
    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictIntegerField(serializers.IntegerField):
    default_error_messages = {"invalid": "A JSON integer is required."}

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    default_error_messages = {"invalid": "Must be a JSON boolean (true or false)."}

    def to_internal_value(self, data):
        if not isinstance(data, bool):
            self.fail("invalid")
        return data


class TimeoutField(StrictIntegerField):
    """Seconds from 0 to ``AENV_MAX_TIMEOUT``, the limit read when a request is checked
    (not when this module is imported)."""

    default_error_messages = {"max_timeout": "Ensure this value is less than or equal to {max_value}."}

    def __init__(self, **kwargs):
        kwargs.setdefault("min_value", 0)
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        value = super().to_internal_value(data)
        if value > settings.AENV_MAX_TIMEOUT:
            self.fail("max_timeout", max_value=settings.AENV_MAX_TIMEOUT)
        return value


def default_timeout() -> int:
    return settings.AENV_DEFAULT_TIMEOUT


# The last second (and millisecond) a date can say, 9999-12-31T23:59:59Z: a query's timestamp
# past it overflowed datetime (a 500) before these bounds.
MAX_UNIX_S = 253402300799
MAX_UNIX_MS = MAX_UNIX_S * 1000 + 999
INT32_MAX = 2**31 - 1  # E2B's int32 offsets; an SQL OFFSET past int64 overflowed the driver


class StringMapField(serializers.DictField):
    """A JSON object mapping strings to strings (metadata, envVars)."""

    child = StrictCharField(allow_blank=True, trim_whitespace=False)

    def __init__(self, **kwargs):
        kwargs.setdefault("required", False)
        kwargs.setdefault("allow_null", True)
        super().__init__(**kwargs)


class EnvVarsField(StringMapField):
    """``envVars``: names a process environment can hold (not empty, no ``=``): ``{"A=B": "x"}``
    would reach the guest as ``A=B=x``, variable ``A``, silently another one."""

    def to_internal_value(self, data):
        value = super().to_internal_value(data)
        bad = [name for name in value if not name or "=" in name]
        if bad:
            raise serializers.ValidationError(f"environment variable names must be non-empty and without '=': "
                                              f"{', '.join(map(repr, bad[:5]))}")
        return value


class JsonObjectField(serializers.JSONField):
    """Any JSON object (e.g. the network settings, checked by the serializer that has them)."""

    default_error_messages = {"not_object": "Must be a JSON object."}

    def to_internal_value(self, data):
        if data is not None and not isinstance(data, dict):
            self.fail("not_object")
        return data


@extend_schema_field({"type": "object", "properties": {"enabled": {"type": "boolean"}}})
class AutoResumeField(serializers.Field):
    """``{"enabled": bool}`` (current SDKs) or a bare boolean (older payloads)."""

    default_error_messages = {"invalid": 'Must be {{"enabled": true|false}} or a boolean.'}

    def to_internal_value(self, data):
        if isinstance(data, bool):
            return data
        if isinstance(data, dict) and isinstance(data.get("enabled", False), bool):
            return bool(data.get("enabled", False))
        self.fail("invalid")

    def to_representation(self, value):
        return {"enabled": bool(value)}


class ErrorSerializer(serializers.Serializer):
    """Every non-2xx answer."""

    code = serializers.IntegerField()
    message = serializers.CharField()
    error_code = serializers.CharField(required=False)

