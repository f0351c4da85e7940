"""The playground behind a login (``--users`` / ``--api-key-login``: Gradio's own ``auth``), in headless Chromium
on an in-process server with the tiny model: a visitor without credentials, or with wrong ones, gets the login
page and never the app (its API refuses them too); one with a listed user's password, or with the server's API
key, gets in. The users file and the command's options are checked too."""
from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from mtpflow.errors import UserError
from mtpflow.playground.__main__ import login, parse_args
from mtpflow.playground.server import login_check, read_users

USERS = {"ada": "lovelace:1843"}
API_KEY = "sk-playground-test"


@pytest.fixture(scope="module")
def locked_url(tiny, tmp_path_factory):
    from mtpflow.playground.app import build_blocks
    from mtpflow.playground.runner import PlaygroundRunner
    from mtpflow.playground.server import BackgroundServer, create_server_app

    db = tmp_path_factory.mktemp("login") / "traces.db"
    runner = PlaygroundRunner((f"trace.db={db}", "chat=false"), loaded=tiny, max_tokens_cap=16)
    app = create_server_app(build_blocks(runner), runner.trace_store(), auth=login_check(USERS, API_KEY))
    server = BackgroundServer(app).start()
    yield server.url
    server.stop()


def log_in(page, url: str, user: str, password: str) -> None:
    page.goto(url)
    page.get_by_label("username").fill(user)
    page.get_by_label("password").fill(password)
    page.get_by_role("button", name="Login").click()


@pytest.mark.browser
def test_a_visitor_without_credentials_gets_the_login_page_only(locked_url, page):
    page.goto(locked_url)
    page.get_by_label("password").wait_for()
    assert page.get_by_role("textbox", name="Prompt", exact=True).count() == 0
    log_in(page, locked_url, "ada", "wrong")
    page.get_by_text("Incorrect Credentials").wait_for()
    assert page.get_by_role("textbox", name="Prompt", exact=True).count() == 0
    with pytest.raises(urllib.error.HTTPError) as err:  # the app's API is closed as well, not only the page
        urllib.request.urlopen(locked_url + "config", timeout=30)
    assert err.value.code == 401


@pytest.mark.browser
@pytest.mark.parametrize("user,password", [("ada", USERS["ada"]), ("anyone", API_KEY)])
def test_a_visitor_with_credentials_gets_in(locked_url, page, user, password):
    log_in(page, locked_url, user, password)
    page.get_by_role("textbox", name="Prompt", exact=True).wait_for()
    assert page.get_by_role("button", name="Compare").count() >= 1


def test_read_users(tmp_path):
    path = tmp_path / "users"
    path.write_text("# who may log in\nada:lovelace:1843\n\n bob : x\n")
    assert read_users(path) == {"ada": "lovelace:1843", "bob": " x"}
    for text, message in (("ada\n", "expected user:password"), ("# none\n", "names no user")):
        path.write_text(text)
        with pytest.raises(UserError, match=message):
            read_users(path)
    with pytest.raises(UserError, match="cannot read the users file"):
        read_users(tmp_path / "missing")


def test_login_options(tmp_path, monkeypatch):
    for name in ("MTPFLOW_PLAYGROUND_USERS", "MTPFLOW_PLAYGROUND_USER", "MTPFLOW_PLAYGROUND_PASSWORD",
                 "MTPFLOW_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert login(parse_args([])) is None
    monkeypatch.setenv("MTPFLOW_PLAYGROUND_USER", "ada")
    with pytest.raises(UserError, match="set both"):
        login(parse_args([]))
    monkeypatch.setenv("MTPFLOW_PLAYGROUND_PASSWORD", "pw")
    check = login(parse_args([]))
    assert check("ada", "pw") and not check("ada", "PW") and not check("bob", "pw")
    with pytest.raises(UserError, match="MTPFLOW_API_KEY"):
        login(parse_args(["--api-key-login"]))
    monkeypatch.setenv("MTPFLOW_API_KEY", "k")
    check = login(parse_args(["--api-key-login"]))
    assert check("anyone", "k") and check("ada", "pw") and not check("anyone", "pw")
