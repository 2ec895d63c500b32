from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('sandboxes', '0004_sandbox_vm_generation'),
    ]

    operations = [
        migrations.AddField(
            model_name='sandbox',
            name='guest_host',
            field=models.CharField(blank=True, default='', max_length=255),
        ),
        migrations.AddField(
            model_name='sandbox',
            name='traffic_access_token',
            field=models.CharField(blank=True, default='', max_length=128),
        ),
    ]
