"""One shape for the API's own middlewares, sync and async alike.

Why: under daphne the stack is async, and a sync-only middleware would push every async
view through one thread (Django's adapter); each middleware here only looks at a request
before the view and at its response after, so that one shape serves all of them."""
from asgiref.sync import iscoroutinefunction, markcoroutinefunction


class AroundMiddleware:
    """Subclasses give ``before(request)`` (a response ends the request there, e.g. a CORS
    preflight) and ``after(request, response)`` (returns the response to send)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self._is_async = iscoroutinefunction(get_response)
        if self._is_async:
            markcoroutinefunction(self)

    def before(self, request):
        return None

    def after(self, request, response):
        return response

    def __call__(self, request):
        if self._is_async:
            return self.__acall__(request)
        early = self.before(request)
        return early if early is not None else self.after(request, self.get_response(request))

    async def __acall__(self, request):
        early = self.before(request)
        return early if early is not None else self.after(request, await self.get_response(request))
