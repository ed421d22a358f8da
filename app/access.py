"""The app's access token, checked on every request before Streamlit sees it (``docs/security.md``).

:class:`TokenGate` wraps Streamlit's ASGI application (Starlette under uvicorn): an HTTP request or
a websocket handshake passes when it carries the token as ``?token=`` or the cookie that a first
request with the token set; everything else gets 403 (a websocket is closed before it is
accepted, which uvicorn answers with 403). That covers the page, ``/_stcore/stream`` (where a
Streamlit app really runs), the upload, media and health endpoints, local requests included, as
Jupyter's token does. Comparisons are constant-time (:func:`hmac.compare_digest`); the cookie holds
an HMAC of the token, not the token; and neither is logged.
"""

from __future__ import annotations

import hashlib
import hmac
from http.cookies import CookieError, SimpleCookie
from urllib.parse import parse_qs

COOKIE_NAME = "jlens_app_token"
QUERY_NAME = "token"
DENIED = (b"403 Forbidden: this jlens app needs its access token. Open the URL that `jlens app` printed "
          b"(http://host:port/?token=...).\n")


def cookie_value(token: str) -> str:
    """What the cookie holds for ``token``: an HMAC of it (the token itself never goes into a cookie)."""
    return hmac.new(token.encode(), b"jlens-app-cookie", hashlib.sha256).hexdigest()


def _header(scope: dict, name: bytes) -> str:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return value.decode("latin-1")
    return ""


class TokenGate:
    """ASGI middleware: only requests carrying ``token`` (query or cookie) reach ``app``.

    Args:
        app: the ASGI application to guard (Streamlit's Starlette app).
        token: the access token; non-empty.

    Raises:
        ValueError: an empty token.
    """

    def __init__(self, app, token: str) -> None:
        if not token:
            raise ValueError("The access token is empty: give a token, or run without the gate.")
        self.app = app
        self._token = token.encode()
        self._cookie = cookie_value(token).encode()

    def allowed(self, scope: dict) -> tuple[bool, bool]:
        """``(allowed, by_query)`` for a request's ASGI scope."""
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        given = query.get(QUERY_NAME, [""])[-1].encode()
        if given and hmac.compare_digest(given, self._token):
            return True, True
        try:
            jar = SimpleCookie(_header(scope, b"cookie"))
        except CookieError:
            return False, False
        morsel = jar.get(COOKIE_NAME)
        return bool(morsel and hmac.compare_digest(morsel.value.encode(), self._cookie)), False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan: Streamlit's start and stop
            await self.app(scope, receive, send)
            return
        ok, by_query = self.allowed(scope)
        if not ok:
            await self._deny(scope, receive, send)
            return
        if not by_query or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # The token came in the URL: answer as usual and set the cookie, so the page's own requests
        # (scripts, the websocket, uploads) pass without it. Served in place, not redirected: a
        # SameSite=Strict cookie is withheld on a redirect chain that a link from elsewhere started.
        cookie = (f"{COOKIE_NAME}={self._cookie.decode()}; Path=/; HttpOnly; SameSite=Strict").encode()

        async def send_with_cookie(message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", []), (b"set-cookie", cookie)])
            await send(message)

        await self.app(scope, receive, send_with_cookie)

    @staticmethod
    async def _deny(scope, receive, send) -> None:
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({"type": "http.response.start", "status": 403,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                (b"content-length", str(len(DENIED)).encode())]})
        await send({"type": "http.response.body", "body": DENIED})
