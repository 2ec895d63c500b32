"""Sandboxes: the models, the state machine (``states``, ``transitions``), the lifecycle
(``lifecycle``), the E2B REST API edge (``serializers``, ``views``, ``errors``, ``auth``),
the data plane proxy (``proxy``) and the TTL sweeper (``expiry``)."""
