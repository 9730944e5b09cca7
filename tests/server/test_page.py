"""The chat page at /, driven in headless Chromium (Debian's /usr/bin/chromium; `make browser`).

A missing browser fails this test: the page is part of the product.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import pytest
from playwright.sync_api import Page, expect, sync_playwright

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def page(live) -> Iterator[Page]:
    assert os.path.exists(CHROMIUM), f"{CHROMIUM} is missing: run `make browser` (apt-get install chromium)"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        pg = browser.new_page()
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.goto(live.url + "/")
        expect(pg.locator("#status")).to_have_text("connected", timeout=15_000)
        yield pg
        browser.close()
        assert not errors, errors


def test_page_streams_a_reply(page: Page):
    expect(page.locator("#model")).to_have_text("smol")
    page.fill("#max-tokens", "8")
    page.fill("#input", "Say hello.")
    page.click("#send")
    expect(page.locator(".msg.user")).to_have_text("Say hello.")
    reply = page.locator(".msg.assistant").last
    expect(reply).to_have_attribute("data-state", "done", timeout=30_000)
    assert reply.locator(".body").inner_text().strip()
    expect(reply.locator(".meta")).to_contain_text("tokens")
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#stop")).to_be_disabled()


def test_stop_button_and_new_chat(page: Page):
    page.fill("#max-tokens", "400")
    page.fill("#input", "Write a very long story about a dragon.")
    page.focus("#input")
    page.keyboard.press("Enter")  # Enter sends too
    reply = page.locator(".msg.assistant").last
    expect(reply).to_have_attribute("data-state", "streaming")
    expect(reply.locator(".body")).not_to_have_text("", timeout=30_000)  # text streams in
    expect(page.locator("#stop")).to_be_enabled()
    page.click("#stop")
    expect(reply).to_have_attribute("data-state", "stopped", timeout=15_000)
    expect(reply.locator(".meta")).to_contain_text("abort")
    stopped_text = reply.locator(".body").inner_text()
    page.wait_for_timeout(500)
    assert reply.locator(".body").inner_text() == stopped_text  # nothing more arrives
    assert page.locator(".msg").count() >= 4

    page.click("#new-chat")
    expect(page.locator(".msg")).to_have_count(0)
    page.fill("#max-tokens", "4")
    page.fill("#input", "Hi")
    page.click("#send")
    last = page.locator(".msg.assistant").last
    expect(last).to_have_attribute("data-state", "done", timeout=30_000)
    expect(page.locator(".msg")).to_have_count(2)
    prompt_tokens = int(re.search(r"of (\d+) prompt tokens", last.locator(".meta").inner_text()).group(1))
    assert prompt_tokens < 60  # the server forgot the old conversation too
