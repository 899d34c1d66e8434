"""Daphne refuses an oversized ``/v1`` body while it is still arriving.

Imported only where daphne serves (``llmgw_site.asgi``): it patches Twisted's request class,
and loading Twisted in a process that another server runs would only cost memory.
"""

from __future__ import annotations

from typing import Any

from daphne.http_protocol import WebRequest
from django.conf import settings

from gateway.errors import too_large


def install_daphne_body_limit() -> None:
    """Make daphne refuse an oversized ``/v1`` body while it is still arriving.

    Daphne (Twisted) reads the whole body into memory or a temporary file before the ASGI app
    is called at all, so the check in ``V1App`` alone would answer 413 only after the upload
    finished. Twisted tells the request its declared length as soon as the headers are in
    (``gotLength``) and hands it each piece of body (``handleContentChunk``); refusing there
    answers 413 at once for a declared length and mid-upload for a chunked one, and memory
    stays bounded either way. Other paths (the admin) keep daphne's own behaviour. Servers
    that pass the body on as it arrives (uvicorn, granian) need none of this.
    """
    if getattr(WebRequest, "_llmgw_body_limit", False):
        return
    got_length = WebRequest.gotLength
    handle_chunk = WebRequest.handleContentChunk

    def refuse(request: Any) -> None:
        request._llmgw_refused = True
        body = too_large().body()
        request.channel.transport.write(
            b"HTTP/1.1 413 Payload Too Large\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
        )
        request.channel.loseConnection()

    def guarded_got_length(request: Any, length: int | None) -> None:
        # The request line is parsed before the headers, so the path is known here.
        path = getattr(request.channel, "_path", b"/v1/")
        request._llmgw_guard = path.startswith(b"/v1/")
        request._llmgw_seen = 0
        request._llmgw_refused = False
        if request._llmgw_guard and length is not None and length > settings.LLMGW_MAX_BODY_BYTES:
            got_length(request, 0)
            refuse(request)
            return
        got_length(request, length)

    def guarded_chunk(request: Any, data: bytes) -> None:
        if getattr(request, "_llmgw_refused", False):
            return
        if getattr(request, "_llmgw_guard", False):
            request._llmgw_seen += len(data)
            if request._llmgw_seen > settings.LLMGW_MAX_BODY_BYTES:
                refuse(request)
                return
        handle_chunk(request, data)

    WebRequest.gotLength = guarded_got_length
    WebRequest.handleContentChunk = guarded_chunk
    WebRequest._llmgw_body_limit = True
