"""The base of the API's lifecycle views: DRF's checks before a handler run in the event
loop when they need no I/O, instead of a thread hop per request.

Why: adrf runs ``initial`` (authentication, permissions, throttles, content negotiation)
through ``sync_to_async`` for every request, because an authenticator may read the
database. With the API key cached (``sandboxes.key_cache``) nothing in it does for these
views, and the hop was ~0.5-1 ms of a lifecycle call's control-plane time on a loaded host
(issue 26, docs/benchmarks.md). A key that is not cached, or a view with other
authenticators, permissions or throttles, takes the hop as before. The JSON answer is
rendered in the loop too (``rendered_in_loop``), not through Django's hop for a sync
``render``."""
from inspect import iscoroutinefunction

from adrf.views import APIView as AsyncAPIView
from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from rest_framework.permissions import AllowAny, IsAuthenticated
from rest_framework.renderers import JSONRenderer

from api.auth import ApiKeyAuthentication

PURE_PERMISSIONS = (IsAuthenticated, AllowAny)


class APIView(AsyncAPIView):
    """adrf's view; ``initial`` inline when ``_answered_without_io`` authenticated the request."""

    def _answered_without_io(self, request) -> bool:
        """Authenticates ``request`` (a DRF request) from the key cache if every check of
        ``initial`` is pure for this view (a view without authenticators: nothing to do);
        False (nothing set) when one may need I/O."""
        authenticators = request.authenticators
        if self.get_throttles() or not all(isinstance(p, PURE_PERMISSIONS) for p in self.get_permissions()):
            return False
        if not authenticators:
            return True  # DRF's anonymous user: nothing to look up (GET /health)
        if len(authenticators) != 1 or type(authenticators[0]) is not ApiKeyAuthentication:
            return False
        answer = authenticators[0].answer_without_io(request)
        if answer is None:
            return False
        request._authenticator = authenticators[0]
        request.user, request.auth = answer
        return True

    async def async_dispatch(self, request, *args, **kwargs):
        self.args, self.kwargs = args, kwargs
        request = self.initialize_request(request, *args, **kwargs)
        self.request = request
        self.headers = self.default_response_headers
        try:
            if self._answered_without_io(request):
                self.initial(request, *args, **kwargs)  # authenticated already: the rest is pure
            else:
                await sync_to_async(self.initial)(request, *args, **kwargs)
            name = request.method.lower()
            handler = getattr(self, name, self.http_method_not_allowed) if name in self.http_method_names \
                else self.http_method_not_allowed
            if iscoroutinefunction(handler):
                response = await handler(request, *args, **kwargs)
            else:
                response = await sync_to_async(handler)(request, *args, **kwargs)
        except Exception as exc:  # DRF's own error handling, as adrf does
            response = self.handle_exception(exc)
        self.response = self.finalize_response(request, response, *args, **kwargs)
        return rendered_in_loop(self.response, request._request)


PURE_RENDERERS = (JSONRenderer,)


def rendered_in_loop(response, django_request):
    """A DRF response whose renderer does no I/O (JSON) rendered here, in the event loop: left
    to Django, a response with a sync ``render`` is rendered through ``sync_to_async``, a
    thread hop per request. Django then finds ``render`` a coroutine function and awaits it
    (it hands the rendered response back). The API defines no template-response middleware,
    which Django would run before rendering. Only for a request that came through ASGI:
    Django's WSGI handler (the test client, a WSGI server) calls ``render`` without awaiting
    it, so there the response is left as it is."""
    if not isinstance(django_request, ASGIRequest):
        return response
    if type(getattr(response, "accepted_renderer", None)) in PURE_RENDERERS and not response.is_rendered:
        response.render()

        async def render():
            return response

        response.render = render
    return response
