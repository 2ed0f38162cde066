"""The chat page at `/`: in a real headless Chromium (Debian's `chromium`, driven by Playwright)
against the real server process on loopback with a tiny model, plus the stream extension it reads
(`"mtpllm"` in each chunk), the per-request draft length, `--no-webui` and `--api-key` in process.

The tiny model never picks its control tokens nor bytes outside printable ASCII, so its answers go
on to their token limit (a long answer to stop) and render as text; it drafts for itself
(`--spec-type draft-simple` with the same file), so most of its tokens are accepted drafts.
Screenshots (desktop 1280x800, phone 390x844, light and dark) go to $MTPLLM_SCREENSHOTS or a
temporary folder."""
import json
import os
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from mtpllm.runtime.engine import Engine  # noqa: E402
from mtpllm.server import Server, create_app  # noqa: E402
from mtpllm.speculative import SpecConfig  # noqa: E402
from mtpllm.tokenizer import _bytes_to_unicode  # noqa: E402
from tiny import gpt2_vocab, make_tiny  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run", "--disable-sync"]
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
CTX = 32768
KEY = "s3cret-key"


def never_ids() -> list[int]:
    """Control tokens (end of text included) and tokens with bytes outside printable ASCII."""
    tokens, _ = gpt2_vocab()
    u2b = {u: b for b, u in _bytes_to_unicode().items()}
    return [i for i, t in enumerate(tokens)
            if i >= len(tokens) - 3 or not all(32 <= u2b[c] < 127 or u2b[c] == 10 for c in t)]


@pytest.fixture(scope="module")
def chat_model(tiny_dir):
    return make_tiny(tiny_dir / "chat.gguf", "qwen2", seed=5, nextn=1, ctx=CTX, never=never_ids())


# ---------------------------------------------------------------------------- in process
@pytest.fixture(scope="module")
def engine(chat_model):
    return Engine.load(str(chat_model), n_ctx=512)


@pytest.fixture(scope="module")
def spec_client(engine, chat_model):
    return TestClient(create_app(Server(engine, "chat.gguf", SpecConfig("draft_model", 3, draft_model=str(chat_model)))))


def _events(resp) -> list:
    assert resp.status_code == 200, resp.text
    return [json.loads(line[6:]) for line in resp.text.splitlines()
            if line.startswith("data: ") and line[6:] != "[DONE]"]


CHAT = {"messages": [{"role": "user", "content": "hello"}], "temperature": 0, "max_tokens": 40, "stream": True}


def test_stream_carries_draft_marks_and_stats(spec_client):
    ev = _events(spec_client.post("/v1/chat/completions", json=CHAT))
    chunks = [e for e in ev if "mtpllm" in e]
    flags = [f for e in chunks for f in e["mtpllm"]["draft"]]
    assert len(flags) == 40  # every token is listed once, with the chunk that carries its text
    assert all(e["mtpllm"]["accepted"] == sum(e["mtpllm"]["draft"]) for e in chunks)
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length"
    st, t = final["mtpllm"]["stats"], final["mtpllm"]["timings"]
    assert sum(flags) > 0  # a drafter identical to the target is accepted
    # the statistics also count the accepted drafts of the last step that the token limit cut off
    assert 0 <= st["num_accepted_tokens"] - sum(flags) <= 3
    assert len(st["per_position_acceptance"]) == 3 and t["predicted_n"] == 40
    # the same text as the answer without streaming
    full = spec_client.post("/v1/chat/completions", json={**CHAT, "stream": False}).json()
    assert "".join((e["choices"][0]["delta"].get("content") or "") for e in ev) == full["choices"][0]["message"]["content"]
    assert spec_client.get("/props").json()["speculative_n_max"] == 3


def test_draft_length_per_request(spec_client):
    def final(k):
        ev = _events(spec_client.post("/v1/chat/completions", json={**CHAT, "speculative": {"num_speculative_tokens": k}}))
        return ev[-1]["mtpllm"]
    assert len(final(1)["stats"]["per_position_acceptance"]) == 1
    assert len(final(2)["stats"]["per_position_acceptance"]) == 2
    plain = final(0)
    assert "stats" not in plain and plain["accepted"] == 0 and plain["timings"]["predicted_n"] == 40
    for bad in (4, -1, 1.5, "2", True, None, {"k": 1}, {"num_speculative_tokens": 1, "x": 2}):
        body = {**CHAT, "speculative": bad if isinstance(bad, dict) else {"num_speculative_tokens": bad}}
        r = spec_client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and "speculative" in r.json()["error"]["message"], (bad, r.text)


def test_page_files_headers_and_no_webui(engine):
    c = TestClient(create_app(Server(engine, "chat.gguf")))
    r = c.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe" not in csp
    js = c.get("/webui/js/app.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert c.get("/webui/vendor/dompurify/purify.es.mjs").headers["content-type"].startswith("text/javascript")
    assert c.get("/webui/../server.py").status_code == 404
    off = TestClient(create_app(Server(engine, "chat.gguf"), webui=False))
    assert off.get("/").status_code == 404 and off.get("/webui/js/app.js").status_code == 404
    assert off.get("/health").status_code == 200


def test_api_key_middleware(engine):
    c = TestClient(create_app(Server(engine, "chat.gguf"), api_key=KEY))
    for path in ("/v1/models", "/props"):
        r = c.get(path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get(path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert c.post("/v1/chat/completions", json=CHAT).status_code == 401
    # the page and the health check are public: the page asks for the key itself
    assert c.get("/").status_code == 200 and c.get("/webui/js/app.js").status_code == 200
    assert c.get("/health").status_code == 200


def test_serve_flags_are_checked(capsys, monkeypatch):
    from mtpllm.cli import main
    monkeypatch.delenv("MTPLLM_API_KEY", raising=False)
    assert main(["serve", "--api-key", " ", "--no-webui"]) == 1
    assert "--api-key must be non-empty" in capsys.readouterr().err


# ---------------------------------------------------------------------------- browser
@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM:
        pytest.skip("no chromium on this machine (Debian: apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the browser tests need playwright (pip)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(chat_model, serve_process, browser):
    return serve_process(chat_model, "--spec-type", "draft-simple", "-md", str(chat_model), ctx=CTX)


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    d = os.environ.get("MTPLLM_SCREENSHOTS")
    p = Path(d) if d else tmp_path_factory.mktemp("screenshots")
    p.mkdir(parents=True, exist_ok=True)
    return p


class Page:
    """A fresh browser context (own storage) and page, collecting script errors."""

    def __init__(self, browser, url: str, scheme: str = "light", viewport: dict = DESKTOP, allow: tuple = ()):
        self.ctx = browser.new_context(viewport=viewport, color_scheme=scheme)
        self.page = self.ctx.new_page()
        self.errors: list[str] = []
        self.allow = allow
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.on("console", self._console)
        self.response = self.page.goto(url)
        if not allow:  # the server's settings are read: the page's scripts run
            self.page.wait_for_selector("#model-name:not(:text-is('mtpllm'))", timeout=20000)

    def _console(self, msg):
        if msg.type in ("error", "warning") and not any(a in msg.text for a in self.allow):
            self.errors.append(f"console {msg.type}: {msg.text}")

    def storage(self) -> list:
        return self.page.evaluate("JSON.parse(localStorage.getItem('mtpllm.conversations') || '[]')")

    def settings(self, **kv):
        self.page.evaluate("s => localStorage.setItem('mtpllm.settings', JSON.stringify(s))", kv)

    def send(self, text: str, wait: bool = True, timeout: float = 60000):
        self.page.fill("#input", text)
        self.page.keyboard.press("Enter")
        if wait:
            self.wait_idle(timeout)

    def wait_idle(self, timeout: float = 60000):
        self.page.wait_for_selector("#send:not([hidden])", timeout=timeout)

    def close(self):
        self.ctx.close()


def _api_answer(server, text, max_tokens, timeout=60):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=timeout, json={
        "messages": [{"role": "user", "content": text}], "temperature": 0, "top_p": 0.95, "max_tokens": max_tokens})
    return r.json()["choices"][0]["message"]["content"]


def test_chat_streams_marked_tokens_and_keeps_conversations(browser, server, shots):
    p = Page(browser, server.url)
    page = p.page
    assert page.inner_text("#model-name") == "chat.gguf"
    assert "draft_model:3" in page.inner_text("#spec-label")
    # settings panel: greedy, 40 tokens
    page.click("#open-settings")
    assert "k up to 3" in page.inner_text("#k-note")
    page.fill("#set-temperature", "0")
    page.fill("#set-max-tokens", "40")
    page.click("#settings-save")
    p.send("hello")
    conv = p.storage()
    assert len(conv) == 1 and [m["role"] for m in conv[0]["messages"]] == ["user", "assistant"]
    ans = conv[0]["messages"][1]
    # the streamed chunks add up to the answer the API gives without streaming
    assert ans["content"] == _api_answer(server, "hello", 40) and ans["n"] == 40
    runs = ans["runs"]
    assert sum(runs[0::2]) == len(ans["content"]) and any(runs[1::2])
    # accepted drafts and target tokens are marked in the page; figures and chart under the answer
    assert page.locator(".msg.assistant .tk-draft").count() > 0
    assert page.locator(".msg.assistant .tk-target").count() > 0
    meta = page.inner_text(".msg.assistant .meta")
    assert "40 tokens" in meta and "tok/s" in meta and "acceptance length" in meta and "drafts accepted" in meta
    assert page.locator(".msg.assistant .chart rect.bar").count() == 3
    assert page.inner_text("#ctx-text").startswith("ctx ") and f"/ {CTX}" in page.inner_text("#ctx-text")
    page.screenshot(path=str(shots / "tiny-desktop-light.png"))
    # the colouring can be switched off and on
    tint = "getComputedStyle(document.querySelector('.tk-draft')).backgroundColor"
    assert page.evaluate(tint) != "rgba(0, 0, 0, 0)"
    page.click("#toggle-marks")
    assert page.evaluate(tint) == "rgba(0, 0, 0, 0)"
    page.click("#toggle-marks")
    assert page.evaluate(tint) != "rgba(0, 0, 0, 0)"
    # regenerate: the last answer again (greedy: the same), still one answer
    page.click("text=Regenerate")
    p.wait_idle()
    msgs = p.storage()[0]["messages"]
    assert len(msgs) == 2 and msgs[1]["content"] == ans["content"]
    # a system prompt and a shorter draft length from the settings panel
    page.click("#open-settings")
    page.fill("#set-system", "be brief")
    page.fill("#set-k", "1")
    page.click("#settings-save")
    page.click("text=Regenerate")
    p.wait_idle()
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        "temperature": 0, "top_p": 0.95, "max_tokens": 40})
    with_system = p.storage()[0]["messages"][1]["content"]
    assert with_system == r.json()["choices"][0]["message"]["content"] != ans["content"]
    assert page.locator(".msg.assistant .chart rect.bar").count() == 1
    page.click("#open-settings")
    page.fill("#set-system", "")
    page.fill("#set-k", "3")
    page.click("#settings-save")
    # edit the last user message: a new answer to the new text
    page.click("text=Edit")
    page.fill("textarea.edit", "tell me more")
    page.keyboard.press("Enter")
    p.wait_idle()
    msgs = p.storage()[0]["messages"]
    assert [m["content"] for m in msgs][:1] == ["tell me more"] and len(msgs) == 2
    assert msgs[1]["content"] == _api_answer(server, "tell me more", 40)
    # a new conversation, then reload: both are still there
    page.click("#new-chat")
    assert page.is_visible("#empty")
    p.send("second one")
    page.reload()
    page.wait_for_selector("#conversations li")
    titles = page.locator("#conversations .conv").all_inner_texts()
    assert titles == ["second one", "tell me more"]
    page.click("#conversations .conv >> text=tell me more")
    assert page.inner_text(".msg.user .body") == "tell me more"
    assert page.locator(".msg.assistant .tk-draft").count() > 0  # the marks were kept too
    assert p.errors == []
    p.close()


@pytest.mark.parametrize("how", ["Escape", "button"])
def test_stop_frees_the_server(browser, server, shots, how):
    p = Page(browser, server.url, scheme="dark")
    page = p.page
    p.settings(temperature=0, max_tokens=CTX - 100)
    page.reload()
    page.wait_for_selector("#model-name:text-is('chat.gguf')")
    p.send("count to a million", wait=False)
    page.wait_for_selector("#stop:not([hidden])")
    # stream until at least 300 tokens have come, then stop
    page.wait_for_function("""() => {
        const m = (document.querySelector('.msg.assistant .meta')?.textContent || '').match(/([0-9]+) tokens/);
        return m && Number(m[1]) >= 300;
    }""", timeout=60000)
    if how == "Escape":
        page.screenshot(path=str(shots / "tiny-desktop-dark-streaming.png"))
        page.keyboard.press("Escape")
    else:
        page.click("#stop")
    p.wait_idle(10000)
    t0 = time.monotonic()
    msg = p.storage()[0]["messages"][1]
    assert msg["status"] == "stopped" and "stopped" in page.inner_text(".msg.assistant .meta")
    # had the generation gone on, the next request would wait for its remaining tokens
    remaining_s = (CTX - 100 - msg["n"]) / msg["timings"]["predicted_per_second"]
    assert remaining_s > 10, "the tokens left are too few to tell a stopped generation from a finished one"
    try:
        assert _api_answer(server, "hi", 4, timeout=remaining_s / 2)
    except httpx.TimeoutException:
        pytest.fail("the server went on with the stopped answer: the next request waited for it")
    assert time.monotonic() - t0 < remaining_s / 2  # the server did not finish the stopped answer first
    assert p.errors == []
    p.close()


UNTRUSTED = ("Here is an image <img src=x onerror=\"window.__pwned=1\"> and a script "
             "<script>window.__pwned=2</script>\n\n<img src=y onerror=window.__pwned=3>\n\n"
             "[a link](javascript:window.__pwned=4) and `inline code`\n\n"
             "```python\ndef greet(name):\n    return f\"hello {name}\"  # <b>not bold</b>\n```\n")


def test_model_html_renders_as_text(browser, server, shots):
    p = Page(browser, server.url, scheme="dark")
    page = p.page
    csp = p.response.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "'unsafe-inline'" not in csp
    conv = [{"id": "x1", "title": "untrusted text", "created": 1, "updated": 2, "messages": [
        {"role": "user", "content": "<script>window.__pwned=5</script><img src=z onerror=window.__pwned=6>"},
        {"role": "assistant", "content": UNTRUSTED, "runs": [len(UNTRUSTED), 1], "n": 30, "accepted": 20}]}]
    page.evaluate("c => localStorage.setItem('mtpllm.conversations', JSON.stringify(c))", conv)
    page.reload()
    page.wait_for_selector(".msg.assistant .codeblock")
    text = page.inner_text("#messages")
    for s in ('<img src=x onerror="window.__pwned=1">', "<script>window.__pwned=2</script>",
              "<img src=y onerror=window.__pwned=3>", "<script>window.__pwned=5</script>", "# <b>not bold</b>"):
        assert s in text
    assert page.locator("#messages img, #messages script, #messages b").count() == 0
    assert page.locator("#messages a[href^='javascript']").count() == 0
    page.wait_for_timeout(300)
    assert page.evaluate("window.__pwned") is None
    # the code block: highlighted, with a copy button that copies the code
    assert page.locator(".codeblock code.hljs .hljs-keyword").count() > 0
    assert page.locator(".msg.assistant .tk-draft").count() > 0
    p.ctx.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url.rstrip("/"))
    page.click(".codeblock .copy")
    page.wait_for_selector(".codeblock .copy:text-is('Copied')")
    assert page.evaluate("navigator.clipboard.readText()").startswith("def greet(name):")
    page.screenshot(path=str(shots / "tiny-desktop-dark-untrusted.png"))
    # token marks follow the source through markdown: emphasis, a code span whose line break
    # became a space, a backslash escape, a code block
    src = "Say **hi** to `x\ny` now \\* star\n\n```\ncode here\n```\n"
    draft = [src.index("hi"), src.index("hi") + 1, src.index("y`"), *range(src.index("star"), src.index("star") + 4),
             *range(src.index("code"), src.index("code") + 4)]
    runs = []
    for i in range(len(src)):
        f = int(i in draft)
        if runs and runs[-1] == f:
            runs[-2] += 1
        else:
            runs += [1, f]
    got = page.evaluate("""async ([src, runs]) => {
        const m = await import('/webui/js/markdown.js');
        const el = document.createElement('div');
        m.renderMarkdown(el, src, runs);
        return [...el.querySelectorAll('.tk-draft')].map((e) => e.textContent).join('|');
    }""", [src, runs])
    assert got == "hi|y|star|code"
    assert p.errors == []
    p.close()


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_phone_width(browser, server, shots, scheme):
    p = Page(browser, server.url, scheme=scheme, viewport=PHONE)
    page = p.page
    p.settings(temperature=0, max_tokens=60)
    page.reload()
    page.wait_for_selector("#model-name:text-is('chat.gguf')")
    assert not page.locator("#sidebar").is_visible() or page.locator("#sidebar").bounding_box()["x"] < -100
    p.send("a first question")
    # Shift+Enter is a new line, Enter sends
    page.fill("#input", "line one")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("line two")
    assert page.input_value("#input") == "line one\nline two"
    page.keyboard.press("Enter")
    p.wait_idle()
    assert p.storage()[0]["messages"][2]["content"] == "line one\nline two"
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    for sel in ("#input", "#send", "#open-settings", ".msg.assistant .meta"):
        box = page.locator(sel).last.bounding_box()
        assert box and box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"], sel
    page.screenshot(path=str(shots / f"tiny-phone-{scheme}.png"))
    page.click("#open-side")
    page.wait_for_timeout(300)  # the slide-in
    assert page.locator("#sidebar").bounding_box()["x"] >= 0
    page.click("#conversations .conv")
    page.wait_for_timeout(300)
    assert page.locator("#sidebar").bounding_box()["x"] < 0
    assert p.errors == []
    p.close()


def test_api_key_flow(browser, chat_model, serve_process):
    # the model has an MTP layer: speculation, on by default, is turned off here
    s = serve_process(chat_model, "--api-key", KEY, "--spec-type", "none", ctx=512)
    try:
        # the browser logs each refused request (401) as a failed resource load
        p = Page(browser, s.url, allow=("401",))
        page = p.page
        page.wait_for_selector("#keydlg[open]")
        assert "needs an API key" in page.inner_text("#key-why")
        page.fill("#key-input", "wrong")
        page.keyboard.press("Enter")
        page.wait_for_selector("#key-why:text-is('That key was not accepted.')")
        page.fill("#key-input", KEY)
        page.click("#key-ok")
        page.wait_for_selector("#model-name:text-is('chat.gguf')")
        assert not page.is_visible("#keydlg")
        assert "no speculation" in page.inner_text("#spec-label")
        # kept for this tab's session: a reload does not ask again
        p.settings(temperature=0, max_tokens=20)
        page.reload()
        page.wait_for_selector("#model-name:text-is('chat.gguf')")
        assert not page.is_visible("#keydlg")
        p.send("hello")
        msg = p.storage()[0]["messages"][1]
        assert msg["n"] == 20 and not msg.get("error")
        # in session storage only, not in local storage; a new session asks again
        assert page.evaluate("sessionStorage.getItem('mtpllm.apiKey')") == KEY
        assert KEY not in page.evaluate("JSON.stringify(Object.assign({}, localStorage))")
        assert p.errors == []
        p.close()
        q = Page(browser, s.url, allow=("401",))
        q.page.wait_for_selector("#keydlg[open]")
        q.close()
    finally:
        s.stop()


@pytest.mark.slow
def test_real_model_page(browser, serve_process, shots):
    """The 0.5B with its MTP head: one question, an answer with accepted drafts marked."""
    s = serve_process("qwen2.5-coder-0.5b", "--spec-type", "draft-mtp", ctx=4096, threads=None, timeout=600)
    try:
        stored = None
        for scheme in ("light", "dark"):
            p = Page(browser, s.url, scheme=scheme)
            page = p.page
            if stored is None:
                p.settings(temperature=0, max_tokens=256)
                page.reload()
                page.wait_for_selector("#model-name:text-is('qwen2.5-coder-0.5b-instruct-q4_k_m.gguf')")
                p.send("Write a Python function that returns the n-th Fibonacci number.",
                       timeout=600000)
                stored = p.storage()
                msg = stored[0]["messages"][1]
                assert msg["n"] > 20 and not msg.get("error") and msg["stats"]["num_accepted_tokens"] > 0
                assert page.locator(".msg.assistant .tk-draft").count() > 0
                assert page.locator(".codeblock code.hljs").count() > 0
                assert "acceptance length" in page.inner_text(".msg.assistant .meta")
            else:
                page.evaluate("c => localStorage.setItem('mtpllm.conversations', JSON.stringify(c))", stored)
                page.reload()
                page.wait_for_selector(".msg.assistant .tk-draft")
            page.screenshot(path=str(shots / f"real-desktop-{scheme}.png"))
            page.set_viewport_size(PHONE)
            page.wait_for_timeout(400)  # the list slides out of view
            page.evaluate("document.getElementById('messages').scrollTop = 1e9")
            page.screenshot(path=str(shots / f"real-phone-{scheme}.png"))
            assert p.errors == []
            p.close()
    finally:
        s.stop()
