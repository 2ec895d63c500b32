"""Reads with their SQL compiled once per process and database instead of on every call.

Why (issue 26, docs/benchmarks.md fourth and fifth rounds): for the small reads of a
lifecycle call Django spends more CPU compiling the query (the select list of every column
of each joined model, the joins, the lookups, the converters) than the database spends
running it. ``PreparedQuery`` compiles a queryset once with a marker value for each of its
per-call parameters, keeps the SQL, the parameters, the compiler's row layout and the
converters, and then per call puts the values (prepared for the database by the same field
the lookup would use) where the markers were, runs the SQL and builds the rows the way
Django's iterables do: model instances with their ``select_related`` objects cached on
them (``ModelIterable``), tuples (``values_list``) or single values (``flat=True``).
``PreparedGet`` is one row by its key (``get(pk=…)``).

Only for querysets whose every per-call part is a declared parameter (no ``now()`` baked
in, no user input besides the parameters): the SQL is built once. A different database
alias or vendor, or a schema change (a restart), makes its own."""
from __future__ import annotations

import functools
import threading
import uuid
from datetime import datetime, timezone as dt_timezone

from django.db import DEFAULT_DB_ALIAS, connections, models, router, transaction
from django.db.models.query import FlatValuesListIterable, ModelIterable, ValuesListIterable, get_related_populators

def _marker(name: str, field):
    """A value of ``field``'s type that nothing real equals (the compiled SQL's parameter
    at that place is found by it); a foreign key's is its target's."""
    if isinstance(field, models.ForeignKey):
        return _marker(name, field.target_field)
    if isinstance(field, models.UUIDField):
        return uuid.uuid4()
    if isinstance(field, models.DateTimeField):
        # a random instant in 1901: no heartbeat, expiry or creation time is there
        return datetime(1901, 1, 1, tzinfo=dt_timezone.utc).replace(microsecond=uuid.uuid4().int % 999_999 + 1,
                                                                     second=uuid.uuid4().int % 60)
    if isinstance(field, (models.CharField, models.TextField)):
        return f"\x00aenv-prepared-{name}-{uuid.uuid4().hex}\x00"
    if isinstance(field, models.JSONField):
        return {f"aenv-prepared-{name}": uuid.uuid4().hex}
    if isinstance(field, models.BooleanField):
        return False  # no value of its own: placed by difference (_placed)
    if isinstance(field, models.IntegerField):
        # negative and far from the small constants a statement holds (an F() + 1), in 32 bits
        return -(2 ** 24 + uuid.uuid4().int % (2 ** 31 - 2 ** 25))
    raise TypeError(f"PreparedQuery: no marker for a {type(field).__name__} parameter ({name})")


try:
    from psycopg.types.json import Json, Jsonb  # PostgreSQL's adapted JSON

    _JSON_WRAPPERS: tuple = (Json, Jsonb)
except ImportError:  # pragma: no cover - SQLite only
    _JSON_WRAPPERS = ()


def _same(param, prepped) -> bool:
    """A compiled parameter is this prepared value; psycopg's JSON wrappers compare by
    identity, so by what they wrap."""
    if type(param) is not type(prepped):
        return False
    if isinstance(prepped, _JSON_WRAPPERS):
        return param.obj == prepped.obj
    return param == prepped


def _preparer(field, save: bool):
    """``(value, connection)`` -> the value for the database: as a lookup prepares it, or
    (``save``) as ``update()`` prepares a column's new value (a foreign key's row by its key;
    a JSON None is NULL)."""
    if not save:
        return functools.partial(field.get_db_prep_value, prepared=False)
    if field.remote_field is None:
        return field.get_db_prep_save

    def related(value, connection):
        if hasattr(value, "prepare_database_save"):
            value = value.prepare_database_save(field)
        return field.get_db_prep_save(value, connection)
    return related


def _placed(specs: dict, compile_, connection, what: str) -> tuple:
    """``compile_(markers)``'s (sql, params, extra) (it also names the parameters that are new
    column values), where each parameter landed in params: (position, name) pairs, a parameter
    used twice twice, and each one's ``_preparer``. A boolean has no value nothing else
    equals, so it is found where the parameters change when compiled again with True instead
    of False; one that changes the SQL (``WHERE NOT flag``) is refused."""
    marks = {name: _marker(name, field) for name, field in specs.items()}
    sql, params, extra, saved = compile_(marks)
    params = list(params)
    preps = {name: _preparer(field, name in saved) for name, field in specs.items()}
    slots = []
    for name, field in specs.items():
        if isinstance(field, models.BooleanField):
            other_sql, other, *_ = compile_({**marks, name: True})
            if other_sql != sql or len(other) != len(params):
                raise TypeError(f"{what}: boolean parameter {name!r} changes the SQL, not a value in it")
            at = [i for i, (a, b) in enumerate(zip(params, other)) if not _same(a, b)]
        else:
            prepped = preps[name](marks[name], connection)
            at = [i for i, p in enumerate(params) if _same(p, prepped)]
        if not at:
            raise ValueError(f"{what}: parameter {name!r} is not in the compiled statement's parameters")
        slots.extend((i, name) for i in at)
    return sql, params, slots, extra, preps


def _filled(preps: dict, params: list, slots: list, values: dict, connection) -> list:
    """The compiled parameters with this call's values (each prepared by its field) in place."""
    params = list(params)
    prepped = {name: prep(values[name], connection) for name, prep in preps.items()}
    for i, name in slots:
        params[i] = prepped[name]
    return params


class PreparedQuery:
    """``make(**params)``'s rows with the SQL compiled once per database alias.

    ``make`` builds the queryset from the parameters (any lookups, ``select_related``,
    ``order_by``, slicing, ``values_list``, ``select_for_update``); ``params`` names each
    per-call parameter and the model field whose database value it is (for a foreign key:
    the field it points to, e.g. ``Team._meta.pk`` for ``team=…``). Each parameter must
    reach the SQL as one value per use (``pk=x``, ``x__gte=…``), not through an expression
    that transforms it."""

    def __init__(self, make, **params):
        self.make = make  # (**params) -> QuerySet
        self.params = params  # name -> the model field whose value it is
        self._compiled: dict[str, tuple] = {}
        self._lock = threading.Lock()

    def _compile(self, using: str) -> tuple:
        def compile_(marks):
            qs = self.make(**marks).using(using)
            compiler = qs.query.get_compiler(using=using)
            return *compiler.as_sql(), (qs._iterable_class, compiler), frozenset()

        sql, params, slots, (iterable, compiler), preps = _placed(self.params, compile_, connections[using],
                                                                  "PreparedQuery")
        if iterable not in (ModelIterable, ValuesListIterable, FlatValuesListIterable):
            raise TypeError(f"PreparedQuery: {iterable.__name__} rows are not supported")
        select = compiler.select
        fields = [s[0] for s in select[0:compiler.col_count]]
        converters = compiler.get_converters(fields)
        trim = compiler.col_count if compiler.has_extra_select else None
        layout = None
        if iterable is ModelIterable:
            klass_info = compiler.klass_info
            start, end = klass_info["select_fields"][0], klass_info["select_fields"][-1] + 1
            layout = (klass_info["model"], [f[0].target.attname for f in select[start:end]], start, end,
                      get_related_populators(klass_info, select, using), compiler.annotation_col_map)
        entry = (sql, params, slots, preps, compiler, converters, trim, iterable, layout)
        with self._lock:
            self._compiled[using] = entry
        return entry

    def rows(self, using: str = DEFAULT_DB_ALIAS, **values) -> list:
        """The queryset's rows for these parameter values, as ``list(make(**values))``."""
        entry = self._compiled.get(using) or self._compile(using)
        sql, params, slots, preps, compiler, converters, trim, iterable, layout = entry
        connection = connections[using]
        params = _filled(preps, params, slots, values, connection)
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            found = cursor.fetchall()
        if trim is not None:
            found = [r[:trim] for r in found]
        if converters:
            found = list(compiler.apply_converters(found, converters))
        if iterable is FlatValuesListIterable:
            return [r[0] for r in found]
        if iterable is ValuesListIterable:
            return [tuple(r) for r in found]
        model, init_list, start, end, populators, annotations = layout
        out = []
        for row in found:
            obj = model.from_db(using, init_list, row[start:end])
            for populator in populators:
                populator.populate(row, obj)
            for attr, col in (annotations or {}).items():
                setattr(obj, attr, row[col])
            out.append(obj)
        return out

    def first(self, using: str = DEFAULT_DB_ALIAS, **values):
        """The first row, or None (the queryset should be sliced ``[:1]`` and ordered)."""
        found = self.rows(using, **values)
        return found[0] if found else None


class PreparedGet:
    """``make().get(pk=key)`` with the SQL compiled once per database alias."""

    def __init__(self, make):
        self.make = make  # () -> QuerySet: the read, without the key's filter
        self._query: PreparedQuery | None = None
        self._model = None

    def _sliced(self, key):
        qs = self.make().filter(pk=key).order_by()
        qs.query.set_limits(high=2)  # as get(): a second row would be an error
        return qs

    def __call__(self, key, using: str = DEFAULT_DB_ALIAS):
        if self._query is None:
            self._model = self.make().model
            self._query = PreparedQuery(self._sliced, key=self._model._meta.pk)
        model = self._model
        rows = self._query.rows(using, key=key)
        if not rows:
            raise model.DoesNotExist(f"{model._meta.object_name} matching query does not exist.")
        if len(rows) > 1:
            raise model.MultipleObjectsReturned(f"get() returned more than one {model._meta.object_name}")
        return rows[0]


class PreparedUpdate:
    """``qs.update(**values)`` for ``(qs, values) = make(**params)``, its SQL compiled once per
    database alias (the statement Django's ``update()`` builds, run with these values, a new
    column value prepared as it prepares one); the number of rows it changed. ``params`` as for
    ``PreparedQuery`` (a foreign key's own field takes its key or a row); a value may be a
    parameter or fixed (an expression such as ``F("n") + 1``, or None: ``= NULL`` in the SQL, is
    compiled once with it)."""

    def __init__(self, make, **params):
        self.make = make  # (**params) -> (QuerySet, {field: value})
        self.params = params
        self._compiled: dict[str, tuple] = {}
        self._lock = threading.Lock()

    def _compile(self, using: str) -> tuple:
        from django.db.models import sql as django_sql  # noqa: PLC0415

        def compile_(marks):
            qs, values = self.make(**marks)
            query = qs.using(using).query.chain(django_sql.UpdateQuery)
            query.add_update_values(values)
            sql, params = query.get_compiler(using=using).as_sql()
            if query.related_updates or not sql:
                raise TypeError("PreparedUpdate: only an update of one table's own fields")
            new_values = frozenset(name for name, mark in marks.items() if any(v is mark for v in values.values()))
            return sql, params, None, new_values

        sql, params, slots, _, preps = _placed(self.params, compile_, connections[using], "PreparedUpdate")
        entry = (sql, params, slots, preps)
        with self._lock:
            self._compiled[using] = entry
        return entry

    def __call__(self, using: str = DEFAULT_DB_ALIAS, **values) -> int:
        sql, params, slots, preps = self._compiled.get(using) or self._compile(using)
        connection = connections[using]
        params = _filled(preps, params, slots, values, connection)
        # as update(): an error marks the enclosing atomic block for rollback
        with transaction.mark_for_rollback_on_error(using), connection.cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.rowcount


# An INSERT's SQL per model, database and columns (``insert``).
_INSERTS: dict[tuple, str] = {}


def insert(obj, using: str | None = None) -> None:
    """``obj.save(force_insert=True)`` for a new row, its INSERT built once per model and
    database: the same statement (every local concrete field but an automatic key, each value
    ``pre_save`` and prepared for the database by its field, as Django's insert does; the
    database's generated key read back with ``RETURNING`` or as the last row id). Only for
    models whose saves nothing listens to (``pre_save`` / ``post_save`` receivers, which this
    does not send) and without inheritance; a value that is an expression goes through
    ``save()``."""
    model = type(obj)
    meta = model._meta
    if meta.parents or meta.proxy:
        raise TypeError(f"prepared insert: {model.__name__} has parents")
    using = using or router.db_for_write(model, instance=obj)
    connection = connections[using]
    obj._prepare_related_fields_for_save(operation_name="save")
    if not obj._is_pk_set(meta):
        setattr(obj, meta.pk.attname, meta.pk.get_pk_value_on_save(obj))
    pk_set = obj._is_pk_set(meta)
    fields = [f for f in meta.local_concrete_fields if not f.generated and (pk_set or f is not meta.auto_field)]
    raw = [f.pre_save(obj, True) for f in fields]
    if any(hasattr(v, "resolve_expression") for v in raw) or any(hasattr(f, "get_placeholder") for f in fields):
        obj.save(force_insert=True, using=using)
        return
    returning = list(meta.db_returning_fields) if not pk_set else []
    can_return = bool(returning) and connection.features.can_return_columns_from_insert
    key = (model, using, connection.vendor, tuple(f.attname for f in fields), tuple(f.attname for f in returning),
           can_return)
    sql = _INSERTS.get(key)
    if sql is None:
        qn = connection.ops.quote_name
        sql = (f"INSERT INTO {qn(meta.db_table)} ({', '.join(qn(f.column) for f in fields)}) "
               f"VALUES ({', '.join(['%s'] * len(fields))})")
        if can_return:
            sql += " " + connection.ops.return_insert_columns(returning)[0]
        sql = _INSERTS.setdefault(key, sql)
    params = [f.get_db_prep_save(v, connection) for f, v in zip(fields, raw)]
    # as save(): an error marks the enclosing atomic block for rollback
    with transaction.mark_for_rollback_on_error(using), connection.cursor() as cursor:
        cursor.execute(sql, params)
        if can_return:
            values = connection.ops.fetch_returned_insert_columns(cursor, ())
        elif returning:
            values = [connection.ops.last_insert_id(cursor, meta.db_table, meta.pk.column)]
        else:
            values = []
    for field, value in zip(returning, values):
        setattr(obj, field.attname, value)
    obj._state.adding = False
    obj._state.db = using
