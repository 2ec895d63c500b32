"""E2B's template build API (control-plane side): templates registered by name, their
builds (status, start body, logs, result), COPY file uploads and tags.

- ``models``: ``TemplateBuild``, ``BuildLogEntry``, ``TemplateTag``, ``TemplateFile``
  (the template itself is ``sandboxes.models.Template``);
- ``names``: the name grammar ``[namespace/]alias[:tag]``;
- ``transitions``: the only writer of a build's status and log (durable before visible);
- ``progress``: the small API a node's builder reports through (``accept``, ``report``,
  ``finish``, ``is_building``);
- ``resolve``: what a ``templateID`` (create) or ``fromTemplate`` (build) names;
- ``files``: where uploaded COPY archives live, and the signed upload URLs;
- ``lifecycle``: the operations behind the endpoints; ``serializers``, ``views``, ``urls``:
  the HTTP edge;
- ``system``: global templates aenv builds from recipes in the repository
  (``code-interpreter-v1``), through the same builds (``manage.py ensure_system_templates``).

Why an app of its own: the sandbox lifecycle only needs to know what a reference
resolves to; everything about building lives here. (Not to be confused with the
top-level ``templates/`` directory, which holds the dashboard's HTML templates.)"""
