"""Admin: snapshots with their team, source, node and size. Read-mostly: state changes
go through ``lifecycle.snapshots`` (which also removes the files on the node)."""
from django.contrib import admin

from snapshots.models import Snapshot


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

    @admin.display(description="size (MiB)", ordering="size_bytes")
    def size_mb(self, obj) -> str:
        return f"{obj.size_bytes / 2**20:.1f}"

    def has_add_permission(self, request):
        return False
