"""System templates: global templates aenv builds for everyone from a recipe in this
repository, with its own template builder (today one: ``code-interpreter-v1``, the
default template of the ``e2b-code-interpreter`` SDKs).

| module | job |
|---|---|
| ``recipes`` | what a recipe is (steps, COPY trees, start / ready commands, shape) and its hash |
| ``code_interpreter`` | the ``code-interpreter-v1`` recipe: PyPI wheels downloaded on the host, the server's code |
| ``host_venv`` | a venv built on the host inside the guest's root file system stage (a private namespace) |
| ``ensure`` | make the template's newest build match its recipe: register, start, wait |

A system template is an ordinary build of a global template (``Template.team`` empty,
public, so every team resolves its alias) whose internals belong to the **system team**:
its COPY archives and its template snapshot row. The system team has the same id in every
database, so the node's layer cache (keyed by team and steps) is shared by every aenv home
on a machine: a fresh test stack's build finds every step cached and only finalizes. A
build is tagged ``recipe-<hash>``: when the recipe (package list, server code, commands)
has not changed and that build is ready, ``ensure`` does nothing.

``manage.py ensure_system_templates`` runs it (``scripts/up.sh`` and the integration tests
call it once a node is up)."""

SYSTEM_TEAM_SLUG = "aenv-system"
