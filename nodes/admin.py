"""Admin: the nodes as the control plane sees them (capacity, heartbeat, usage).

Everything but ``draining`` is reported by the node worker itself and read-only
here; draining (no new sandboxes placed on the node) is the operator's switch."""
from django.contrib import admin
from django.db.models import Count, Q

from sandboxes.states import LIVE

from nodes.models import Node, NodeJoinToken, alive_q


class AliveFilter(admin.SimpleListFilter):
    title = "heartbeat"
    parameter_name = "alive"

    def lookups(self, request, model_admin):
        return [("yes", "alive"), ("no", "stale or never")]

    def queryset(self, request, queryset):
        if self.value() == "yes":
            return queryset.filter(alive_q())
        if self.value() == "no":  # stale, never beat, or stopped: what Node.is_alive calls not alive
            return queryset.exclude(alive_q())
        return queryset


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ["id", "address", "driver", "accel", "alive", "vcpu_capacity", "memory_mb_capacity",
                    "sandboxes_running", "live_sandboxes", "last_heartbeat_at", "draining", "version"]
    list_filter = [AliveFilter, "draining", "driver", "accel"]
    search_fields = ["id", "address", "version"]
    list_editable = ["draining"]
    readonly_fields = ["id", "address", "driver", "accel", "vcpu_capacity", "memory_mb_capacity",
                       "sandboxes_running", "version", "started_at", "last_heartbeat_at", "host", "host_history",
                       "joined_via", "revoked_at"]
    exclude = ["credential_hash"]  # joining and revoking: nodes.join (manage.py, the API, the dashboard)
    actions = ["drain", "undrain"]

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(
            _live=Count("sandboxes", filter=Q(sandboxes__state__in=LIVE)))

    def has_add_permission(self, request):
        return False  # nodes register themselves (`manage.py run_node`)

    @admin.display(boolean=True, description="alive")
    def alive(self, obj) -> bool:
        return obj.is_alive()

    @admin.display(description="live sandboxes", ordering="_live")
    def live_sandboxes(self, obj) -> int:
        return obj._live

    @admin.action(description="Drain selected nodes (place no new sandboxes)")
    def drain(self, request, queryset):
        self.message_user(request, f"draining {queryset.update(draining=True)} node(s)")

    @admin.action(description="Stop draining selected nodes")
    def undrain(self, request, queryset):
        self.message_user(request, f"{queryset.update(draining=False)} node(s) take new sandboxes again")


@admin.register(NodeJoinToken)
class NodeJoinTokenAdmin(admin.ModelAdmin):
    """Read-only: a token is made where its value can be shown once (``manage.py
    node_tokens``, ``POST /nodes/join-tokens``, the dashboard's nodes page), never its hash."""

    list_display = ["prefix", "node_id", "created_by", "created_at", "expires_at", "used_by", "state"]
    search_fields = ["prefix", "node_id", "used_by", "created_by"]
    exclude = ["token_hash"]
    readonly_fields = ["prefix", "node_id", "created_by", "created_at", "expires_at", "used_at", "used_by", "revoked_at"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    @admin.display(description="state")
    def state(self, obj) -> str:
        return obj.state()
