"""What every REST view does with a request: validate a body with a serializer, read an
optional JSON body, find the caller's team and name, and time the lifecycle phases in a
``Server-Timing`` header. One place, so the sandbox, snapshot and template views agree."""


def valid(serializer_class, data):
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return serializer


def body_of(request) -> dict:
    """The JSON body, or {} when there is none (SDK 2.20 pauses without a body)."""
    data = request.data
    return {} if data is None or data == "" or (hasattr(data, "__len__") and not len(data)) else data


def server_timing(result) -> dict | None:
    """Server-Timing header from the phases (ms) of a lifecycle result."""
    phases = getattr(result, "phases", None) or {}
    timing = ", ".join(f"{name};dur={ms}" for name, ms in phases.items())
    return {"Server-Timing": timing} if timing else None


def team_of(request):
    return request.user.team


def actor_of(request) -> str:
    return str(request.user)
