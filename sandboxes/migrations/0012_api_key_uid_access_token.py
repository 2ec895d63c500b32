"""API keys get E2B's identity (a UUID) and the last characters its mask shows; access
tokens (a person's credential, E2B's ``sk_e2b_…``) get their table. Existing keys get a
UUID each; their suffix stays empty (only the hash was kept)."""
import uuid

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models


def give_uids(apps, schema_editor):
    ApiKey = apps.get_model("sandboxes", "ApiKey")
    for pk in ApiKey.objects.filter(uid__isnull=True).values_list("pk", flat=True):
        ApiKey.objects.filter(pk=pk).update(uid=uuid.uuid4())


class Migration(migrations.Migration):

    dependencies = [
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
        ('sandboxes', '0011_sandbox_log'),
    ]

    operations = [
        migrations.AddField(
            model_name='apikey',
            name='uid',
            field=models.UUIDField(null=True, editable=False),
        ),
        migrations.RunPython(give_uids, migrations.RunPython.noop),
        migrations.AlterField(
            model_name='apikey',
            name='uid',
            field=models.UUIDField(default=uuid.uuid4, editable=False, unique=True),
        ),
        migrations.AddField(
            model_name='apikey',
            name='suffix',
            field=models.CharField(blank=True, default='', help_text='last characters, for the mask', max_length=4),
        ),
        migrations.CreateModel(
            name='AccessToken',
            fields=[
                ('id', models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                ('name', models.CharField(max_length=128)),
                ('prefix', models.CharField(help_text='first characters, to recognise a token', max_length=16)),
                ('suffix', models.CharField(help_text='last characters, for the mask', max_length=4)),
                ('token_hash', models.CharField(max_length=64, unique=True)),
                ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
                ('last_used_at', models.DateTimeField(blank=True, null=True)),
                ('user', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='access_tokens',
                                           to=settings.AUTH_USER_MODEL)),
            ],
            options={
                'ordering': ['-created_at'],
            },
        ),
    ]
