"""Check an S3 presigned URL the way S3 does: its SigV4 signature and its expiry.

moto, the tests' S3, serves presigned URLs without checking either. So tests that show a
tampered or expired URL being refused use this check. It is written from the AWS SigV4 spec,
not with botocore's signer, so it does not reuse the code that made the URL."""

from __future__ import annotations

import hashlib
import hmac
from datetime import UTC, datetime, timedelta
from urllib.parse import parse_qsl, quote, urlsplit


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def _signature(secret_key: str, scope: list[str], to_sign: str) -> str:
    key = ("AWS4" + secret_key).encode()
    for part in scope:  # date, region, service, "aws4_request"
        key = _hmac(key, part)
    return hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()


def s3_would_accept(url: str, secret_key: str, now: datetime | None = None) -> bool:
    parts = urlsplit(url)
    params = dict(parse_qsl(parts.query, keep_blank_values=True))
    given = params.pop("X-Amz-Signature", "")
    try:
        amz_date, expires = params["X-Amz-Date"], int(params["X-Amz-Expires"])
        scope = params["X-Amz-Credential"].split("/")[1:]
    except (KeyError, ValueError):
        return False
    signed_at = datetime.strptime(amz_date, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
    if (now or datetime.now(UTC)) > signed_at + timedelta(seconds=expires):
        return False
    query = "&".join(
        f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(params.items())
    )
    canonical = f"GET\n{parts.path}\n{query}\nhost:{parts.netloc}\n\nhost\nUNSIGNED-PAYLOAD"
    to_sign = "\n".join(
        [
            "AWS4-HMAC-SHA256",
            amz_date,
            "/".join(scope),
            hashlib.sha256(canonical.encode()).hexdigest(),
        ]
    )
    return hmac.compare_digest(_signature(secret_key, scope, to_sign), given)
