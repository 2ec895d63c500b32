"""Django's own middlewares, run in the event loop when they have no I/O to do.

Why: Django's ``MiddlewareMixin`` runs every ``process_request`` / ``process_response`` of
an async request through ``sync_to_async`` (a thread hop each). With the seven stock
middlewares that was ~15 hops per API call, half of a lifecycle call's control-plane
overhead on a loaded 2-core host (docs/benchmarks.md, bench/control_plane.py), for hooks
that only read headers and set a few. Each subclass here says when its hook is pure (no
database, no file): then it runs inline; otherwise it takes the thread hop as before
(a session to save, messages to store, a CSRF check that reads a form body)."""
from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth.middleware import AuthenticationMiddleware
from django.contrib.messages.middleware import MessageMiddleware
from django.contrib.sessions.middleware import SessionMiddleware
from django.middleware.clickjacking import XFrameOptionsMiddleware
from django.middleware.common import CommonMiddleware
from django.middleware.csrf import CsrfViewMiddleware
from django.middleware.security import SecurityMiddleware

SAFE_METHODS = ("GET", "HEAD", "OPTIONS", "TRACE")


class Inline:
    """Mixin (first base) for a ``MiddlewareMixin`` whose hooks are pure unless the
    ``*_inline`` predicates say otherwise; sync requests are untouched."""

    def request_inline(self, request) -> bool:
        return True

    def response_inline(self, request, response) -> bool:
        return True

    async def __acall__(self, request):
        response = None
        if hasattr(self, "process_request"):
            if self.request_inline(request):
                response = self.process_request(request)
            else:
                response = await sync_to_async(self.process_request, thread_sensitive=True)(request)
        response = response or await self.get_response(request)
        if hasattr(self, "process_response"):
            if self.response_inline(request, response):
                response = self.process_response(request, response)
            else:
                response = await sync_to_async(self.process_response, thread_sensitive=True)(request, response)
        return response


class Security(Inline, SecurityMiddleware):
    """Redirects and headers only."""


class Common(Inline, CommonMiddleware):
    """URL checks (the resolver) and headers only."""


class XFrameOptions(Inline, XFrameOptionsMiddleware):
    """A header only."""


class Authentication(Inline, AuthenticationMiddleware):
    """Sets the lazy ``request.user`` / ``request.auser``; the user is loaded where used."""


class Session(Inline, SessionMiddleware):
    """A lazy session in; out: pure unless the session must be saved (the database)."""

    def response_inline(self, request, response) -> bool:
        session = getattr(request, "session", None)
        if session is None or not session.accessed:
            return True
        return not (session.modified or settings.SESSION_SAVE_EVERY_REQUEST)


class Messages(Inline, MessageMiddleware):
    """A lazy storage in; out: pure unless messages were read or added (cookie or session)."""

    def response_inline(self, request, response) -> bool:
        storage = getattr(request, "_messages", None)
        return storage is None or not (storage.used or storage.added_new)


class Csrf(Inline, CsrfViewMiddleware):
    """The token cookie in and out (pure unless the token lives in the session); the view
    check inline for exempt views (the E2B API's) and safe methods, else in a thread (it
    may read a form body)."""

    def request_inline(self, request) -> bool:
        return not settings.CSRF_USE_SESSIONS

    def response_inline(self, request, response) -> bool:
        return not settings.CSRF_USE_SESSIONS

    async def process_view(self, request, callback, callback_args, callback_kwargs):
        check = super().process_view
        if not settings.CSRF_USE_SESSIONS and (getattr(callback, "csrf_exempt", False)
                                               or request.method in SAFE_METHODS):
            return check(request, callback, callback_args, callback_kwargs)
        return await sync_to_async(check, thread_sensitive=True)(request, callback, callback_args, callback_kwargs)

