"""The base of the API's hot serializers: each instance copies its declared fields shallowly.

DRF deep-copies every declared field for every serializer instance (``Field.__deepcopy__``
builds each field again from its arguments), so that binding a field to one instance cannot
touch another. A declared field is a prototype nothing binds or changes: a shallow copy gets
its own ``__dict__``, which is all ``bind`` and validation write to (``field_name``, ``parent``,
``source_attrs``, the lazily computed ``_validators``), at a fraction of the cost (issue 26: a
create's body and answer, ~0.2 ms of the API's CPU per request on a loaded host; connect's,
~0.15 ms). A field holding other fields (a nested serializer, a ``child``) is still deep-copied:
its children are bound to their parent, and a shallow copy would share them across requests."""
from __future__ import annotations

import copy

from rest_framework import serializers


def _copied(field: serializers.Field) -> serializers.Field:
    if isinstance(field, serializers.BaseSerializer) or hasattr(field, "child"):
        return copy.deepcopy(field)
    return copy.copy(field)


class Serializer(serializers.Serializer):
    # DRF's Serializer whose instances copy the declared fields as the module says. No
    # docstring: drf-spectacular would publish it as the description of each subclass without one.

    def get_fields(self):
        return {name: _copied(field) for name, field in self._declared_fields.items()}
