"""The nodes page's operator section: join tokens (create, shown once; revoke) and node
revocation, through ``nodes.join`` as the API and ``manage.py node_tokens`` do. Staff only
(``views.is_operator``): what a team member can do must never add machines to the fleet."""
import functools

from django.conf import settings
from django.contrib import messages
from django.http import HttpResponseForbidden
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from nodes import join
from sandboxes.errors import LifecycleError

from dashboard.views import _actor, _base_context, is_operator, team_page

def operator_page(view):
    @team_page
    @functools.wraps(view)
    def wrapper(request, *args, **kwargs):
        if not is_operator(request.user):
            return HttpResponseForbidden("only operators (staff users) manage nodes")
        return view(request, *args, **kwargs)

    return wrapper


@require_POST
@operator_page
def token_create(request):
    try:
        token, raw = join.create_token(node_id=(request.POST.get("node_id") or "").strip(),
                                       ttl=request.POST.get("ttl") or None, created_by=_actor(request.user))
    except LifecycleError as exc:
        messages.error(request, exc.message)
        return redirect("dashboard:nodes")
    response = render(request, "dashboard/node_token_created.html",
                      _base_context(request, "nodes", token=token, raw_token=raw,
                                    control_plane_url=settings.AENV_API_PUBLIC_URL))
    response["Cache-Control"] = "no-store"  # the only time the token is ever shown
    return response


def _act(request, do, said):
    """Run one operator action; its outcome (or the refusal's message) is the next page's notice."""
    try:
        done = do()
    except LifecycleError as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, said(done))
    return redirect("dashboard:nodes")


@require_POST
@operator_page
def token_revoke(request, prefix):
    return _act(request, lambda: join.revoke_token(prefix), lambda token: f"Join token {token.prefix}… revoked.")


@require_POST
@operator_page
def node_revoke(request, node_id):
    return _act(request, lambda: join.revoke_node(node_id),
                lambda node: f"Node {node.pk} revoked: it gets no new work and its heartbeats are ignored.")
