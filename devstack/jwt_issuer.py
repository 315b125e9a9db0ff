"""A stand-in for the identity provider of a Temporal deployed with authorization: it signs JWTs
(RS256) with a key of its own and publishes the public key as a JWKS file.

Temporal's default claim mapper and authorizer (temporal-server's `global.authorization`:
`jwtKeyProvider.keySourceURIs`, `permissionsClaimName`, docs.temporal.io "Self-hosted Temporal
Service security": JWT) fetch the JWKS, check the signature, the `kid` and the expiry, and read the
permissions claim as `<namespace>:<read|write|worker|admin>` (`temporal-system:admin` for the whole
service). What a real provider (Okta, Auth0, Keycloak) would issue is the same token: the server
cannot tell them apart. Keys are made and tokens signed by the `openssl` command, so no crypto
library joins the project's dependencies.
"""

from __future__ import annotations

import base64
import json
import subprocess
import time
from pathlib import Path
from typing import Any

KEY_ID = "fleetmedic-test"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class JwtIssuer:
    """RS256 tokens signed with a fresh 2048-bit key in `workdir`; `jwks_uri` is the public key."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.key = workdir / "issuer-key.pem"
        subprocess.run(["openssl", "genrsa", "-out", str(self.key), "2048"], check=True, capture_output=True,
                       timeout=60)
        modulus = subprocess.run(["openssl", "rsa", "-in", str(self.key), "-noout", "-modulus"], check=True,
                                 capture_output=True, text=True, timeout=60).stdout.strip().split("=", 1)[1]
        # The public exponent openssl uses for new keys (RSA_F4).
        jwk = {"kty": "RSA", "kid": KEY_ID, "use": "sig", "alg": "RS256",
               "n": _b64url(bytes.fromhex(modulus)), "e": _b64url((65537).to_bytes(3, "big"))}
        self.jwks = workdir / "jwks.json"
        self.jwks.write_text(json.dumps({"keys": [jwk]}))

    @property
    def jwks_uri(self) -> str:
        return self.jwks.resolve().as_uri()

    def token(self, subject: str, permissions: list[str], ttl_s: int = 3600) -> str:
        """A signed token for `subject` with `permissions` (e.g. "fleetmedic:write")."""
        header = {"alg": "RS256", "typ": "JWT", "kid": KEY_ID}
        now = int(time.time())
        claims: dict[str, Any] = {"sub": subject, "permissions": permissions, "iat": now, "exp": now + ttl_s}
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        signature = subprocess.run(["openssl", "dgst", "-sha256", "-sign", str(self.key)],
                                   input=signing_input.encode(), check=True, capture_output=True, timeout=60).stdout
        return f"{signing_input}.{_b64url(signature)}"

    def server_config(self) -> dict[str, Any]:
        """temporal-server's `global.authorization` for tokens of this issuer."""
        return {"jwtKeyProvider": {"keySourceURIs": [self.jwks_uri], "refreshInterval": "1m"},
                "permissionsClaimName": "permissions", "authorizer": "default", "claimMapper": "default"}
