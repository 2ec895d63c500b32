"""One row by its key, with ``select_related`` rows, its SQL compiled once per process and
database instead of on every call.

Why (issue 26, docs/benchmarks.md fourth round): for a one-row read Django spends more CPU
compiling the query (the select list of every column of each joined model, the joins, the
converters) than the database spends running it. ``PreparedGet`` compiles the queryset once
with a marker for the key, keeps the SQL, the parameters, the compiler's row layout
(``klass_info``, the related populators) and the converters, and then per call runs the SQL
with the key and builds the model instance the way Django's ``ModelIterable`` does: the same
instance, its ``select_related`` objects cached on it.

Only for querysets without per-call parts (no ``now()``, no user input besides the key): the
SQL is built once. A different database alias, vendor or a schema change (a restart) makes
its own."""
from __future__ import annotations

import threading

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models.query import get_related_populators

_MARK = "\x00aenv-prepared-key\x00"


class PreparedGet:
    """``make().get(pk=key)`` with the SQL compiled once per database alias."""

    def __init__(self, make):
        self.make = make  # () -> QuerySet: the read, without the key's filter
        self._compiled: dict[str, tuple] = {}
        self._lock = threading.Lock()

    def _compile(self, using: str) -> tuple:
        qs = self.make().using(using).filter(pk=_MARK).order_by()
        qs.query.set_limits(high=2)  # as get(): a second row would be an error
        compiler = qs.query.get_compiler(using=using)
        sql, params = compiler.as_sql()
        params = list(params)
        if params.count(_MARK) != 1:
            raise ValueError(f"PreparedGet: the key's marker is {params.count(_MARK)} times in the parameters")
        klass_info, select = compiler.klass_info, compiler.select
        start, end = klass_info["select_fields"][0], klass_info["select_fields"][-1] + 1
        converters = compiler.get_converters([s[0] for s in select[0:compiler.col_count]])
        entry = (sql, params, params.index(_MARK), compiler, converters, klass_info["model"],
                 [f[0].target.attname for f in select[start:end]], start, end,
                 get_related_populators(klass_info, select, using))
        with self._lock:
            self._compiled[using] = entry
        return entry

    def __call__(self, key, using: str = DEFAULT_DB_ALIAS):
        entry = self._compiled.get(using) or self._compile(using)
        sql, params, at, compiler, converters, model, init_list, start, end, populators = entry
        params = list(params)
        params[at] = model._meta.pk.get_db_prep_value(key, connections[using])
        with connections[using].cursor() as cursor:
            cursor.execute(sql, params)
            rows = cursor.fetchmany(2)
        if not rows:
            raise model.DoesNotExist(f"{model._meta.object_name} matching query does not exist.")
        if len(rows) > 1:
            raise model.MultipleObjectsReturned(f"get() returned more than one {model._meta.object_name}")
        row = list(rows[0])
        if converters:
            row = next(iter(compiler.apply_converters([row], converters)))
        obj = model.from_db(using, init_list, row[start:end])
        for populator in populators:
            populator.populate(row, obj)
        return obj
