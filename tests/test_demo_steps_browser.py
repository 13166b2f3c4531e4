"""docs/demo.md's "What to try", step by step, in a real browser: each step, run as written,
shows what the page says it shows.

Each test reads its step from docs/demo.md: the flags it restarts the app with (`python
app.py --policy fcfs`, `--max-queue-size 8`, ...) go through the app's own command line
(`app.parse_args`, `app.config_from_args`: the demo's defaults for that policy), and the
sentences it quotes in italics are what the page must show. The app is `build_app` in
this process, in headless Debian chromium (playwright, no browser download), with two
pages where a step needs two people.

What is not as documented, to keep the module short: the model. A tiny random Llama
with SmolLM2's real tokenizer stands in for SmolLM2-135M (its words are nonsense, its
tokens real), with a floor of TICK_FLOOR_S per forward so that a tick takes about as
long as on a fast machine with the real model. The doc's seconds are the real model's
(docs/demo.md, "How long a light user waits"); these tests check what the seconds come
from: who waits behind whom, in ticks, and what the page says about it.
"""

from __future__ import annotations

import ast
import re
import socket
import time
from pathlib import Path

import pytest

from minserve.chat.logic import NOISY_SESSION

from .conftest import CHROMIUM

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "demo.md"
TICK_FLOOR_S = 0.01  # each forward of the stand-in model takes at least this long
PROJECTOR = {"width": 1280, "height": 720}
MIN_CARD_FONT_PX = 12  # legible from the back of a room at 1280x720
MIN_TITLE_PX = 14  # a figure's subplot titles, at 1280x720

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(),
                                reason="needs Debian's chromium at /usr/bin/chromium: "
                                       "`sudo apt-get install -y chromium` (no browser download)")


# ------------------------------------------------------------------ the doc's steps
def step(n: int) -> str:
    """The text of step `n` of docs/demo.md's "What to try" (one paragraph of the list)."""
    text = DOC.read_text(encoding="utf-8").split("## What to try", 1)[1].split("\n## ", 1)[0]
    items = re.split(r"\n(?=\d+\. \*\*)", "\n" + text)
    found = [i for i in items if i.startswith(f"{n}. **")]
    assert found, f"docs/demo.md has no step {n} under 'What to try'"
    return " ".join(found[0].split())


def flags(n: int) -> dict[str, str]:
    """The flags step `n` restarts the app with, from its code spans: `--policy fcfs` ->
    {"--policy": "fcfs"} (also inside `python app.py --policy fcfs`)."""
    out = {}
    for span in re.findall(r"`([^`]*--[^`]*)`", step(n)):
        out.update(re.findall(r"(--[a-z-]+)[ =]([^\s-][^\s]*)", span))
    return out


def quoted(n: int) -> list[str]:
    """The sentences step `n` quotes as what the page says: *"..."* or *...*."""
    return [q.strip('"') for q in re.findall(r"\*(\"[^*]+\"|[^*\s][^*]*[^*\s])\*", step(n))]


def pattern(quote: str) -> re.Pattern:
    """A quote of the doc as a regex: its '…' stands for what the run decides (a number)."""
    parts = [r"\s+".join(map(re.escape, p.split())) for p in quote.split("…")]
    return re.compile(r"\s*\S+?\s*".join(parts))


# ------------------------------------------------------------------ the app, the browser
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stand_in():
    """(model, tokenizer): a tiny random Llama over SmolLM2's vocabulary, each forward at
    least TICK_FLOOR_S long, and SmolLM2's real tokenizer (its chat template)."""
    import torch
    from transformers import AutoTokenizer

    from minserve.models import embedded_model_dir, tiny_llama

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the worker, Gradio and chromium share two cores
    model = tiny_llama(vocab_size=49152)
    model.register_forward_pre_hook(lambda mod, args: time.sleep(TICK_FLOOR_S))
    yield model, AutoTokenizer.from_pretrained(embedded_model_dir())
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def apps(stand_in):
    """apps(step flags) -> (url, engine, chat app): `python app.py FLAGS` as the doc says,
    on the stand-in model; one launch per set of flags, closed at the end of the module."""
    import app as chat_demo
    from minserve import Engine

    launched: dict[tuple, tuple] = {}

    def _app(given: dict[str, str]):
        key = tuple(sorted(given.items()))
        if key not in launched:
            argv = [x for kv in key for x in kv]
            config, _, _ = chat_demo.config_from_args(chat_demo.parse_args(argv), env={})
            engine = Engine(config.replace(device="cpu"), model=stand_in[0], tokenizer=stand_in[1])
            demo = chat_demo.build_app(engine)
            port = free_port()
            chat_demo.launch(demo, "127.0.0.1", port, prevent_thread_lock=True, quiet=True)
            launched[key] = (f"http://127.0.0.1:{port}/", engine, demo)
        url, engine, demo = launched[key]
        return url, engine, demo.chat_app

    yield _app
    for _, _, demo in launched.values():
        demo.chat_app.close()
        demo.close()


def open_page(browser, url: str, viewport=None):
    page = browser.new_page(viewport=viewport or {"width": 1440, "height": 1000})
    page.goto(url)
    page.wait_for_selector("#msg textarea")
    page.wait_for_function("document.querySelector('#summary').innerText.includes('tick')")
    return page


def number(page, label: str, value) -> None:
    """Set a slider by typing into its number box (the label the page shows)."""
    box = page.get_by_label(label).first
    box.fill(str(value))
    box.press("Tab")


def send(page, text: str) -> None:
    page.fill("#msg textarea", text)
    page.press("#msg textarea", "Enter")


def bubble(page) -> str:
    rows = page.locator("#chat .bot-row")
    return rows.last.inner_text().strip() if rows.count() else ""


def status(page) -> str:
    return page.locator("#status").inner_text().strip()


def wait_until(cond, timeout: float = 30.0, every: float = 0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(every)
    return cond()


def request_id(page) -> str:
    rid = wait_until(lambda: re.search(r"\breq-\d+\b", status(page)), 30)
    assert rid, status(page)
    return rid.group(0)


def ticks_seen_to_admitted(engine, rid: str) -> tuple[int, int, list]:
    """(first tick the request was in a queue or admitted, its admission tick, records)."""
    ticks = engine.trace.ticks()
    seen = next(t.tick for t in ticks if any(rid in t.queues.get(q, []) for q in
                                             ("pending", "prefilling", "active"))
                or any(a["request_id"] == rid for a in t.admit.admitted))
    admitted = next(t.tick for t in ticks if any(a["request_id"] == rid for a in t.admit.admitted))
    return seen, admitted, ticks


def start_flood(page, engine, **sliders) -> None:
    for label, value in sliders.items():
        number(page, label, value)
    page.get_by_role("button", name="Start flood").click()
    page.wait_for_function("document.querySelector('#flood').innerText.includes('flooding')")
    assert wait_until(lambda: engine.stats()["queues"]["pending"] >= 8, 30), engine.stats()


def stop_flood(page, engine) -> None:
    page.get_by_role("button", name="Stop flood").click()
    assert wait_until(engine.scheduler.is_drained, 30), engine.stats()


def sessions_table(page) -> list[list[str]]:
    """The sessions table as the page shows it: a list of cells per row, header left out."""
    return page.evaluate("""() => [...document.querySelectorAll('#sessions [role=row]')]
        .map(r => [...r.querySelectorAll('[role=gridcell]')].map(c => c.innerText.trim()))
        .filter(r => r.length > 1)""")


def table_row(page, session: str) -> list[str] | None:
    return next((r for r in sessions_table(page) if r and r[0] == session), None)


def refusal_counts(page) -> dict:
    """The refusals the page shows, read in one go (no update can land in between): the
    table's column per session, the summary's total over its gates, the flood's line."""
    got = page.evaluate("""() => ({
        rows: [...document.querySelectorAll('#sessions [role=row]')]
            .map(r => [...r.querySelectorAll('[role=gridcell]')].map(c => c.innerText.trim()))
            .filter(r => r.length),
        summary: document.querySelector('#summary').innerText,
        flood: document.querySelector('#flood').innerText})""")
    refused = re.search(r"refused: ([^·\n]*)", got["summary"])[1]
    return {"table": {r[0].removesuffix(" (you)"): int(r[5]) for r in got["rows"]},
            "summary": sum(int(n) for n in re.findall(r"G\d (\d+)", refused)),
            "flood": int(re.search(r"refused (\d+)", got["flood"])[1])}


def svg_lines(page) -> list[str]:
    """The visible plot's annotations, each as one line of text (its lines joined)."""
    return page.evaluate("""() => {
        const plot = [...document.querySelectorAll('.tabs .js-plotly-plot')]
            .find(p => p.offsetParent !== null);
        if (!plot) return [];
        return [...plot.querySelectorAll('.annotation text')].map(t => {
            const lines = [...t.querySelectorAll('tspan.line')];
            return (lines.length ? lines.map(s => s.textContent) : [t.textContent]).join(' ');
        });
    }""")


# ------------------------------------------------------------------ step by step
WATCH_REPLY = """() => {  // every length the reply bubble shows, as the browser draws it
    window.replyLengths = [];
    new MutationObserver(() => {
        const rows = document.querySelectorAll('#chat .bot-row');
        const text = rows.length ? rows[rows.length - 1].innerText.trim() : '';
        const seen = window.replyLengths;
        if (text && text !== '…' && !text.startsWith('○')
                && seen[seen.length - 1] !== text.length) seen.push(text.length);
    }).observe(document.querySelector('#chat'),
               {subtree: true, childList: true, characterData: true});
}"""


def test_step_1_a_reply_streams_and_an_enter_while_it_streams_keeps_your_text(apps, browser):
    url, engine, _ = apps({})
    page = open_page(browser, url)
    number(page, "max tokens", 256)  # "the sliders are yours alone: each request carries its own"
    page.evaluate(WATCH_REPLY)
    send(page, "Tell me about Paris.")
    page.wait_for_function("window.replyLengths.length >= 1", timeout=30_000)
    box = page.locator("#msg textarea")
    box.press_sequentially("and Rome?")  # "you can type your next message while a reply streams"
    box.press("Enter")  # ... one reply at a time: refused, and the text stays in the box
    page.wait_for_function("document.querySelector('#status').innerText"
                           ".includes('still streaming')", timeout=15_000)
    assert box.input_value() == "and Rome?" and page.locator("#chat .user-row").count() == 1
    page.wait_for_function("document.querySelector('#status').innerText.includes('tokens in')",
                           timeout=60_000)
    lengths = page.evaluate("window.replyLengths")
    assert len(lengths) >= 3 and lengths == sorted(lengths), f"did not stream in: {lengths}"
    assert box.input_value() == "and Rome?", "the box lost the text"
    # "the line under the chat says when your first token came and how long the reply took"
    assert re.search(r"first token after \d+\.\d\d s · 256 tokens in \d+\.\d s", status(page)), \
        status(page)
    box.press("Enter")  # "press Enter again when the reply ends"
    page.wait_for_function("document.querySelectorAll('#chat .user-row').length == 2")
    assert box.input_value() == ""
    page.get_by_role("button", name="Stop", exact=True).click()
    assert wait_until(engine.scheduler.is_drained, 30)
    page.close()


def test_step_2_two_tabs_are_two_sessions_in_one_decode_batch(apps, browser):
    url, engine, _ = apps({})
    pages = [open_page(browser, url) for _ in range(2)]
    for page in pages:
        number(page, "max tokens", 128)
    for i, page in enumerate(pages):
        send(page, f"Hello, I am user {i}")
    rids = [request_id(p) for p in pages]
    for page in pages:
        page.wait_for_function("document.querySelector('#status').innerText.includes('tokens in')",
                               timeout=60_000)
    tables = []
    for page in pages:  # each tab's own row is marked (you); both sessions are listed
        page.wait_for_function("document.querySelector('#sessions').innerText.includes('(you)')"
                               " && document.querySelector('#sessions').innerText"
                               ".split('user-').length > 2", timeout=15_000)
        tables.append(page.locator("#sessions").inner_text())
    mine = [re.search(r"(user-\w+) \(you\)", t).group(1) for t in tables]
    assert mine[0] != mine[1], tables
    ticks = engine.trace.ticks()
    both = [t.tick for t in ticks if set(rids) <= set(t.decode.rows)]
    assert both, "the two chats never decoded in the same batch"
    for page in pages:
        page.close()
    assert wait_until(engine.scheduler.is_drained, 30)


def test_step_3_under_fair_your_chat_takes_a_row_the_flood_may_not(apps, browser):
    url, engine, chat_app = apps(flags(3))
    cap = engine.config.max_rows_per_session
    assert engine.config.policy == "fair" and cap == 6 and engine.config.max_batch_size == 8, \
        "docs/demo.md step 3 says: fair, 6 of the 8 rows"
    held_card = next(q for q in quoted(3) if "rows" in q)  # *its session has 6/6 rows*
    page = open_page(browser, url)
    number(page, "max tokens", 16)  # a short reply: the step is about its first token
    start_flood(page, engine)  # the page's default flood
    assert wait_until(lambda: any(held_card in line for line in svg_lines(page)), 20), \
        (held_card, svg_lines(page))
    send(page, "Hello")
    rid = request_id(page)
    page.wait_for_function("document.querySelector('#status').innerText.includes('tokens in')",
                           timeout=60_000)
    seen, admitted, ticks = ticks_seen_to_admitted(engine, rid)
    assert admitted - seen <= 1, f"the chat waited {admitted - seen} ticks for a row"
    flood_rows = [sum(r != rid for q in ("prefilling", "active") for r in t.queues.get(q, []))
                  for t in ticks]
    assert max(flood_rows) == cap, f"the flood held {max(flood_rows)} rows; its cap is {cap}"
    # VTC: the flood's counter climbs, yours stays low but did not start at 0 (P4's lift)
    def both_rows():
        rows = [r for r in sessions_table(page) if "(you)" in r[0] or r[0] == NOISY_SESSION]
        return rows if len(rows) == 2 else None

    rows = wait_until(both_rows, 10)
    assert rows, sessions_table(page)
    counters = {("you" if "(you)" in r[0] else "noisy"): float(r[-1]) for r in rows}
    assert 0 < counters["you"] < counters["noisy"], rows
    page.get_by_role("tab", name="Fairness").click()
    page.locator(".tabs .js-plotly-plot:visible .main-svg").first.wait_for(timeout=15_000)
    stop_flood(page, engine)
    page.close()


def test_step_4_under_fcfs_the_flood_holds_every_row_and_the_chat_is_told_so(apps, browser):
    given = flags(4)
    assert given == {"--policy": "fcfs"}, given
    url, engine, _ = apps(given)
    assert engine.config.max_rows_per_session is None, "under fcfs the demo caps no session"
    said = next(q for q in quoted(4) if "batch is full" in q)
    page = open_page(browser, url)
    number(page, "max tokens", 16)  # a short reply: the step is about its first token
    # "do the same": the flood, then chat; its replies shortened from 128 to 64 tokens
    # (the chat still waits dozens of ticks behind the 16 that came first)
    start_flood(page, engine, **{"longest reply": 64})
    send(page, "Hello")
    rid = request_id(page)
    waiting = wait_until(lambda: bubble(page) if "batch is full" in bubble(page) else None, 20)
    assert waiting and pattern(said).search(waiting), (said, bubble(page))
    assert "cap" not in waiting, waiting
    page.wait_for_function("document.querySelector('#status').innerText.includes('tokens in')",
                           timeout=90_000)
    seen, admitted, ticks = ticks_seen_to_admitted(engine, rid)
    seq = int(rid.split("-")[1])
    at = next(t for t in ticks if t.tick == admitted)
    assert not [r for r in at.queues["pending"] if int(r.split("-")[1]) < seq], \
        "under fcfs every flood request that arrived first goes first"
    waited = [t for t in ticks if seen <= t.tick < admitted]
    assert len(waited) >= 20, f"the chat waited only {len(waited)} ticks"
    # every row the flood's: after each tick's evictions, the rows left and those that
    # left make the whole batch (the next tick's T1 refills them from the backlog)
    for t in waited[1:]:
        rows = t.queues["prefilling"] + t.queues["active"]
        assert len(rows) + len(t.evict.evicted) == 8, (t.tick, rows, t.evict.evicted)
        assert {t.requests[r]["session"] for r in rows} == {NOISY_SESSION}, t.tick
    stop_flood(page, engine)
    page.close()


def test_step_5_a_full_queue_and_a_message_that_can_never_fit_say_so(apps, browser):
    given = flags(5)
    g1, g2 = (next(q for q in quoted(5) if gate in q) for gate in ("(G1", "(G2)"))
    from minserve.chat.logic import NOTICE

    url, engine, _ = apps({"--max-queue-size": given["--max-queue-size"]})
    page = open_page(browser, url)
    start_flood(page, engine, **{"in flight": 16})
    # A message that is let in is answered in a few tokens: the step is about the refusal, and
    # one let in at 128 tokens behind the flood can take a minute on a busy machine (a CI run
    # timed out waiting 60 s for one of these messages to end).
    number(page, "max tokens", 8)
    said, last = [], None
    for _ in range(5):  # "usually": the flood's refused requests back off for a moment
        send(page, "Are you there?")
        # this message's own end: a request id other than the last message's, refused or done
        end = wait_until(lambda last=last: (m := re.search(r"\b(req-\d+)\b.*(refused|tokens in)",
                                                           status(page))) and m[1] != last and m,
                         90)
        assert end, (status(page), bubble(page), engine.stats())
        last = end[1]
        said.append(bubble(page))
        if said[-1].startswith(NOTICE.strip()):
            break
    assert said[-1] == NOTICE + g1, (g1, said)
    # the tab whose requests were all refused is in the table, with its refusals; and at
    # one moment the table, the summary and the flood's line give one refusal count
    me = re.search(r"(user-\w+)", status(page))[1]
    assert wait_until(lambda: (row := table_row(page, me + " (you)")) and int(row[5]) >= 1, 15), \
        sessions_table(page)
    counts = refusal_counts(page)
    assert counts["summary"] == sum(counts["table"].values()) > 0, counts
    assert counts["flood"] == counts["table"][NOISY_SESSION], counts
    stop_flood(page, engine)
    page.close()

    url, engine, _ = apps({"--kv-budget-tokens": given["--kv-budget-tokens"]})
    page = open_page(browser, url)
    number(page, "max tokens", 512)
    send(page, "Hello")
    page.wait_for_function("document.querySelector('#status').innerText.includes('refused')",
                           timeout=30_000)
    text = bubble(page)
    assert text.startswith(NOTICE.strip()) and pattern(g2).search(text), (g2, text)
    assert "Try again" not in text
    page.close()


def test_step_6_stop_ends_your_reply_and_a_closed_tab_leaves_the_table(apps, browser):
    url, engine, chat_app = apps({})
    page, other = open_page(browser, url), open_page(browser, url)
    number(page, "max tokens", 512)
    send(page, "Tell me a long story")
    assert wait_until(lambda: "streaming" in status(page), 30), status(page)
    page.get_by_role("button", name="Stop", exact=True).click()
    page.wait_for_function("document.querySelector('#status').innerText.trim().endsWith('stopped')",
                           timeout=15_000)
    assert bubble(page).endswith("■ stopped"), bubble(page)
    assert wait_until(engine.scheduler.is_drained, 15), "Stop left the request's KV held"

    send(page, "Tell me another long story")  # ... and close the tab mid-reply (H3)
    assert wait_until(lambda: "streaming" in status(page), 30), status(page)
    mine = wait_until(lambda: re.search(r"(user-\w+) \(you\)",
                                        page.locator("#sessions").inner_text()), 10)
    assert mine, page.locator("#sessions").inner_text()
    session = mine.group(1)
    assert wait_until(lambda: session in other.locator("#sessions").inner_text(), 10)
    page.close()
    assert wait_until(engine.scheduler.is_drained, 30), "a closed tab's reply kept running"
    assert wait_until(lambda: session not in other.locator("#sessions").inner_text(), 15), \
        other.locator("#sessions").inner_text()
    other.close()


def test_step_7_the_panel_shows_the_stats_three_figures_and_what_the_ids_mean(apps, browser):
    import app as chat_demo
    from minserve import SamplingParams

    url, engine, _ = apps({})
    engine.submit("Hi", SamplingParams(max_tokens=8)).result(60)  # ticks for the panel to draw
    page = open_page(browser, url)
    summary = page.locator("#summary").inner_text()
    for word in ("tick", "pending", "KV pressure", "reserved", "(R1)", "gate holds", "refused"):
        assert word in summary, (word, summary)
    for tab in chat_demo.PANEL_FIGURES:
        page.get_by_role("tab", name=tab).click()
        page.locator(".tabs .js-plotly-plot:visible .main-svg").first.wait_for(timeout=15_000)
    page.get_by_text("What the ids mean").click()
    legend = page.locator("#legend").inner_text()
    for rid in chat_demo.PAGE_IDS:
        assert re.search(rf"\b{rid}\b \w+", legend), (rid, legend)
    page.close()


# ------------------------------------------------------------------ readable on a projector
def test_queue_cards_at_1280x720_keep_their_text_inside_and_large(apps, browser, tmp_path):
    """The Queues tab on a projector: every line of a card's text inside the card, at
    least MIN_CARD_FONT_PX (it was 9 px, and 'prompt 45 (16 cached)' ran past its card);
    the first screen, unscrolled, shows the first two cards of each queue (they were below
    the sessions table, off the screen); the Fairness tab's subplot titles are at least
    MIN_TITLE_PX and inside their figure (they were 11 px)."""
    import os

    url, engine, _ = apps({})
    page = open_page(browser, url, PROJECTOR)
    start_flood(page, engine)
    page.get_by_role("tab", name="Queues").click()
    assert wait_until(lambda: sum("noisy" in line for line in svg_lines(page)) >= 7, 20), \
        svg_lines(page)
    found = page.evaluate("""() => {
        const plot = [...document.querySelectorAll('.tabs .js-plotly-plot')]
            .find(p => p.offsetParent !== null);
        const box = r => [r.left, r.top, r.right, r.bottom];
        const cards = [...plot.querySelectorAll('.shapelayer path')]
            .map(p => box(p.getBoundingClientRect())).filter(b => b[2] - b[0] > 40);
        const texts = [...plot.querySelectorAll('.annotation text')].map(t => ({
            text: t.textContent, box: box(t.getBoundingClientRect()),
            px: parseFloat(getComputedStyle(t).fontSize)}));
        return {cards, texts};
    }""")
    img = Path(os.environ.get("MINSERVE_SCREENSHOT_DIR") or tmp_path)  # make screenshots
    img.mkdir(parents=True, exist_ok=True)
    page.locator(".tabs").first.screenshot(path=str(tmp_path / "app_queues_1280.png"))
    first = page.evaluate("""async () => {
        window.scrollTo(0, 0);
        await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
        const plot = [...document.querySelectorAll('.tabs .js-plotly-plot')]
            .find(p => p.offsetParent !== null);
        const boxes = [...plot.querySelectorAll('.shapelayer path')]
            .map(p => p.getBoundingClientRect()).filter(b => b.width > 40 && b.height > 40);
        return {scrolled: window.scrollY, height: window.innerHeight,
                cards: boxes.map(b => [Math.round(b.left), Math.round(b.top),
                                       Math.round(b.bottom)])};
    }""")
    page.screenshot(path=str(img / "app_first_screen_1280.png"))
    page.get_by_role("tab", name="Fairness").click()
    assert wait_until(lambda: any("VTC counter" in line for line in svg_lines(page)), 20)
    titles = page.evaluate("""() => {
        const plot = [...document.querySelectorAll('.tabs .js-plotly-plot')]
            .find(p => p.offsetParent !== null);
        const outer = plot.getBoundingClientRect();
        return [...plot.querySelectorAll('.annotation text')].map(t => {
            const b = t.getBoundingClientRect();
            return {text: t.textContent, px: parseFloat(getComputedStyle(t).fontSize),
                    inside: b.left >= outer.left - 1 && b.right <= outer.right + 1};
        });
    }""")
    page.locator(".tabs").first.screenshot(path=str(tmp_path / "app_fairness_1280.png"))
    stop_flood(page, engine)
    page.close()
    # two cards of each queue the flood fills (pending, active) wholly on the first screen
    columns: dict[int, list] = {}
    for left, top, bottom in first["cards"]:
        columns.setdefault(left, []).append((top, bottom))
    assert first["scrolled"] == 0 and len(columns) >= 2, first
    for left, cards in columns.items():
        on_screen = [c for c in sorted(set(cards)) if 0 <= c[0] and c[1] <= first["height"]]
        assert len(on_screen) >= 2, (left, sorted(set(cards)), first["height"])
    subplot = [t for t in titles if t["text"].startswith(("service received", "VTC counter",
                                                          "requests waiting"))]
    assert len(subplot) >= 2, titles
    assert all(t["px"] >= MIN_TITLE_PX and t["inside"] for t in subplot), subplot
    card_texts = [t for t in found["texts"] if "req-" in t["text"]]
    assert len(card_texts) >= 7, found["texts"]
    small = [(t["text"], t["px"]) for t in found["texts"] if t["px"] < MIN_CARD_FONT_PX]
    assert not small, f"text under {MIN_CARD_FONT_PX} px: {small}"

    def inside(t, c):
        return (c[0] - 1 <= t[0] and t[2] <= c[2] + 1 and c[1] - 1 <= t[1] and t[3] <= c[3] + 1)

    spilled = [t["text"] for t in card_texts
               if not any(inside(t["box"], c) for c in found["cards"])]
    assert not spilled, f"card text outside its card: {spilled}"


# ------------------------------------------------------------------ glyphs that draw
def page_marks() -> set[str]:
    """Every non-ASCII character in a string the page can show: the string constants of
    app.py and minserve/chat/ (docstrings left out)."""
    chars = set()
    for path in [ROOT / "app.py", *sorted((ROOT / "minserve" / "chat").glob("*.py"))]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and n.body and isinstance(n.body[0], ast.Expr)
                and isinstance(n.body[0].value, ast.Constant)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
                chars |= {c for c in n.value if ord(c) > 127 and c != "\ufe0f"}
    return chars


def test_every_mark_the_page_shows_is_a_glyph_this_browser_draws(browser):
    """Debian's chromium has no emoji font: ⚠️, ⏳ and ✋ came out as empty boxes. Each
    character is drawn in the page's font (app.THEME's stack, what Gradio sets on the
    page) on a canvas and compared with characters no font has (private use): a missing
    glyph draws as they do, or draws nothing."""
    import app as chat_demo

    marks = sorted(page_marks())
    assert {"‼", "○", "■"} <= set(marks), marks  # NOTICE, WAITING, STOPPED
    page = browser.new_page()
    page.set_content(f'<div id="chat" style="font-family: {chat_demo.THEME.font}">x</div>')
    missing = page.evaluate("""(marks) => {
        const font = '24px ' + getComputedStyle(document.querySelector('#chat')).fontFamily;
        const draw = ch => {
            const c = document.createElement('canvas'); c.width = c.height = 40;
            const g = c.getContext('2d'); g.font = font; g.fillStyle = '#000';
            g.fillText(ch, 4, 30);
            return Array.from(g.getImageData(0, 0, 40, 40).data).join(',');
        };
        const none = ['\\uE000', '\\uF8FF', '\\u{10FFFD}'].map(draw);
        const blank = draw(' ');
        return marks.filter(ch => { const d = draw(ch); return d === blank || none.includes(d); });
    }""", marks)
    page.close()
    assert not missing, f"drawn as a missing glyph here: {missing}"
