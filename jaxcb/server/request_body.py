"""Reading a request body within the server's size limit.

The limit answers 413 from Content-Length before anything is read, and counts the bytes
of a body without one (chunked) as they arrive, so a huge body is never held whole.
"""

from __future__ import annotations

from starlette.requests import Request

from jaxcb.server.protocol import APIError


async def read_json_body(request: Request, max_bytes: int) -> bytes:
    """The body of a request; APIError 413 if it is too large. A client that goes away
    meanwhile raises starlette's ClientDisconnect."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(f"is {int(declared)} bytes", max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(f"is over {max_bytes} bytes", max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: str, max_bytes: int) -> APIError:
    return APIError(
        413,
        f"the request body {size}; this server takes at most {max_bytes} bytes "
        "(--max-request-body-mb)",
        code="request_too_large",
    )
