# Sandbox lineage: restored from a snapshot, forked from a sandbox.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('sandboxes', '0001_initial'),
        ('snapshots', '0001_initial'),
    ]

    operations = [
        migrations.AddField(
            model_name='sandbox',
            name='forked_from',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='forks', to='sandboxes.sandbox'),
        ),
        migrations.AddField(
            model_name='sandbox',
            name='source_snapshot',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='sandboxes', to='snapshots.snapshot'),
        ),
    ]
