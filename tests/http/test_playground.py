"""The playground page in a real headless browser: Debian's chromium driven by Playwright.

Types a prompt, streams the answer, and checks that the rendered text is the API's answer,
that the accepted draft tokens are highlighted, and that the stats and the acceptance chart
appear; then the side-by-side run. Saves a screenshot (SPLITSPEC_SCREENSHOT: where to copy it).
"""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest
from http_support import PROMPT, WAIT_S, http_verifier
from verifier_support import one_torch_thread  # noqa: F401 - autouse fixture

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"), reason="no chromium (bash .ci/setup installs it)")
def test_playground_streams_highlights_and_compares(tmp_path) -> None:  # noqa: ANN001
    from playwright.async_api import async_playwright

    async def main() -> None:
        async with http_verifier() as h, async_playwright() as pw:
            answer = await h.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0)
            expected = answer.choices[0].text
            browser = await pw.chromium.launch(executable_path=CHROMIUM,
                                               args=["--no-sandbox"] if os.geteuid() == 0 else [])
            try:
                page = await browser.new_page(viewport={"width": 1280, "height": 820})
                page.set_default_timeout(WAIT_S * 1000)
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
                assert await page.text_content("#error") == ""
                assert outside == []  # self-contained: nothing fetched from anywhere else
                if target := os.environ.get("SPLITSPEC_SCREENSHOT"):
                    await page.screenshot(path=target, full_page=True)
            finally:
                await browser.close()

    asyncio.run(main())
