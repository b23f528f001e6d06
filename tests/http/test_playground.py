"""The HTTP API in a real headless browser: Debian's chromium driven by Playwright.

The playground: types a prompt, streams the answer, and checks that the rendered text is the
API's answer, that the accepted draft tokens are highlighted, and that the stats and the
acceptance chart appear; then the side-by-side run, sampled too (the model's sampling, one seed).
Saves a screenshot (SPLITSPEC_SCREENSHOT: where to copy it). Web pages of other origins: they call
the API where --allowed-origins lets them.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import shutil
import threading
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest
from http_support import PROMPT, WAIT_S, http_verifier
from thinking_model import THINKING_CHAT, thinking_model, thinking_tokenizer
from verifier_support import one_torch_thread  # noqa: F401 - autouse fixture

if TYPE_CHECKING:  # at run time Playwright is imported by the tests that run, as they do below
    from playwright.async_api import Page

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@contextlib.asynccontextmanager
async def browser_page(pw, **options: object) -> AsyncIterator[Page]:  # noqa: ANN001 - Playwright's own object
    """A page of a fresh headless chromium (closed afterwards), every wait on it bounded by WAIT_S."""
    browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"] if os.geteuid() == 0 else [])
    try:
        page = await browser.new_page(**options)
        page.set_default_timeout(WAIT_S * 1000)
        yield page
    finally:
        await browser.close()


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"), reason="no chromium (bash .ci/setup installs it)")
def test_playground_streams_highlights_and_compares(tmp_path) -> None:  # noqa: ANN001
    from playwright.async_api import async_playwright

    async def main() -> None:
        async with http_verifier() as h, async_playwright() as pw:
            answer = await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0)
            expected = answer.choices[0].text
            async with browser_page(pw, viewport={"width": 1280, "height": 820}) as page:
                outside: list[str] = []
                page.on("request", lambda r: None if r.url.startswith(h.base_url) else outside.append(r.url))
                await page.goto(h.base_url + "/")
                await page.wait_for_function("document.getElementById('model').textContent === 'model: tiny'")
                await page.select_option("#mode", "prompt")
                await page.fill("#prompt", PROMPT)
                await page.fill("#max-tokens", "40")
                await page.click("#run")
                await page.wait_for_function("document.getElementById('status').textContent === 'done'")
                assert await page.text_content("#output") == expected
                drafted = await page.locator("#output .tok.drafted").count()
                assert drafted == sum(answer.choices[0].model_extra["splitspec"]["drafted"]) > 0
                assert await page.locator("#output .tok").count() == 40
                mal = answer.model_extra["speculation"]["mean_acceptance_length"]
                assert await page.text_content("#mal") == f"{mal:.2f}"
                assert float(await page.text_content("#tps")) > 0
                assert await page.text_content("#tokens") == "40"
                assert await page.locator("#chart .bar").count() == len(
                    answer.model_extra["speculation"]["num_accepted_tokens_per_pos"]) > 0
                await page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)

                await page.click("#compare")
                await page.wait_for_function("document.getElementById('status').textContent.startsWith('done:')")
                assert await page.text_content("#cmp-spec-out") == expected
                assert await page.text_content("#cmp-plain-out") == expected
                assert await page.locator("#cmp-plain-out .tok.drafted").count() == 0
                assert await page.locator("#cmp-spec-out .tok.drafted").count() > 0
                assert (await page.text_content("#cmp-spec")).endswith("tokens/s")
                assert (await page.text_content("#cmp-plain")).endswith("tokens/s")
                assert (await page.text_content("#status")).endswith(", the same output")
                assert await page.text_content("#error") == ""
                assert outside == []  # self-contained: nothing fetched from anywhere else
                if target := os.environ.get("SPLITSPEC_SCREENSHOT"):
                    await page.screenshot(path=target, full_page=True)

    asyncio.run(main())


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"), reason="no chromium (bash .ci/setup installs it)")
def test_the_playground_samples_as_the_model_recommends_and_compares_with_one_seed() -> None:
    """Temperature left empty: the model's sampling (its generation config). Side by side, both runs carry one
    seed, so the sampled answers agree with and without speculation, and are not greedy decoding's."""
    from playwright.async_api import async_playwright

    async def main() -> None:
        async with http_verifier(override_generation_config={"temperature": 0.9, "top_k": 8}) as h, \
                async_playwright() as pw:
            greedy = (await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24,
                                                        temperature=0)).choices[0].text
            async with browser_page(pw) as page:
                await page.goto(h.base_url + "/")
                await page.wait_for_function("document.getElementById('model').textContent === 'model: tiny'")
                assert await page.input_value("#temperature") == ""
                await page.select_option("#mode", "prompt")
                await page.fill("#prompt", PROMPT)
                await page.fill("#max-tokens", "24")
                await page.click("#compare")
                await page.wait_for_function("document.getElementById('status').textContent.startsWith('done:')")
                assert (await page.text_content("#status")).endswith(", the same output")
                sampled = await page.text_content("#cmp-spec-out")
                assert sampled == await page.text_content("#cmp-plain-out") != greedy

    asyncio.run(main())


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"), reason="no chromium (bash .ci/setup installs it)")
def test_the_playground_dims_a_reasoning_models_thinking() -> None:
    """Under --reasoning-parser, a chat's thinking tokens (and their </think>) are dimmed, its answer's are not:
    the dimmed text is the API's `reasoning` and its marker, the rest its `content`."""
    from playwright.async_api import async_playwright

    async def main() -> None:
        async with http_verifier(model=thinking_model(), tokenizer=thinking_tokenizer(),
                                 reasoning_parser="deepseek_r1") as h, async_playwright() as pw:
            message = (await h.client.chat.completions.create(model="tiny", messages=THINKING_CHAT, max_tokens=40,
                                                              temperature=0)).choices[0].message
            async with browser_page(pw) as page:
                await page.goto(h.base_url + "/")
                await page.wait_for_function("document.getElementById('model').textContent === 'model: tiny'")
                await page.fill("#prompt", THINKING_CHAT[0]["content"])
                await page.fill("#max-tokens", "40")
                await page.click("#run")
                await page.wait_for_function("document.getElementById('status').textContent === 'done'")
                dimmed = "".join(await page.locator("#output .tok.thinking").all_text_contents())
                plain = "".join(await page.locator("#output .tok:not(.thinking)").all_text_contents())
                assert (dimmed, plain) == (message.reasoning + "</think>", message.content)

    asyncio.run(main())


# A page's fetch of the API: "status body" of its answer, or the error the browser raised (CORS refused).
FETCH = """async ([url, token]) => {
    try {
        const r = await fetch(url + "/v1/completions", {method: "POST", headers: {"Content-Type": "application/json",
            ...(token ? {Authorization: "Bearer " + token} : {})},
            body: JSON.stringify({model: "tiny", prompt: "d10 add", max_tokens: 5, temperature: 0})});
        return r.status + " " + await r.text();
    } catch (e) { return "refused: " + e.message; }
}"""


@contextlib.contextmanager
def page_server():  # noqa: ANN201
    """A static web server on a free port whose every page is empty: one server, two origins (127.0.0.1 and
    localhost name different origins)."""
    class Blank(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(b"<!doctype html><title>app</title>")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Blank)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"), reason="no chromium (bash .ci/setup installs it)")
def test_web_pages_of_allowed_origins_call_the_api_from_a_browser() -> None:
    """By default (vLLM's "*") any page may call the API; with --allowed-origins, the origins listed only.
    The bearer token is still checked (a 401 the page can read), and a refused origin gets no answer at all."""
    from playwright.async_api import async_playwright

    async def main() -> None:
        with page_server() as port:
            allowed, other = f"http://127.0.0.1:{port}", f"http://localhost:{port}"
            async with (http_verifier(speculate=False, api_key="sekret", auth_token="sekret") as anyone,
                        http_verifier(speculate=False, api_key="sekret", auth_token="sekret",
                                      allowed_origins=(allowed,)) as listed,
                        async_playwright() as pw):
                expected = (await anyone.client.completions.create(model="tiny", prompt="d10 add", max_tokens=5,
                                                                   temperature=0)).choices[0].text
                async with browser_page(pw) as page:
                    for origin, api, answered in ((other, anyone, True), (allowed, listed, True),
                                                  (other, listed, False)):
                        await page.goto(origin + "/")
                        answer = await page.evaluate(FETCH, [api.base_url, "sekret"])
                        if not answered:
                            assert answer.startswith("refused: "), (origin, answer)
                            continue
                        status, _, body = answer.partition(" ")
                        assert (status, json.loads(body)["choices"][0]["text"]) == ("200", expected), origin
                        status, _, body = (await page.evaluate(FETCH, [api.base_url, ""])).partition(" ")
                        assert (status, json.loads(body)["error"]["code"]) == ("401", "invalid_api_key"), origin

    asyncio.run(main())
