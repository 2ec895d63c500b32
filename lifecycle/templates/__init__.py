"""The template build operations behind the API, one module each: ``register`` (``POST
/v3/templates``), ``start`` (hand a build to a node), ``uploads`` (COPY archives),
``queries`` (status, logs, lists, ``exists``), ``tags`` and ``manage`` (delete, publish);
``common`` holds the lookups and checks they share.

Like ``lifecycle.sandboxes`` they raise its domain errors (``sandboxes.errors``)
and never speak HTTP; every build status change goes through
``template_builds.transitions``. Imports nothing itself."""
