"""Admin: snapshots with their team, source, node and size. Read-mostly: state changes
go through ``lifecycle.snapshots`` (which also removes the files on the node)."""
from django.contrib import admin

from snapshots.models import Snapshot, SnapshotEvent


class SnapshotEventInline(admin.TabularInline):
    model = SnapshotEvent
    extra = 0
    can_delete = False
    fields = ["at", "operation", "from_state", "to_state", "message", "actor"]
    readonly_fields = fields
    ordering = ["-at", "-id"]

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Snapshot)
class SnapshotAdmin(admin.ModelAdmin):
    list_display = ["id", "name", "team", "state", "source_sandbox", "template", "node", "memory",
                    "size_mb", "created_at"]
    list_filter = ["state", "memory", "team", "node"]
    search_fields = ["id", "name", "source_sandbox__id", "team__slug"]
    date_hierarchy = "created_at"
    readonly_fields = ["id", "team", "source_sandbox", "template", "node", "memory", "state", "error_reason",
                       "size_bytes", "manifest", "cpu_count", "memory_mb", "disk_size_mb", "envd_version",
                       "created_at", "updated_at"]
    exclude = ["envd_access_token"]
    inlines = [SnapshotEventInline]

    @admin.display(description="size (MiB)", ordering="size_bytes")
    def size_mb(self, obj) -> str:
        return f"{obj.size_bytes / 2**20:.1f}"

    def has_add_permission(self, request):
        return False


@admin.register(SnapshotEvent)
class SnapshotEventAdmin(admin.ModelAdmin):
    """Read-only: each row was written with the state change it records."""

    list_display = ["at", "snapshot", "operation", "from_state", "to_state", "actor"]
    list_filter = ["operation", "to_state"]
    date_hierarchy = "at"
    search_fields = ["snapshot__id", "message", "actor"]
    readonly_fields = [f.name for f in SnapshotEvent._meta.fields]
    list_select_related = ["snapshot"]

    def has_add_permission(self, request):
        return False
