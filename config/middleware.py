"""WhiteNoise that does not force the whole request through a sync thread.

WhiteNoiseMiddleware is sync-only; Django then adapts the entire middleware
chain around it to sync, so every async view (a sandbox create waiting for a VM)
would run via async_to_sync inside asgiref's single thread-sensitive executor and
concurrent requests would be served one at a time. This subclass is async-capable:
static files are still served by WhiteNoise (in a thread), everything else is
awaited directly."""
from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from whitenoise.middleware import WhiteNoiseMiddleware


class AsyncWhiteNoiseMiddleware(WhiteNoiseMiddleware):
    sync_capable = True
    async_capable = True

    def __init__(self, get_response=None, *args, **kwargs):
        super().__init__(get_response, *args, **kwargs)
        self._is_async = iscoroutinefunction(get_response)
        if self._is_async:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self._is_async:
            return self.__acall__(request)
        return super().__call__(request)

    async def __acall__(self, request):
        if self.autorefresh:
            static_file = await sync_to_async(self.find_file, thread_sensitive=False)(request.path_info)
        else:
            static_file = self.files.get(request.path_info)
        if static_file is not None:
            return await sync_to_async(self.serve, thread_sensitive=False)(static_file, request)
        return await self.get_response(request)
