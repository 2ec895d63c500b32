"""The E2B-compatible REST edge, shared by every resource: authentication (``auth``),
request helpers (``requests``), the strict field types and error body (``fields``), the
one domain error -> HTTP status table (``errors``), CORS and the middleware base; then
one subpackage per resource (views, serializers, urls). Views stay thin: a serializer
checks the input, one ``lifecycle`` function does the work, a serializer renders it."""
