"""The admin pages for the sandbox models render for a superuser."""
import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from sandboxes.models import ApiKey, Sandbox, SandboxEvent, Team, Template

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_client_with_data(client):
    user = get_user_model().objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(user)
    team = Team.objects.create(name="T", slug="t")
    key, raw = ApiKey.generate(team)
    tpl = Template.objects.create(id="base")
    sb = Sandbox.objects.create(team=team, template=tpl, state="running", end_at=timezone.now())
    SandboxEvent.objects.create(sandbox=sb, operation="create")
    return client, key, raw, sb


@pytest.mark.parametrize("model", ["team", "apikey", "template", "sandbox", "sandboxevent"])
def test_changelists_render(admin_client_with_data, model):
    client, *_ = admin_client_with_data
    resp = client.get(f"/admin/sandboxes/{model}/?q=x")
    assert resp.status_code == 200


def test_change_pages_render_and_never_show_secrets(admin_client_with_data):
    client, key, raw, sb = admin_client_with_data
    page = client.get(f"/admin/sandboxes/apikey/{key.pk}/change/")
    assert page.status_code == 200 and raw not in page.content.decode()
    page = client.get(f"/admin/sandboxes/sandbox/{sb.pk}/change/")
    assert page.status_code == 200 and (not sb.envd_access_token or sb.envd_access_token not in page.content.decode())
    assert client.get("/admin/sandboxes/sandbox/?state__exact=running").status_code == 200
