"""Admin: an operator's view of teams, keys, templates, sandboxes and their history.

Sandbox state is shown, never edited here: state changes belong to the lifecycle
service (conditional updates + events), not to a form."""
from django.contrib import admin

from .models import ApiKey, Sandbox, SandboxEvent, Team, Template


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
    list_display = ["name", "slug", "created_at"]
    search_fields = ["name", "slug"]
    prepopulated_fields = {"slug": ["name"]}
    filter_horizontal = ["members"]
    inlines = [ApiKeyInline]


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

        n = queryset.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())
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
    list_display = ["id", "state", "template", "team", "node", "started_at", "end_at"]
    list_filter = ["state", "template", "node", "team", "secure"]
    search_fields = ["id", "alias", "template__id", "node__id", "error_reason"]
    date_hierarchy = "started_at"
    list_select_related = ["template", "team", "node"]
    readonly_fields = [f.name for f in Sandbox._meta.fields]
    exclude = ["envd_access_token"]
    inlines = [SandboxEventInline]

    def has_add_permission(self, request):
        return False


@admin.register(SandboxEvent)
class SandboxEventAdmin(admin.ModelAdmin):
    list_display = ["started_at", "sandbox", "operation", "outcome", "from_state", "to_state", "duration_ms", "actor"]
    list_filter = ["operation", "outcome"]
    search_fields = ["sandbox__id", "message", "actor"]
    readonly_fields = [f.name for f in SandboxEvent._meta.fields]
    list_select_related = ["sandbox"]

    def has_add_permission(self, request):
        return False
