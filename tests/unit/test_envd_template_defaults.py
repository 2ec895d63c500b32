"""envd takes a template's USER, WORKDIR and ENV from the template's disk
(``envd.state.TEMPLATE_DEFAULTS``, written by the builder): at start and at every /init,
with /init's envVars over the template's, so every sandbox of a template gets them."""
import json

import httpx
import pytest

from envd.app import EnvdApp
from envd.state import Settings


def test_no_file_keeps_the_built_in_defaults(tmp_path):
    s = Settings(template_file=str(tmp_path / "none.json"))
    s.load_template_defaults()
    assert (s.default_user, s.default_workdir, s.env()) == ("user", None, {})


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"defaultUser": 3, "envVars": "x"}'])
def test_a_bad_file_is_ignored(tmp_path, text):
    path = tmp_path / "template.json"
    path.write_text(text)
    s = Settings(template_file=str(path))
    s.load_template_defaults()
    assert (s.default_user, s.default_workdir, s.env()) == ("user", None, {})


async def test_init_rereads_the_file_and_its_env_vars_win(tmp_path):
    path = tmp_path / "template.json"
    settings = Settings(template_file=str(path))
    app = EnvdApp(settings)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://envd") as client:
        path.write_text(json.dumps({"defaultUser": "root", "defaultWorkdir": "/app",
                                    "envVars": {"A": "template", "B": "template"}}))
        assert (await client.post("/init", json={"envVars": {"B": "sandbox"}})).status_code == 204
        assert (settings.default_user, settings.default_workdir) == ("root", "/app")
        assert (await client.get("/envs")).json() == {"A": "template", "B": "sandbox"}
        # an explicit default in /init still wins for that sandbox
        assert (await client.post("/init", json={"defaultWorkdir": "/srv"})).status_code == 204
        assert settings.default_workdir == "/srv" and (await client.get("/envs")).json()["A"] == "template"
