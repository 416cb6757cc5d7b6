"""Keys and console sessions: the `freight tenant` key commands (through click's CliRunner, on the
test's own database) and their effect on /v1 and on console sessions; sessions that end on the
server (sign-out, revocation, disabling, expiry), whose cookie holds no key material, marked Secure
over HTTPS; and an upload nobody signed in for, refused before its body is read. SQLite and
PostgreSQL, Flask's test client."""

from __future__ import annotations

import io
import re
import time
from dataclasses import replace
from email.utils import parsedate_to_datetime

import pytest
from sqlalchemy import func, select, update

from api.app import create_app
from api.services import sessions
from api.services.tenants import create_tenant, hash_key
from storage.models import ApiKey, ConsoleSession
from storage.runtime import Runtime
from storage.settings import Settings, SettingsError
from tests.conftest import now
from tests.factories import cli_on

CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


@pytest.fixture
def alpha_key(runtime) -> str:
    return create_tenant(runtime.db, "alpha", now())[1]


cli = cli_on


def v1_status(app, key: str) -> int:
    return app.test_client().get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code


def csrf(client, path: str = "/console/sign-in", **kw) -> str:
    page = client.get(path, **kw)
    assert page.status_code == 200, page.status_code
    return CSRF.search(page.get_data(as_text=True)).group(1)  # type: ignore[union-attr]


def sign_in(client, key: str, **kw):
    response = client.post("/console/sign-in", data={"api_key": key, "csrf_token": csrf(client, **kw)}, **kw)
    assert response.status_code == 302, response.get_data(as_text=True)
    return response


def signed_in(client) -> bool:
    response = client.get("/console/jobs")
    assert response.status_code in (200, 302)
    return response.status_code == 200


def replay(app, cookie: str):
    """A fresh client holding a copy of ``cookie``, as whoever kept one would."""
    client = app.test_client()
    client.set_cookie("session", cookie)
    return client


# --- the CLI ----------------------------------------------------------------------------------


def test_new_key_keys_and_revoke_key(app, runtime, alpha_key) -> None:
    made = cli(runtime, "tenant", "new-key", "alpha")
    assert made.exit_code == 0, made.output
    second = made.output.strip().splitlines()[-1]
    assert second.startswith("fk-") and v1_status(app, second) == 200
    listed = cli(runtime, "tenant", "keys", "alpha")
    assert listed.exit_code == 0, listed.output
    with runtime.db.read() as s:
        ids = {k.key_hash: k.id for k in s.scalars(select(ApiKey))}
    first_id, second_id = ids[hash_key(alpha_key)], ids[hash_key(second)]
    rows = listed.output.splitlines()[1:]
    assert [r.split()[0] for r in rows] == [str(first_id), str(second_id)]
    assert alpha_key[:10] in rows[0] and alpha_key not in listed.output and second not in listed.output
    assert rows[0].split()[-1] == "-"  # not revoked
    # a signed-in console session on the key that is about to go
    console = app.test_client()
    sign_in(console, alpha_key)
    assert signed_in(console)

    revoked = cli(runtime, "tenant", "revoke-key", str(first_id))
    assert revoked.exit_code == 0, revoked.output
    assert f"revoked key {first_id}" in revoked.output and "alpha" in revoked.output
    assert v1_status(app, alpha_key) == 401 and v1_status(app, second) == 200
    assert not signed_in(console)
    assert "UTC" in cli(runtime, "tenant", "keys", "alpha").output.splitlines()[1].split("...")[1]
    unknown = cli(runtime, "tenant", "revoke-key", "999999")
    assert unknown.exit_code == 1 and "no API key with id 999999" in unknown.output
    # `tenant key`, the older name, still adds a key
    older = cli(runtime, "tenant", "key", "alpha")
    assert older.exit_code == 0 and v1_status(app, older.output.strip().splitlines()[-1]) == 200


def test_disable_stops_every_key_and_session(app, runtime, alpha_key) -> None:
    _, beta_key = create_tenant(runtime.db, "beta", now())
    second = cli(runtime, "tenant", "new-key", "alpha").output.strip().splitlines()[-1]
    console = app.test_client()
    sign_in(console, second)
    assert signed_in(console)
    done = cli(runtime, "tenant", "disable", "alpha")
    assert done.exit_code == 0 and "disabled tenant alpha" in done.output, done.output
    assert v1_status(app, alpha_key) == 401 and v1_status(app, second) == 401
    assert not signed_in(console)
    again = app.test_client()
    refused = again.post("/console/sign-in", data={"api_key": alpha_key, "csrf_token": csrf(again)})
    assert refused.status_code == 401
    assert v1_status(app, beta_key) == 200  # the other tenant is untouched
    no_key = cli(runtime, "tenant", "new-key", "alpha")
    assert no_key.exit_code == 1 and "disabled" in no_key.output
    assert cli(runtime, "tenant", "disable", "nobody").exit_code == 1
    # enabled again: its keys work again and its users sign in again (the old session stays ended)
    back = cli(runtime, "tenant", "enable", "alpha")
    assert back.exit_code == 0 and "enabled tenant alpha" in back.output, back.output
    assert v1_status(app, alpha_key) == 200 and v1_status(app, second) == 200
    assert not signed_in(console)
    sign_in(again, alpha_key)
    assert signed_in(again)
    assert cli(runtime, "tenant", "enable", "nobody").exit_code == 1


# --- sessions ---------------------------------------------------------------------------------


def test_sign_out_ends_the_session_on_the_server(app, runtime, alpha_key) -> None:
    client = app.test_client()
    sign_in(client, alpha_key)
    kept = client.get_cookie("session").value
    assert signed_in(replay(app, kept))
    out = client.post("/console/sign-out", data={"csrf_token": csrf(client, "/console/jobs")})
    assert out.status_code == 302
    assert not signed_in(replay(app, kept))  # the old cookie, replayed, no longer works
    with runtime.db.read() as s:
        assert s.scalar(select(func.count()).select_from(ConsoleSession)) == 0


def test_a_tenants_sessions_are_capped_and_the_oldest_ends(app, runtime, alpha_key) -> None:
    """FREIGHT_MAX_SESSIONS_PER_TENANT (3 here): sign-ins past it end the tenant's oldest sessions,
    so its rows stay at the cap however often it signs in; another tenant's are untouched."""
    runtime.settings = replace(runtime.settings, max_sessions_per_tenant=3)
    beta_key = create_tenant(runtime.db, "beta", now())[1]
    address = {"environ_base": {"REMOTE_ADDR": "198.51.100.60"}}
    beta = app.test_client()
    sign_in(beta, beta_key, **address)
    clients = []
    for _ in range(12):
        client = app.test_client()
        sign_in(client, alpha_key, **address)
        clients.append(client)
    with runtime.db.read() as s:
        per_tenant = dict(
            s.execute(select(ConsoleSession.tenant_id, func.count()).group_by(ConsoleSession.tenant_id)).all()
        )
    assert sorted(per_tenant.values()) == [1, 3]  # alpha at its cap, beta's one kept
    assert signed_in(clients[-1]) and signed_in(beta)
    assert sum(signed_in(c) for c in clients) == 3
    # the oldest end: sessions started a second apart, the cap 3
    with runtime.db.read() as s:
        key = s.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(alpha_key)))
        alpha_id, key_id = key.tenant_id, key.id
    t0 = now()
    tokens = [sessions.start(runtime.db, alpha_id, key_id, t0 + i, 3600, 3) for i in range(5)]
    live = [sessions.resume(runtime.db, token, t0 + 5) is not None for token in tokens]
    assert live == [False, False, True, True, True]


def test_the_cookie_holds_no_key_material(app, runtime, alpha_key) -> None:
    client = app.test_client()
    sign_in(client, alpha_key)
    cookie = client.get_cookie("session").value
    payload = app.session_interface.get_signing_serializer(app).loads(cookie)
    assert set(payload) == {"sid", "csrf", "_permanent"}
    digest = hash_key(alpha_key)
    with runtime.db.read() as s:
        [row] = s.scalars(select(ConsoleSession))
        tenant_id = s.scalar(select(ApiKey.tenant_id))
    for secret in (alpha_key, digest, tenant_id, row.id):  # nor the stored session id
        assert secret not in cookie and secret not in str(payload)


def test_session_lifetime(settings) -> None:
    assert Settings.from_env({}).session_seconds == 12 * 3600
    with pytest.raises(SettingsError, match="FREIGHT_SESSION_SECONDS"):
        Settings.from_env({"FREIGHT_SESSION_SECONDS": "10"})
    rt = Runtime(replace(settings, session_seconds=600))
    try:
        app = create_app(runtime=rt)
        _, key = create_tenant(rt.db, "alpha", now())
        client = app.test_client()
        started = time.time()
        signed = sign_in(client, key)
        [cookie] = [c for c in signed.headers.getlist("Set-Cookie") if c.startswith("session=")]
        expires = parsedate_to_datetime(re.search(r"Expires=([^;]+)", cookie).group(1)).timestamp()  # type: ignore[union-attr]
        assert started + 590 <= expires <= started + 610
        with rt.db.read() as s:
            row = s.scalars(select(ConsoleSession)).one()
        assert row.expires_at - row.created_at == 600
        assert signed_in(client)
        # past its end on the server the session is over, whatever the cookie says
        with rt.db.write() as s:
            s.execute(update(ConsoleSession).values(expires_at=now() - 1))
        assert not signed_in(client)
    finally:
        rt.db.dispose()


def session_cookie(response) -> str:
    [cookie] = [c for c in response.headers.getlist("Set-Cookie") if c.startswith("session=")]
    return cookie


@pytest.mark.parametrize("proxy", ["none", "trusted", "untrusted"])
def test_the_cookie_is_secure_over_https(settings, proxy: str) -> None:
    rt = Runtime(replace(settings, trusted_proxies=("10.0.0.1",)))
    try:
        app = create_app(runtime=rt)
        _, key = create_tenant(rt.db, "alpha", now())
        if proxy == "none":  # TLS at the server itself
            https = sign_in(app.test_client(), key, base_url="https://localhost")
            plain = sign_in(app.test_client(), key)
            assert "; Secure" in session_cookie(https) and "Secure" not in session_cookie(plain)
            return
        peer = {"REMOTE_ADDR": "10.0.0.1" if proxy == "trusted" else "203.0.113.7"}
        forwarded = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "198.51.100.9"}
        cookie = session_cookie(sign_in(app.test_client(), key, environ_base=peer, headers=forwarded))
        assert ("; Secure" in cookie) == (proxy == "trusted")
    finally:
        rt.db.dispose()


# --- uploads nobody signed in for -------------------------------------------------------------


class Unreadable(io.RawIOBase):
    """A request body of ``length`` bytes (as its declared Content-Length) that fails the test if
    anything reads it."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.position = 0
        self.reads = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.position = {0: 0, 1: self.position, 2: self.length}[whence] + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer) -> int:  # type: ignore[override]
        self.reads += 1
        raise AssertionError("the upload's body was read")


@pytest.mark.parametrize("length", [1_000_000, 10**9])
def test_an_upload_without_a_session_is_refused_unread(app, alpha_key, length: int) -> None:
    body = Unreadable(length)
    refused = app.test_client().post(
        "/console/upload", input_stream=body, content_type="multipart/form-data; boundary=x"
    )
    assert refused.status_code == 302 and "/console/sign-in" in refused.location
    assert body.reads == 0
    # a signed-out session's cookie is no better
    client = app.test_client()
    sign_in(client, alpha_key)
    kept = client.get_cookie("session").value
    client.post("/console/sign-out", data={"csrf_token": csrf(client, "/console/jobs")})
    stale = Unreadable(length)
    again = replay(app, kept).post(
        "/console/upload", input_stream=stale, content_type="multipart/form-data; boundary=x"
    )
    assert again.status_code == 302 and stale.reads == 0
