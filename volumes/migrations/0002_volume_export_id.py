from django.db import migrations, models


def number_existing(apps, schema_editor):
    """Volumes made before export ids: 1, 2, … per team, oldest first."""
    Volume = apps.get_model("volumes", "Volume")
    counters: dict = {}
    for volume in Volume.objects.order_by("created_at", "id"):
        counters[volume.team_id] = counters.get(volume.team_id, 0) + 1
        Volume.objects.filter(pk=volume.pk).update(export_id=counters[volume.team_id])


class Migration(migrations.Migration):

    dependencies = [
        ('volumes', '0001_initial'),
    ]

    operations = [
        migrations.AddField(
            model_name='volume',
            name='export_id',
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.RunPython(number_existing, migrations.RunPython.noop),
        migrations.AddConstraint(
            model_name='volume',
            constraint=models.UniqueConstraint(fields=('team', 'export_id'), name='volume_unique_team_export_id'),
        ),
    ]
