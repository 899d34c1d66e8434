"""``/admin/diagnostics/``: the page that links every diagnostic, and the diagnostics
themselves, each gathered from every llmgw process of this host at the moment it is asked.

Served by the admin listener only (``llmgw_site.listeners``: never by the client port once an
admin listener is given). The page is the admin's (a staff session; signed out, the sign-in
page); the data answers an admin token of either scope as well (``auth.diagnostician``), and
401 without either. Each diagnostic comes as JSON and as text (``.txt``, as ``manage.py
diagnose`` prints it); the CPU profile as a flame graph (SVG, in the browser or downloaded)
and as folded stacks (``.folded``, which speedscope and flamegraph.pl open).

``?pid=`` (repeatable) narrows a diagnostic to those processes.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.contrib import admin, messages
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseRedirect,
    JsonResponse,
    QueryDict,
)
from django.template.response import TemplateResponse
from django.urls import reverse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_http_methods

from llmgw_site.admin_api.auth import Denied, diagnostician
from llmgw_site.diagnostics.process import folder
from telemetry import diagnostics, profiler, reports

View = Callable[..., HttpResponse]
HEAP_ACTIONS = ("start", "stop", "rebase")


class BadRequest(Exception):
    """A query parameter that cannot be used; the message names it."""


def _number(params: QueryDict, name: str, default: float, low: float, high: float) -> float:
    raw = params.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise BadRequest(f"{name}={raw!r} is not a number") from None
    if not low <= value <= high:
        raise BadRequest(f"{name} must be between {low:g} and {high:g}")
    return value


def _pids(request: HttpRequest) -> list[int]:
    raw = request.GET.getlist("pid")
    if not all(value.isdigit() for value in raw):
        raise BadRequest("pid must be a process id")
    return [int(value) for value in raw]


def _gather(request: HttpRequest, op: str, args: dict[str, Any] | None = None) -> list[Any]:
    return diagnostics.gather(folder(), op, args, pids=_pids(request))


def _error(status: int, code: str, message: str) -> JsonResponse:
    return JsonResponse({"error": {"code": code, "message": message}}, status=status)


def guarded(view: View) -> View:
    """A diagnostic: an admin token or a staff session, diagnostics on, parameters valid."""

    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        try:
            diagnostician(request)
        except Denied as denied:
            return _error(denied.status, denied.code, denied.message)
        if not settings.LLMGW_DIAGNOSTICS:
            return _error(404, "off", "diagnostics are off (LLMGW_DIAGNOSTICS=false)")
        try:
            response = view(request, *args, **kwargs)
        except BadRequest as bad:
            return _error(400, "invalid", str(bad))
        response["Cache-Control"] = "no-store"
        return response

    # Tokens send no CSRF cookie: a session's writes are checked by diagnostician instead.
    return csrf_exempt(wrapper)


def _text(body: str) -> HttpResponse:
    return HttpResponse(body, content_type="text/plain; charset=utf-8")


def _json(answers: list[Any]) -> JsonResponse:
    return JsonResponse({"processes": answers}, json_dumps_params={"default": str})


# --------------------------------------------------------------------------- the page


def page(request: HttpRequest) -> HttpResponse:
    """Every process of this host at a glance, and the way to each diagnostic."""
    answers = diagnostics.gather(folder(), "info") if settings.LLMGW_DIAGNOSTICS else []
    context = {
        **admin.site.each_context(request),
        "title": "Diagnostics",
        "enabled": settings.LLMGW_DIAGNOSTICS,
        "table": reports.processes(answers) if answers else "",
        "heap_actions": HEAP_ACTIONS,
        "max_profile_s": int(diagnostics.MAX_PROFILE_S),
        "modes": profiler.MODES,
    }
    return TemplateResponse(request, "admin/diagnostics.html", context)


# --------------------------------------------------------------------------- the diagnostics


@guarded
@require_GET
def processes(request: HttpRequest, text: bool = False) -> HttpResponse:
    answers = _gather(request, "info")
    return _text(reports.processes(answers)) if text else _json(answers)


@guarded
@require_GET
def stacks(request: HttpRequest, text: bool = False) -> HttpResponse:
    answers = _gather(request, "stacks")
    return _text(reports.stacks(answers)) if text else _json(answers)


@guarded
@require_GET
def objects(request: HttpRequest, text: bool = False) -> HttpResponse:
    top = int(_number(request.GET, "top", 30, 1, 1000))
    answers = _gather(request, "objects", {"top": top})
    return _text(reports.objects(answers)) if text else _json(answers)


@guarded
@require_http_methods(["GET", "POST"])
def heap(request: HttpRequest, text: bool = False) -> HttpResponse:
    """GET: each process's allocation sites and growth since its baseline. POST
    ``action=start|stop|rebase`` (``frames``: how deep each allocation's traceback is kept)."""
    if request.method == "POST":
        action = request.POST.get("action", "")
        if action not in HEAP_ACTIONS:
            raise BadRequest(f"action must be one of {', '.join(HEAP_ACTIONS)}")
        frames = int(_number(request.POST, "frames", 10, 1, 100))
        answers = _gather(request, "heap", {"action": action, "frames": frames})
        if request.POST.get("next") == "page":
            done = sum(1 for a in answers if "answer" in a)
            messages.info(request, f"tracemalloc {action}: {done} of {len(answers)} processes")
            return HttpResponseRedirect(reverse("diagnostics"), status=303)
        return _json(answers)
    top = int(_number(request.GET, "top", 20, 1, 500))
    answers = _gather(request, "heap", {"action": "report", "top": top})
    return _text(reports.heap(answers)) if text else _json(answers)


@guarded
@require_GET
def profile(request: HttpRequest, form: str = "json") -> HttpResponse:
    """A CPU profile of the next ``seconds`` of every process (``mode=wall``: where the
    threads are, busy or not), as a flame graph (``svg``), folded stacks, text or JSON."""
    seconds = _number(request.GET, "seconds", 5, 0.1, diagnostics.MAX_PROFILE_S)
    hz = _number(request.GET, "hz", profiler.DEFAULT_HZ, 1, 1000)
    mode = request.GET.get("mode", "cpu")
    if mode not in profiler.MODES:
        raise BadRequest(f"mode must be one of {', '.join(profiler.MODES)}")
    answers = _gather(request, "profile", {"seconds": seconds, "hz": hz, "mode": mode})
    folded = reports.merged_profile(answers)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if form == "svg":
        body = reports.flame_graph(answers, mode=mode, seconds=seconds)
        response = HttpResponse(body, content_type="image/svg+xml")
        # Nothing in it is a script or fetches anything; say so to the browser as well.
        response["Content-Security-Policy"] = "default-src 'none'; style-src 'unsafe-inline'"
        kind = "attachment" if request.GET.get("download") else "inline"
        response["Content-Disposition"] = f'{kind}; filename="llmgw-profile-{stamp}.svg"'
        return response
    if form == "folded":
        response = _text(profiler.folded_text(folded))
        response["Content-Disposition"] = f'attachment; filename="llmgw-profile-{stamp}.folded"'
        return response
    if form == "txt":
        return _text(reports.profile(folded, answers))
    return _json(answers)
