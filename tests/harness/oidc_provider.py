"""A small OpenID Connect provider for tests, run as its own process:
``python -m tests.harness.oidc_provider --port N --users users.json --client id:secret``.

It speaks the real protocol over HTTP, as a packaged provider would: discovery
(``/.well-known/openid-configuration``), the authorization endpoint with a sign-in form
(``/authorize``), the token endpoint with PKCE (``/token``), userinfo (``/userinfo``) and the
JWKS (``/jwks``), with ID tokens signed RS256 by a key made at start. Users and their groups
come from a JSON file: ``{"carol": {"password": "…", "email": "…", "groups": ["…"]}}``, keyed by
the name typed into the form. Their claims default to ``sub-<name>``, the name and
``<name>@example.com``; a user's ``sub``, ``preferred_username`` (null: none), ``email`` and
``email_verified`` say otherwise, as a provider whose users choose their names would.

Nothing in llmgw imports it; the tests start it with :func:`start_provider`.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import html
import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlparse

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa

KID = "test-key-1"


class Provider:
    def __init__(self, issuer: str, users: dict[str, Any], client_id: str, secret: str) -> None:
        self.issuer = issuer
        self.users = users
        self.client_id = client_id
        self.secret = secret
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.codes: dict[str, dict[str, Any]] = {}
        self.access: dict[str, str] = {}
        self.lock = threading.Lock()

    def discovery(self) -> dict[str, Any]:
        return {
            "issuer": self.issuer,
            "authorization_endpoint": f"{self.issuer}/authorize",
            "token_endpoint": f"{self.issuer}/token",
            "userinfo_endpoint": f"{self.issuer}/userinfo",
            "jwks_uri": f"{self.issuer}/jwks",
            "response_types_supported": ["code"],
            "subject_types_supported": ["public"],
            "id_token_signing_alg_values_supported": ["RS256"],
            "code_challenge_methods_supported": ["S256"],
            "token_endpoint_auth_methods_supported": ["client_secret_post", "client_secret_basic"],
        }

    def jwks(self) -> dict[str, Any]:
        jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.key.public_key()))
        return {"keys": [{**jwk, "kid": KID, "alg": "RS256", "use": "sig"}]}

    def claims(self, username: str) -> dict[str, Any]:
        user = self.users[username]
        claims = {
            "sub": user.get("sub", f"sub-{username}"),
            "preferred_username": user.get("preferred_username", username),
            "email": user.get("email", f"{username}@example.com"),
            "groups": user.get("groups", []),
        }
        if "email_verified" in user:
            claims["email_verified"] = user["email_verified"]
        return {k: v for k, v in claims.items() if v is not None}

    def id_token(self, username: str, nonce: str | None) -> str:
        now = int(time.time())
        identity = self.claims(username)
        claims = {
            "iss": self.issuer,
            "aud": self.client_id,
            "iat": now,
            "exp": now + 300,
            "sub": identity["sub"],
        }
        if "preferred_username" in identity:
            claims["preferred_username"] = identity["preferred_username"]
        if nonce:
            claims["nonce"] = nonce
        return jwt.encode(claims, self.key, algorithm="RS256", headers={"kid": KID})


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class Handler(BaseHTTPRequestHandler):
    provider: Provider

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: Any, content_type: str = "application/json") -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(data)

    def _redirect(self, url: str) -> None:
        self.send_response(302)
        self.send_header("Location", url)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _form(self) -> dict[str, str]:
        length = int(self.headers.get("Content-Length") or 0)
        fields = parse_qs(self.rfile.read(length).decode())
        return {k: v[0] for k, v in fields.items()}

    def do_GET(self) -> None:
        url = urlparse(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        p = self.provider
        if url.path == "/.well-known/openid-configuration":
            self._send(200, p.discovery())
        elif url.path == "/jwks":
            self._send(200, p.jwks())
        elif url.path == "/authorize":
            if query.get("client_id") != p.client_id or query.get("response_type") != "code":
                self._send(400, {"error": "invalid_request"})
                return
            hidden = "".join(
                f'<input type="hidden" name="{html.escape(k)}" value="{html.escape(v)}">'
                for k, v in query.items()
            )
            self._send(
                200,
                "<!doctype html><title>Test provider</title><form method=post action=/authorize>"
                f"{hidden}<label>User <input id=username name=username></label>"
                "<label>Password <input id=password type=password name=password></label>"
                "<button id=sign-in type=submit>Sign in</button></form>",
                "text/html; charset=utf-8",
            )
        elif url.path == "/userinfo":
            token = self.headers.get("Authorization", "").removeprefix("Bearer ")
            with p.lock:
                username = p.access.get(token)
            if username is None:
                self._send(401, {"error": "invalid_token"})
                return
            self._send(200, p.claims(username))
        else:
            self._send(404, {"error": "not_found"})

    def do_POST(self) -> None:
        url = urlparse(self.path)
        form = self._form()
        p = self.provider
        if url.path == "/authorize":
            user = p.users.get(form.get("username", ""))
            if user is None or user.get("password") != form.get("password"):
                self._send(401, "<p id=error>wrong user or password</p>", "text/html")
                return
            code = secrets.token_urlsafe(24)
            with p.lock:
                p.codes[code] = {**form, "issued": time.time()}
            back = {"code": code, "state": form.get("state", "")}
            self._redirect(f"{form['redirect_uri']}?{urlencode(back)}")
        elif url.path == "/token":
            client_id, secret = form.get("client_id"), form.get("client_secret")
            basic = self.headers.get("Authorization", "")
            if basic.startswith("Basic "):
                client_id, _, secret = base64.b64decode(basic[6:]).decode().partition(":")
            if (client_id, secret) != (p.client_id, p.secret):
                self._send(401, {"error": "invalid_client"})
                return
            with p.lock:
                grant = p.codes.pop(form.get("code", ""), None)  # a code is used once
            if (
                grant is None
                or grant["redirect_uri"] != form.get("redirect_uri")
                or time.time() - grant["issued"] > 60
            ):
                self._send(400, {"error": "invalid_grant"})
                return
            if "code_challenge" in grant:
                verifier = form.get("code_verifier", "")
                if _b64(hashlib.sha256(verifier.encode()).digest()) != grant["code_challenge"]:
                    self._send(400, {"error": "invalid_grant", "error_description": "PKCE"})
                    return
            access = secrets.token_urlsafe(24)
            with p.lock:
                p.access[access] = grant["username"]
            self._send(
                200,
                {
                    "access_token": access,
                    "token_type": "Bearer",
                    "expires_in": 300,
                    "id_token": p.id_token(grant["username"], grant.get("nonce")),
                },
            )
        else:
            self._send(404, {"error": "not_found"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--users", type=Path, required=True)
    parser.add_argument("--client", required=True, help="client_id:client_secret")
    args = parser.parse_args()
    client_id, _, secret = args.client.partition(":")
    issuer = f"http://127.0.0.1:{args.port}"
    Handler.provider = Provider(issuer, json.loads(args.users.read_text()), client_id, secret)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"oidc provider on {issuer}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
