"""The OpenAPI schema renders, without warnings, and documents the E2B routes."""
import pytest
from django.core.management import call_command

pytestmark = pytest.mark.django_db(transaction=True)


async def test_schema_endpoint_renders(api):
    resp = await api.get("/api/schema", headers={"Accept": "application/vnd.oai.openapi+json"})
    assert resp.status_code == 200, resp.text[:500]
    schema = resp.json()
    paths = schema["paths"]
    for p in ("/health", "/sandboxes", "/v2/sandboxes", "/sandboxes/{sandbox_id}",
              "/sandboxes/{sandbox_id}/timeout", "/sandboxes/{sandbox_id}/refreshes"):
        assert p in paths, p
    assert "201" in paths["/v2/sandboxes"]["post"]["responses"]
    assert "204" in paths["/sandboxes/{sandbox_id}"]["delete"]["responses"]
    assert schema["components"]["securitySchemes"]["ApiKeyAuth"]["name"] == "X-API-Key"


def test_schema_generation_has_no_warnings(tmp_path):
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(tmp_path / "schema.yml"))
    assert (tmp_path / "schema.yml").read_text().startswith("openapi:")
