"""People's limits in a real headless Chromium: an administrator limits a user in the admin;
that user makes a key at /account/ and cannot get past the limit with it (U13).

A web process (the admin and /account/ share it) in front of a ``sim`` engine serving two
models; the key is used with the official ``openai`` client.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from gateway.identity.keys import KEY_PREFIX
from gateway.models import ApiKey, UsageRecord, UserLimits
from tests.harness.browser import Browser
from tests.harness.factories import PASSWORD, make_user, serve_model
from tests.harness.live import start_sim, start_web, stop_checked
from tests.harness.procs import Proc
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

KEY_RE = re.compile(re.escape(KEY_PREFIX) + r"[A-Za-z0-9_-]{43}")
MAX_TOKENS = 10


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Proc, Proc]]:
    sim = start_sim(tmp_path, ["small", "large"])
    web = start_web(tmp_path / "var")
    try:
        yield web, sim
    finally:
        stop_checked(web)
        sim.stop()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    b = Browser(tmp_path / "chromium")
    try:
        yield b
    finally:
        b.close()


def sign_in(browser: Browser, url: str, username: str) -> None:
    browser.goto(url)
    browser.type("#id_username", username)
    browser.type("#id_password", PASSWORD)
    browser.submit("[type=submit]")


def ask(api: openai.OpenAI, model: str) -> int:
    try:
        api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_TOKENS
        )
    except openai.APIStatusError as error:
        return error.status_code
    return 200


def test_an_administrator_limits_a_user_whose_own_key_cannot_exceed_it(
    stack: tuple[Proc, Proc], browser: Browser
) -> None:
    web, sim = stack
    base = web.url
    make_user("root", superuser=True)
    alice = make_user("alice")
    serve_model("small", [sim.port])
    serve_model("large", [sim.port])

    # --- staff: alice may use "small" only, 60 tokens a month ---------------------------------
    sign_in(browser, f"{base}/admin/login/?next=/admin/", "root")
    browser.goto(f"{base}/admin/gateway/userlimits/add/")
    browser.click(".field-user .select2-selection")
    browser.page("Input.insertText", {"text": "alice"})
    wait_until(
        lambda: browser.eval(
            "(e => e && e.innerText)"
            "(document.querySelector('.select2-results__option--highlighted'))"
        ) == "alice", what="the user search to offer alice",
    )  # fmt: skip
    browser.press("Enter", 13)
    browser.eval("document.getElementById('id_allowed_models').value = ''")
    browser.type("#id_allowed_models", '["small"]')
    browser.type("#id_token_budget", "60")
    browser.submit("input[name=_save]")
    wait_until(lambda: UserLimits.objects.filter(user=alice).exists(), what="alice's limits")
    limits = UserLimits.objects.get(user=alice)
    assert (limits.allowed_models, limits.token_budget) == (["small"], 60)
    assert "alice" in browser.text("#result_list") and "of 60 per month" in browser.text(
        "#result_list"
    )
    browser.submit("#logout-form button")

    # --- alice: her limits, and a key of her own ------------------------------------------------
    sign_in(browser, f"{base}/account/login/", "alice")
    assert browser.url == f"{base}/account/"
    limits_shown = browser.text("#lg-limits")
    assert "your account" in limits_shown and "small" in limits_shown and "60" in limits_shown
    browser.type("#lg-new-key input[name=name]", "mine")
    browser.submit("#lg-new-key button[type=submit]")
    shown = set(KEY_RE.findall(browser.text()))
    assert len(shown) == 1
    key = shown.pop()
    assert ApiKey.objects.get(user=alice).allowed_models == []  # nothing of its own ...

    # ... and still bound by hers.
    api = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=60)
    wait_until(lambda: ask(api, "small") != 404, what="the gateway to route small")
    assert ask(api, "large") == 403
    statuses = [ask(api, "small") for _ in range(6)]
    assert 200 in statuses and statuses[-1] == 429
    wait_until(
        lambda: (
            UsageRecord.objects.filter(user=alice, status=200).count() == statuses.count(200) + 1
        ),
        what="usage rows",
    )
    spent = sum(
        r.prompt_tokens + r.completion_tokens
        for r in UsageRecord.objects.filter(user=alice, status=200)
    )
    reservation = 60  # generous bound: one request here reserves well under this
    assert spent <= 60 + reservation
    browser.goto(f"{base}/account/")
    assert browser.text("#lg-limits .lg-left") in ("0", str(max(0, 60 - spent)))
    assert browser.console_errors == []
