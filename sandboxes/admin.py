"""Admin: an operator's view of teams, keys, templates, sandboxes and their history.

Sandbox state is shown, never edited here: state changes belong to the lifecycle
service (conditional updates + events), not to a form."""
from django.contrib import admin

from sandboxes.models import AccessToken, ApiKey, Sandbox, SandboxEvent, SandboxLog, SandboxMetric, Team, Template


class ApiKeyInline(admin.TabularInline):
    model = ApiKey
    extra = 0
    fields = ["name", "prefix", "created_at", "last_used_at", "revoked_at"]
    readonly_fields = ["prefix", "created_at", "last_used_at"]
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj=None):
        return False  # keys are created with `manage.py create_api_key` (the raw key is shown once)


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ["name", "slug", "member_count", "created_at"]
    search_fields = ["name", "slug", "members__username"]
    prepopulated_fields = {"slug": ["name"]}
    filter_horizontal = ["members"]
    inlines = [ApiKeyInline]

    @admin.display(description="members")
    def member_count(self, obj) -> int:
        return obj.members.count()


@admin.register(AccessToken)
class AccessTokenAdmin(admin.ModelAdmin):
    """A person's access tokens: seen and deleted here, never made (the raw token is shown
    once, by ``POST /access-tokens`` or ``manage.py create_access_token``)."""

    list_display = ["prefix", "name", "user", "created_at", "last_used_at"]
    search_fields = ["prefix", "name", "user__username"]
    readonly_fields = ["user", "name", "prefix", "suffix", "created_at", "last_used_at"]
    exclude = ["token_hash"]  # a hash, but nothing anyone needs to see

    def has_add_permission(self, request):
        return False


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["prefix", "name", "team", "created_at", "last_used_at", "revoked_at"]
    list_filter = ["team", ("revoked_at", admin.EmptyFieldListFilter)]
    search_fields = ["prefix", "name", "team__slug"]
    readonly_fields = ["team", "prefix", "key_hash", "created_by", "created_at", "last_used_at"]
    actions = ["revoke"]

    def has_add_permission(self, request):
        return False

    @admin.action(description="Revoke selected keys")
    def revoke(self, request, queryset):
        from django.utils import timezone  # noqa: PLC0415

        from sandboxes import key_cache  # noqa: PLC0415

        live = queryset.filter(revoked_at__isnull=True)
        hashes = list(live.values_list("key_hash", flat=True))
        n = live.update(revoked_at=timezone.now())
        key_cache.forget(*hashes)  # refused at once in this process (and within the cache's bound elsewhere)
        self.message_user(request, f"revoked {n} key(s)")


@admin.register(Template)
class TemplateAdmin(admin.ModelAdmin):
    list_display = ["id", "alias", "team", "public", "image", "cpu_count", "memory_mb", "disk_size_mb",
                    "envd_version"]
    list_filter = ["public", "team"]
    search_fields = ["id", "alias", "image"]


class SandboxEventInline(admin.TabularInline):
    model = SandboxEvent
    extra = 0
    can_delete = False
    fields = ["started_at", "operation", "outcome", "from_state", "to_state", "duration_ms", "message", "actor"]
    readonly_fields = fields
    ordering = ["-started_at", "-id"]

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Sandbox)
class SandboxAdmin(admin.ModelAdmin):
    list_display = ["id", "state", "template", "team", "node", "cpu_count", "memory_mb", "lineage", "started_at",
                    "end_at"]
    list_filter = ["state", "template", "node", "team", "secure", "auto_pause",
                   ("source_snapshot", admin.EmptyFieldListFilter), ("forked_from", admin.EmptyFieldListFilter)]
    search_fields = ["id", "alias", "template__id", "node__id", "error_reason", "source_snapshot__id",
                     "source_snapshot__name", "forked_from__id", "metadata"]
    date_hierarchy = "started_at"
    list_select_related = ["template", "team", "node"]
    # The envd token is a credential: never rendered (a read-only field would show it
    # even when excluded, so it is left out of both lists).
    readonly_fields = [f.name for f in Sandbox._meta.fields if f.name != "envd_access_token"]
    exclude = ["envd_access_token"]
    inlines = [SandboxEventInline]

    def has_add_permission(self, request):
        return False

    @admin.display(description="from")
    def lineage(self, obj) -> str:
        if obj.forked_from_id:
            return f"fork of {obj.forked_from_id}"
        if obj.source_snapshot_id:
            return f"snapshot {obj.source_snapshot_id}"
        return "template"


@admin.register(SandboxEvent)
class SandboxEventAdmin(admin.ModelAdmin):
    list_display = ["started_at", "sandbox", "operation", "outcome", "from_state", "to_state", "duration_ms", "actor"]
    list_filter = ["operation", "outcome", "to_state"]
    date_hierarchy = "started_at"
    search_fields = ["sandbox__id", "message", "actor"]
    readonly_fields = [f.name for f in SandboxEvent._meta.fields]
    list_select_related = ["sandbox"]

    def has_add_permission(self, request):
        return False


@admin.register(SandboxMetric)
class SandboxMetricAdmin(admin.ModelAdmin):
    """The guest usage samples the nodes take (E2B's sandbox metrics); read-only."""

    list_display = ["timestamp", "sandbox", "cpu_count", "cpu_used_pct", "mem_used", "mem_total", "disk_used",
                    "disk_total"]
    date_hierarchy = "timestamp"
    search_fields = ["sandbox__id"]
    readonly_fields = [f.name for f in SandboxMetric._meta.fields]
    list_select_related = ["sandbox"]

    def has_add_permission(self, request):
        return False


@admin.register(SandboxLog)
class SandboxLogAdmin(admin.ModelAdmin):
    """The guest console lines the nodes collect (E2B's sandbox logs); read-only."""

    list_display = ["timestamp", "sandbox", "level", "source", "logger", "message"]
    list_filter = ["level", "source"]
    date_hierarchy = "timestamp"
    search_fields = ["sandbox__id", "message"]
    readonly_fields = [f.name for f in SandboxLog._meta.fields]
    list_select_related = ["sandbox"]

    def has_add_permission(self, request):
        return False
