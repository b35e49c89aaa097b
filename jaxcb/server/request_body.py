"""Reading a request body within the server's rules: JSON only, and no more than so many bytes.

Content-Type must be application/json (415 otherwise). A web page can make its visitors'
browsers POST text/plain, a form, or a body with no type to any address without asking the
server first (CORS "simple requests"), but not application/json: so a page cannot drive a
server without an API key from the browser of someone who can reach it.

The size limit answers 413 from Content-Length before anything is read, and counts the bytes
of a body without one (chunked) as they arrive, so a huge body is never held whole.
"""

from __future__ import annotations

from starlette.requests import Request

from jaxcb.server.protocol import APIError

JSON_MEDIA_TYPE = "application/json"


async def read_json_body(request: Request, max_bytes: int) -> bytes:
    """The body of a JSON request; APIError 415 or 413 if it breaks the rules. A client
    that goes away meanwhile raises starlette's ClientDisconnect."""
    content_type = request.headers.get("content-type")
    media_type = (content_type or "").partition(";")[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        got = f"got {content_type!r}" if content_type else "got none"
        raise APIError(
            415,
            f"Content-Type must be {JSON_MEDIA_TYPE}, {got}",
            code="unsupported_media_type",
        )
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
