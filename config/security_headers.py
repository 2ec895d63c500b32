"""The Content-Security-Policy of every answer on the API's port (dashboard, admin, E2B API).

Why: the dashboard acts with a signed-in user's session. ``frame-ancestors 'none'`` (and
``X-Frame-Options: DENY`` from Django's XFrameOptionsMiddleware, for browsers without CSP
level 2) keeps any other page from framing it and clicking its buttons (kill a sandbox,
revoke a key). The rest of the policy (``AENV_CONTENT_SECURITY_POLICY``) limits what a
page could do if text from a guest or a user ever slipped into it unescaped: scripts only
from this origin's static files (the dashboard's own and xterm.js, installed at setup) and
never inline (the dashboard has no inline script, so an injected one does not run), fetches
and WebSockets only to this origin, forms post only here, no plugins, no ``<base>``.
Inline styles stay allowed: the templates' meters and xterm.js's renderer use them, and a
style runs no code. ``X-Content-Type-Options: nosniff`` and ``Referrer-Policy`` come from
Django's SecurityMiddleware (``SECURE_CONTENT_TYPE_NOSNIFF``, ``SECURE_REFERRER_POLICY``).

A JSON answer carries the same header: harmless there, and one policy is one place.
A response that set its own policy keeps it."""
from django.conf import settings

from api.middleware_base import AroundMiddleware

HEADER = "Content-Security-Policy"


class ContentSecurityPolicyMiddleware(AroundMiddleware):
    """Adds ``settings.AENV_CONTENT_SECURITY_POLICY`` to every response (empty: none)."""

    def __init__(self, get_response):
        super().__init__(get_response)
        self.policy = settings.AENV_CONTENT_SECURITY_POLICY

    def after(self, request, response):
        if self.policy and HEADER not in response:
            response[HEADER] = self.policy
        return response
