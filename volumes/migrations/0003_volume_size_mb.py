from django.db import migrations, models

import volumes.models


class Migration(migrations.Migration):
    """Volumes made before size limits keep none (0: a plain directory); new ones get
    AENV_VOLUME_MAX_MB."""

    dependencies = [
        ("volumes", "0002_volume_export_id"),
    ]

    operations = [
        migrations.AddField(
            model_name="volume",
            name="size_mb",
            field=models.PositiveIntegerField(default=0),
            preserve_default=False,
        ),
        migrations.AlterField(
            model_name="volume",
            name="size_mb",
            field=models.PositiveIntegerField(default=volumes.models.default_size_mb),
        ),
    ]
