"""The built site, looked at in a real browser: headless Chromium (Debian's package, driven by
Playwright) loads the front page, a user-guide page and a gallery page from a local HTTP server,
checks that each renders (a title, a heading, text), that every image on it loaded, and that
every internal link on it leads to a page that exists and, for a link with a fragment, to an
element with that id. A screenshot of each page is kept in ``docs/_build/html/_screenshots/``.

Run by ``make docs`` after the build (``pytest docs/_tests``); it needs the built site and
``/usr/bin/chromium`` (``apt-get install chromium``), and fails, rather than skips, without them.
"""

from __future__ import annotations

import functools
import html.parser
import http.server
import threading
import urllib.parse
from pathlib import Path

import pytest

SITE = Path(__file__).resolve().parents[1] / "_build" / "html"
SHOTS = SITE / "_screenshots"
CHROMIUM = Path("/usr/bin/chromium")
# the closed network here refuses Chromium's background connections: keep it from making them
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PAGES = {
    "front": "index.html",
    "guide": "guide/pvi.html",
    "gallery": "gallery/tutorials/sgp_synthetic.html",
}


class _Ids(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        self.ids.update(v for k, v in attrs if k == "id" and v)


@functools.cache
def _ids(path: Path) -> frozenset[str]:
    parser = _Ids()
    parser.feed(path.read_text(errors="replace"))
    return frozenset(parser.ids)


@pytest.fixture(scope="module")
def server():
    assert (SITE / "index.html").exists(), f"no built site at {SITE}: run `make docs` first"
    handler = functools.partial(_QuietHandler, directory=str(SITE))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser():
    assert CHROMIUM.exists(), "the browser test needs Debian's chromium: apt-get install chromium"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chrome = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=ARGS)
        yield chrome
        chrome.close()


def _broken_internal_links(hrefs: list[str], page_url: str, root: str) -> list[str]:
    """Internal links (same server) whose page is missing, or whose fragment names no id."""
    broken = []
    for href in sorted(set(hrefs)):
        url = urllib.parse.urljoin(page_url, href)
        if not url.startswith(root):
            continue  # external: not followed (no network here)
        parts = urllib.parse.urlsplit(url)
        target = SITE / urllib.parse.unquote(parts.path[len(urllib.parse.urlsplit(root).path):])
        if target.is_dir():
            target = target / "index.html"
        if not target.is_file():
            broken.append(f"{href} (no file {target.relative_to(SITE)})")
        elif parts.fragment and target.suffix == ".html" and \
                urllib.parse.unquote(parts.fragment) not in _ids(target):
            broken.append(f"{href} (no id {parts.fragment!r} in {target.relative_to(SITE)})")
    return broken


@pytest.mark.parametrize("name", list(PAGES))
def test_page_renders_with_its_images_and_links(name, server, browser):
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    failed: list[str] = []
    page.on("requestfailed", lambda req: failed.append(req.url))
    response = page.goto(server + PAGES[name], wait_until="load")
    assert response is not None and response.status == 200
    assert page.title().strip(), "no <title>"
    heading = page.locator("article h1").first
    assert heading.is_visible() and heading.inner_text().strip()
    assert len(page.locator("article").inner_text()) > 500, "the article is nearly empty"
    # images: scroll through the page so lazy images load, then every <img> has pixels
    page.evaluate("window.scrollTo(0, document.body.scrollHeight)")
    page.wait_for_load_state("networkidle")
    images = page.eval_on_selector_all(
        "img", "els => els.map(e => [e.getAttribute('src'), e.complete && e.naturalWidth > 0])")
    missing = [src for src, ok in images if not ok]
    assert not missing, f"images that did not load: {missing}"
    hrefs = page.eval_on_selector_all("a[href]", "els => els.map(e => e.getAttribute('href'))")
    broken = _broken_internal_links(hrefs, page.url, server)
    assert not broken, f"broken internal links on {PAGES[name]}: {broken}"
    local_failures = [u for u in failed if u.startswith(server)]
    assert not local_failures, f"requests to the site that failed: {local_failures}"
    assert not errors, f"JavaScript errors: {errors}"
    if name == "guide" and (SITE / "_static" / "mathjax" / "tex-mml-chtml.js").exists():
        # the site serves MathJax itself: the page's formulas were typeset, offline
        assert page.locator("mjx-container").count() > 0, "MathJax typeset no formula"
    SHOTS.mkdir(exist_ok=True)
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
    page.close()
    if name == "gallery":  # an executed page: its output and figure are in the page
        assert images, "the gallery page has no figure"


def test_the_link_check_can_fail(tmp_path, server):
    """A link to a missing page and one to a missing anchor are both reported."""
    root = server
    broken = _broken_internal_links(["nope.html", "index.html#no-such-id", "index.html",
                                     "https://example.org/x"], root + "index.html", root)
    assert len(broken) == 2
    assert any("nope.html" in b for b in broken) and any("no-such-id" in b for b in broken)
