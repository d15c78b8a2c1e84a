"""A job's webhook: which URLs pass (http(s), public, resolvable), the tenant's default, the
events the CLI takes, the per-tenant secret; and the API's answers to bad ones."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from pydantic import SecretStr

from kiln.app.core.errors import ConflictError, InputError
from kiln.app.db.models import TenantSettings
from kiln.app.jobs.webhooks import EVENTS, check_url, notify_of, parse_events
from kiln.app.tenants.webhook_secret import tenant_secret


@pytest.mark.parametrize(
    "url",
    [
        "ftp://example.com/hook",
        "file:///etc/passwd",
        "javascript:alert(1)",
        "https:///no-host",
        "example.com/hook",
        "http://example.com:99999/hook",
    ],
)
def test_only_http_urls_with_a_host_pass(url: str) -> None:
    with pytest.raises(InputError, match="webhook"):
        check_url(url, allow_private=True)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8080/hook",  # loopback
        "http://localhost/hook",  # loopback, by name
        "http://10.1.2.3/hook",  # private
        "http://192.168.0.10/hook",
        "http://172.16.5.4/hook",
        "http://169.254.169.254/latest/meta-data",  # link-local: a cloud's metadata service
        "http://[::1]/hook",
        "http://[fe80::1]/hook",
        "http://[::ffff:127.0.0.1]/hook",  # an IPv4-mapped loopback
        "http://0.0.0.0/hook",  # reserved
        "http://240.0.0.1/hook",
        "http://100.64.0.1/hook",  # shared address space
    ],
)
def test_private_loopback_link_local_and_reserved_addresses_are_refused(url: str) -> None:
    with pytest.raises(InputError, match="KILN_WEBHOOK_ALLOW_PRIVATE"):
        check_url(url, allow_private=False)
    check_url(url, allow_private=True)  # the operator may allow them


def test_public_addresses_pass() -> None:
    check_url("https://93.184.215.14/hook", allow_private=False)
    check_url("http://[2606:2800:21f:cb07:6820:80da:af6b:8b2c]:8443/x", allow_private=False)


def test_a_name_that_does_not_resolve_is_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    def nowhere(*_: Any, **__: Any) -> Any:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", nowhere)
    with pytest.raises(InputError, match="unreachable"):
        check_url("https://hooks.invalid/x", allow_private=False)


def test_a_name_with_any_private_address_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name resolving to a public and a private address: the sender might reach either."""

    def two(host: str, port: int, **_: Any) -> list[Any]:
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.215.14", port)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", port)),
        ]

    monkeypatch.setattr(socket, "getaddrinfo", two)
    with pytest.raises(InputError, match=r"10\.0\.0\.7"):
        check_url("https://mixed.example/x", allow_private=False)


def test_the_job_s_own_webhook_wins_over_the_tenant_s_default() -> None:
    default = TenantSettings(tenant="acme", notify_url="https://t.example/h", notify_events=None)
    asked = {"url": "https://j.example/h", "events": ["failed"]}
    assert notify_of(asked, default) == asked
    assert notify_of(None, default) == {"url": "https://t.example/h", "events": list(EVENTS)}
    assert notify_of(None, None) is None
    assert notify_of(None, TenantSettings(tenant="acme", notify_url=None)) is None


def test_events_keep_their_order_and_refuse_unknown_ones() -> None:
    assert parse_events("failed, completed") == ["completed", "failed"]
    with pytest.raises(InputError, match="expired"):
        parse_events("completed,expired")
    with pytest.raises(InputError):
        parse_events(" , ")


def test_each_tenant_has_its_own_stable_secret() -> None:
    deployment = SecretStr("a-deployment-secret-of-some-length")
    acme = tenant_secret(deployment, "acme")
    assert acme.startswith("whsec_")
    assert acme == tenant_secret(deployment, "acme")
    assert acme != tenant_secret(deployment, "globex")
    assert acme != tenant_secret(SecretStr("another-deployment-secret!!"), "acme")


def test_no_deployment_secret_means_no_webhooks() -> None:
    with pytest.raises(ConflictError, match="KILN_WEBHOOK_SECRET"):
        tenant_secret(None, "acme")
