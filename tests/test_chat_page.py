"""The chat page at /, driven in a real browser (Debian's chromium through Playwright) against a live
server on a tiny model: streaming, stats, a second turn, and the error path."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


@pytest.fixture(scope="module")
def page(server):
    if CHROMIUM is None:
        if os.environ.get("SPECSERVE_REQUIRE_SYSTEM_DEPS") == "1":
            pytest.fail("chromium is required here (SPECSERVE_REQUIRE_SYSTEM_DEPS=1)")
        pytest.skip("chromium is not installed (.ci/run installs Debian's chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1180, "height": 760})
        page.goto(server.url + "/")
        yield page
        browser.close()


def _send(page, text: str) -> None:
    page.fill("#message", text)
    page.press("#message", "Enter")


def _last_reply(page):
    replies = page.locator(".turn.assistant")
    replies.last.wait_for()
    page.wait_for_function(
        "() => { const r = [...document.querySelectorAll('.turn.assistant')].pop();"
        " return r && !r.hasAttribute('data-streaming'); }",
        timeout=30_000,
    )
    return replies.last


def test_the_page_is_served_offline_with_no_outside_resources(server):
    import httpx

    html = httpx.get(server.url + "/").text
    assert "<script>" in html and "http://" not in html and "https://" not in html  # no CDN, no build


def test_a_message_streams_in_and_the_stats_update(page):
    page.wait_for_function("() => document.getElementById('model').textContent === 'tiny'")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "40")
    page.select_option("#drafter", "model")
    _send(page, "Hello there")
    reply = _last_reply(page)
    assert len(reply.inner_text()) > 0
    assert reply.locator("span").count() >= 10  # one piece per streamed token
    assert page.inner_text("#stat-tokens") != "–"
    drafted = int(page.inner_text("#stat-drafted"))
    accepted = int(page.inner_text("#stat-accepted"))
    assert drafted > 0 and 0 <= accepted <= drafted
    assert page.inner_text("#stat-acceptance").endswith("%")
    assert float(page.inner_text("#stat-speed")) > 0
    if accepted:  # text from accepted draft tokens is highlighted
        assert reply.locator("span.draft").count() >= 1
    # the drafter menu lists what runs here, each with the speed measured on this server
    page.wait_for_function("() => document.querySelector('#drafter option[value=model]').text.endsWith(' tok/s')")
    assert page.locator("#drafter").input_value() == "model"  # the choice survives the refresh
    # every entry fits the menu's width: none is cut off ("server default (auto: 7.9 to")
    overflowing = """() => {
        const select = document.getElementById('drafter');
        const context = document.createElement('canvas').getContext('2d');
        context.font = getComputedStyle(select).font;
        const room = select.clientWidth - 28;  // the arrow and the padding
        return [...select.options].map(o => o.text).filter(text => context.measureText(text).width > room);
    }"""
    assert page.evaluate(overflowing) == []
    # nor at four-figure speeds, which a tiny model on a fast host reaches ("default: model, 1002.3 tok/s")
    card = {"drafters": ["model", "suffix"], "default_drafter": "model"}
    page.evaluate("card => showDrafters(card)", card | {"drafter_tokens_per_s": {"model": 1002.3, "suffix": 9876.5}})
    assert page.evaluate(overflowing) == []
    assert page.locator("#drafter option[value=model]").inner_text() == "model, 1002 tok/s"


def test_a_second_turn_keeps_the_history_and_reuses_the_prefix(page, tmp_path):
    _send(page, "And again")
    _last_reply(page)
    assert page.locator(".turn.user").count() == 2 and page.locator(".turn.assistant").count() == 2
    assert int(page.inner_text("#stat-cached")) > 0  # the first turn's tokens came from the KV cache
    page.screenshot(path=str(tmp_path / "chat.png"))  # docs/chat.png is the same page on SmolLM2


def test_a_bad_parameter_shows_a_clear_error(page):
    page.fill("#max-tokens", "100000")
    _send(page, "This asks for too much")
    alert = page.locator(".turn.error").last
    alert.wait_for(timeout=10_000)
    assert "400" in alert.inner_text() and "context" in alert.inner_text()
    page.fill("#max-tokens", "20")
    _send(page, "Fine now")
    assert len(_last_reply(page).inner_text()) > 0


def test_a_reply_cut_at_its_limit_says_so_and_unset_fields_are_the_servers(page):
    bodies = []
    page.on("request", lambda r: bodies.append(r.post_data_json) if r.url.endswith("/chat/completions") else None)
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "3")
    _send(page, "Cut me short")
    reply = _last_reply(page)
    assert reply.get_attribute("data-finish") == "length"
    assert reply.locator(".cut").inner_text() == "cut at the length limit (Max tokens sets it)"
    assert bodies[-1]["temperature"] == 0 and bodies[-1]["max_tokens"] == 3
    page.fill("#temperature", "")  # as the page first shows them: the server's defaults
    page.fill("#max-tokens", "")
    _send(page, "Now as the server likes")
    reply = _last_reply(page)
    assert "temperature" not in bodies[-1] and "max_tokens" not in bodies[-1]
    assert (reply.get_attribute("data-finish") == "length") == (reply.locator(".cut").count() == 1)


def test_the_page_asks_for_nothing_that_is_missing(server, page):
    """No request of the page's gets a 404: its icon is inline, so there is no /favicon.ico to miss."""
    missing = []
    page.on("response", lambda response: missing.append(response.url) if response.status == 404 else None)
    page.goto(server.url + "/")
    page.wait_for_function("() => document.getElementById('model').textContent === 'tiny'")
    assert missing == []
    assert page.evaluate("() => document.querySelector('link[rel=icon]').href.startsWith('data:image/svg+xml')")
