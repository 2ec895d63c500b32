"""Admin: builds with their template, status, node and result; logs, tags and uploaded
files. Read-mostly: a build's status changes only through ``template_builds.transitions``."""
from django.contrib import admin

from template_builds.models import BuildLogEntry, TemplateBuild, TemplateFile, TemplateTag


class BuildLogInline(admin.TabularInline):
    model = BuildLogEntry
    fields = ["index", "timestamp", "level", "step", "message"]
    readonly_fields = fields
    extra = 0
    can_delete = False
    ordering = ["index"]


@admin.register(TemplateBuild)
class TemplateBuildAdmin(admin.ModelAdmin):
    list_display = ["id", "template", "status", "node", "cpu_count", "memory_mb", "created_at", "finished_at"]
    list_filter = ["status", "node"]
    search_fields = ["id", "template__id", "template__alias"]
    date_hierarchy = "created_at"
    readonly_fields = [f.name for f in TemplateBuild._meta.fields]
    inlines = [BuildLogInline]

    def has_add_permission(self, request):
        return False


@admin.register(TemplateTag)
class TemplateTagAdmin(admin.ModelAdmin):
    list_display = ["template", "tag", "build", "created_at"]
    search_fields = ["template__id", "template__alias", "tag"]
    readonly_fields = ["template", "build", "tag", "created_at"]


@admin.register(TemplateFile)
class TemplateFileAdmin(admin.ModelAdmin):
    list_display = ["hash", "team", "size_bytes", "gzip", "template", "created_at"]
    list_filter = ["team", "gzip"]
    search_fields = ["hash"]
    readonly_fields = ["team", "hash", "size_bytes", "gzip", "template", "created_at", "updated_at"]
