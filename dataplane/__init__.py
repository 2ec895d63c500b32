"""The sandbox data plane (``E2B_SANDBOX_URL``), served by uvicorn from
``config.dataplane_asgi`` and, under ``/proxy``, on the API's port: which sandbox and port
a request addresses (``addressing``), its route from the database (``routes``), whether it
may pass (``access``, ``signers``, ``cookies``), the answers it gives itself
(``answers``), and the streaming both ways (``proxy`` for HTTP, ``websockets``) over
pooled upstream connections (``pools``), waking a paused sandbox when allowed."""
