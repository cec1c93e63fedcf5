"""`trainjob replay LOG -o run.html`: the frames the page steps through, the page's safety with
hostile logs, the committed walkthrough page, and the page itself in a real headless Chromium."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, trainjob
from trainjob.views import replay_page
from trainjob.views.history import replay

IN_CI = bool(os.environ.get("CI"))  # CI installs everything: there a missing tool fails, never skips
needs_dot = pytest.mark.skipif(not (shutil.which("dot") and importlib.util.find_spec("graphviz") or IN_CI),
                               reason="Graphviz's dot (and the graphviz package) not installed")
PATH_LINE = re.compile(r"line +(\d+)  (\w+) -> (\w+) +(\w+) \| (.*)")
STEADY = "2026-11-30T10:03:24Z"


def line(event: str, detail: str, **extra: str) -> str:
    return json.dumps({"ts": STEADY, "event": event, "detail": detail, **extra}) + "\n"


def path_states(log: Path) -> dict[int, tuple[str, str]]:
    """What `status --path` derives for each line: the transition it belongs to."""
    result = trainjob("status", log, "--path")
    return {int(m[1]): (m[2], m[3]) for m in map(PATH_LINE.fullmatch, result.stdout.splitlines()) if m}


def page_data(html: bytes) -> dict:
    """The frames as the page's script reads them: the JSON between its script tags."""
    text = html.decode()
    found = re.search(r'<script type="application/json" id="replay-data">(.*?)</script>', text, re.S)
    return json.loads(found[1])


@pytest.fixture(scope="module")
def backoff_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two attempts the gate refuses, then a start with the budget spent (--backoff-limit 1)."""
    pvc = tmp_path_factory.mktemp("backoff") / "pvc"
    for _ in range(3):
        assert trainjob("run", "--pvc", pvc, "--force-weights", "0,0,0", "--backoff-limit", 1).returncode == 1
    return pvc / "log.jsonl"


@pytest.fixture(scope="module")
def every_kind_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real job that meets every kind of line: a kill, leftovers cleaned up, a corrupt checkpoint
    rejected, a second kill, a reshard, a W=2 resume to completion; plus a supervisor's lines, a
    SIGTERM's kill line in a later process, and a line torn by a crash."""
    work = tmp_path_factory.mktemp("every_kind")
    pvc = work / "pvc"
    assert trainjob("run", "--pvc", pvc, "--die-at", 4, "--steps", 8).returncode == 75
    shard = next((pvc / "checkpoints" / "step-00000004-a0001-w001").glob("*.safetensors"))
    with open(shard, "r+b") as f:  # damage the newest checkpoint: the resume must reject it
        f.seek(100)
        f.write(b"X")
    (pvc / "checkpoints" / ".tmp-left-by-a-killed-writer").mkdir()
    assert trainjob("run", "--pvc", pvc, "--die-at", 6).returncode == 75
    assert trainjob("reshard", "--pvc", pvc, "--world-size", 2).returncode == 0
    assert trainjob("run", "--pvc", pvc, "--world-size", 2).returncode == 0
    lines = (pvc / "log.jsonl").read_text().splitlines(keepends=True)
    log = work / "every_kind.jsonl"
    log.write_text("".join([
        *lines[:4], line("relaunch", "start 2 after exit 75", source="supervisor"), *lines[4:],
        '{"ts":"2026-11-30T10:03:24Z","event":"job_sta\n',  # torn by a crash
        line("stop", "exit 0: completed", source="supervisor")]))
    return log


def build(log: Path) -> bytes:
    """The page as `trainjob replay` writes it, without drawing the machine (the frames are the point)."""
    return replay_page.build(replay(log), (ROOT / "diagrams" / "machine.svg").read_bytes())


# --- the frames: what the page says at each line ------------------------------------------------------

@pytest.mark.process
def test_every_line_highlights_the_state_and_edge_status_path_derives(walkthrough_log, backoff_log):
    for log in (walkthrough_log, backoff_log):
        frames = page_data(build(log))["frames"]
        derived = path_states(log)
        assert [f["line"] for f in frames] == list(derived)
        assert [(f["state"], tuple(f["edge"])) for f in frames] == [(dest, (source, dest))
                                                                   for source, dest in derived.values()]


@pytest.mark.process
def test_resume_says_the_kill_kept_the_attempt_number(walkthrough_log):
    frames = {f["line"]: f for f in page_data(build(walkthrough_log))["frames"]}
    assert frames[5]["why"] == ["Attempt in flight: the last process was killed at step 4 (line 4), so the attempt "
                                "keeps its number (1) and training continues from the step-4 checkpoint."]
    assert frames[5]["headline"] == "resumed: pending → resumed, by start [attempt in flight]"
    assert dict(frames[3]["pvc"])["newest checkpoint"] == "step 4, loss_milli 241 (attempt 1)"
    assert "loss_milli 228 (was 241 at step 4)" in frames[6]["why"][1]
    sha = dict(frames[10]["pvc"])["artifact"]
    assert sha.startswith("artifacts/model-v1.json\nsha256 983aeb4b") and sha.endswith("ad5f")


@pytest.mark.process
def test_a_spent_budget_names_the_counts_and_the_gate_its_arithmetic(backoff_log):
    frames = {f["line"]: f for f in page_data(build(backoff_log))["frames"]}
    assert [frames[n]["event"] for n in (7, 8, 14, 15)] == ["drift_failed", "job_started", "drift_failed", "job_failed"]
    assert frames[15]["why"][0] == ("No attempt in flight (the last attempt ended in drift_failed (line 14)), "
                                    "and attempts 2 > backoff limit 1: job_failed.")
    assert frames[14]["why"][0].startswith("The drift gate said no: 14*100 = 1400 < 20*(100-20) = 1600")
    assert "the last attempt ended in drift_failed (line 7)" in frames[8]["why"][0]
    assert "attempts so far 1 <= backoff limit" in frames[8]["why"][1]
    assert dict(frames[15]["pvc"])["attempts counter"] == "2"


@pytest.mark.process
@pytest.mark.torchrun
def test_every_kind_of_line_renders(every_kind_log):
    frames = page_data(build(every_kind_log))["frames"]
    kinds = {f["line"]: f["kind"] for f in frames}
    last = len(every_kind_log.read_text().splitlines())
    assert list(kinds) == list(range(1, last + 1))
    assert {n: kind for n, kind in kinds.items() if kind != "step"} == {5: "aside", last - 1: "skipped", last: "aside"}
    by_event = {f["event"]: f for f in frames}
    assert tuple(by_event["cleaned_up"]["edge"]) == ("pending", "resumed")  # named by the resume after it
    # The byte the fixture damages sits in the shard's header, which since manifest schema 3 also says where
    # each slice sits: the refusal names the shard, whichever of its header's checks the byte breaks.
    rejected = by_event["checkpoint_rejected"]["why"][0]
    assert "failed verification (checkpoints/step-00000004-a0001-w001: shard-00000-of-00001.safetensors: " in rejected
    assert "The run's own state stays killed" in by_event["resharded"]["why"][1]
    assert by_event["resharded"]["state"] == "resharded"
    held = dict(frames[-1]["pvc"])
    assert held["set aside"].endswith("-> checkpoints/rejected-step-00000004-a0001-w001")
    assert held["resharded copy"] == "step 6 for 2 rank(s): checkpoints/step-00000006-a0001-w002"
    assert held["machine state"] == "completed"
    assert frames[4]["why"] == ["Written by trainjob supervisor, not by the machine: no step, and the state stays "
                                "killed."]


def test_a_sigterm_kill_and_a_silent_death_are_told_apart(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text("".join([line("job_started", "steps=10 attempt=1"), line("checkpointed", "step=2 loss_milli=310"),
                            line("killed", "at_step=3 signal=SIGTERM"), line("resumed", "from_step=2"),
                            line("checkpointed", "step=4 loss_milli=241"), line("resumed", "from_step=4")]))
    frames = page_data(build(log))["frames"]
    assert frames[2]["why"][0] == "The process stopped after step 3 because a SIGTERM asked it to: exit 75."
    assert "killed by SIGTERM at step 3 (line 3)" in frames[3]["why"][0]
    assert "the last process logged checkpointed (line 5) and then stopped without a word" in frames[5]["why"][0]


@pytest.mark.process
def test_an_illegal_log_is_shown_up_to_its_first_illegal_line_marked(tmp_path, walkthrough_log):
    log = tmp_path / "spliced.jsonl"
    log.write_text("".join(walkthrough_log.read_text().splitlines(keepends=True)[:4]) * 2)
    frames = page_data(build(log))["frames"]
    assert [f["kind"] for f in frames] == ["step"] * 4 + ["illegal"]
    assert frames[-1]["event"] == "job_started" and frames[-1]["state"] == "killed"
    assert "line 5: illegal step from killed: job_started" in frames[-1]["why"][0]


HOSTILE = ('</script><script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'
           '<!-- \u2028\u2029 \x07\x1b[31m & "quoted" \ud800')


def hostile_log(where: Path) -> Path:
    # The long line stays under the log reader's per-line bound (eventlog.MAX_LINE, 64 KiB; a longer
    # one is skipped unread), so the page's own cut of long lines is what is tested here.
    log = where / "hostile.jsonl"
    log.write_text("".join([line("job_started", f"steps=10 attempt=1 {HOSTILE}"),
                            line("checkpointed", "step=2 loss_milli=310 " + "x" * 60_000),
                            f"{HOSTILE}\n", line("killed", HOSTILE, source=HOSTILE)]), errors="surrogatepass")
    return log


def test_hostile_text_reaches_the_page_only_as_escaped_json(tmp_path):
    html = build(hostile_log(tmp_path))
    assert html.count(b"</script>") == 2 and html.count(b"<script") == 2  # the page's own two
    data = re.search(rb'id="replay-data">(.*?)</script>', html, re.S)[1]
    assert data.isascii() and not set(data) & set(b"<>&")
    assert b"<img" not in html and b"pwned" not in html.replace(data, b"")
    frames = page_data(html)["frames"]
    assert frames[0]["raw"] == line("job_started", f"steps=10 attempt=1 {HOSTILE}").strip().encode(
        "utf-8", "surrogatepass").decode("utf-8", "replace")
    cut = len(line("checkpointed", "step=2 loss_milli=310 " + "x" * 60_000).strip()) - replay_page.SHOWN_CHARS
    assert frames[1]["raw"].endswith(f"x … ({cut} more characters not shown)")
    assert len(html) < 100_000
    assert [f["kind"] for f in frames] == ["step", "step", "skipped", "aside"]


# --- the command --------------------------------------------------------------------------------------

@needs_dot
@pytest.mark.process
def test_replay_writes_the_page_and_exits_like_status_path(tmp_path, walkthrough_log):
    out = tmp_path / "run.html"
    result = trainjob("replay", walkthrough_log, "-o", out)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    assert page_data(out.read_bytes())["frames"] == page_data(build(walkthrough_log))["frames"]
    spliced = tmp_path / "spliced.jsonl"
    spliced.write_text(walkthrough_log.read_text() * 2)
    result = trainjob("replay", spliced, "-o", out)
    assert result.returncode == 1
    assert result.stderr == f"trainjob replay: {spliced} line 11: illegal step from completed: job_started " \
                            "(nothing may follow it)\n"
    assert page_data(out.read_bytes())["frames"][-1]["kind"] == "illegal"


@pytest.mark.parametrize("content, message", [(None, "log not found"), ("\n", "holds no events")])
@pytest.mark.process
def test_a_missing_or_empty_log_exits_2_and_writes_nothing(tmp_path, content, message):
    log, out = tmp_path / "log.jsonl", tmp_path / "run.html"
    if content is not None:
        log.write_text(content)
    result = trainjob("replay", log, "-o", out)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1 and message in result.stderr
    assert not out.exists()


@pytest.mark.process
def test_without_dot_replay_exits_2_saying_how_to_install_it(tmp_path, walkthrough_log):
    out = tmp_path / "run.html"
    result = subprocess.run([sys.executable, "-m", "trainjob", "replay", walkthrough_log, "-o", out],
                            capture_output=True, text=True, env={**os.environ, "PATH": str(tmp_path)})
    assert result.returncode == 2 and "apt-get install graphviz" in result.stderr
    assert not out.exists()


# --- in a real browser: headless Chromium, one session for every check below ----------------------------

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
HAVE_BROWSER = CHROMIUM.exists() and CHROMEDRIVER.exists() and importlib.util.find_spec("selenium") is not None
needs_browser = pytest.mark.skipif(not (HAVE_BROWSER or IN_CI),
                                   reason="needs Debian's chromium and chromium-driver, and selenium (the test extra)")
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1280,1000"]
# What the page shows now, read from the drawing and the text, not from its data.
SHOWN = """return {
  current: [...document.querySelectorAll("#machine g.node.current title")].map((t) => t.textContent),
  just: [...document.querySelectorAll("#machine g.edge.just title")].map((t) => t.textContent),
  taken: [...document.querySelectorAll("#machine g.edge.taken title")].map((t) => t.textContent).sort(),
  state: document.getElementById("state").textContent,
  raw: document.getElementById("rawline").textContent,
  position: document.getElementById("position").textContent,
  now: document.querySelector("nav li[aria-current=step]").className,
};"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in [*FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SE_OFFLINE", "true")  # the system browser and driver: Selenium Manager downloads nothing
        driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    yield driver
    driver.quit()


def open_page(browser, page: Path) -> None:
    browser.get_log("browser")  # each page's console from its first line: what an earlier one logged is read
    browser.get(page.as_uri())


def press(browser, key: str) -> dict:
    from selenium.webdriver.common.keys import Keys

    browser.find_element("tag name", "body").send_keys(getattr(Keys, key))
    return browser.execute_script(SHOWN)


def console_errors(browser) -> list[dict]:
    return [entry for entry in browser.get_log("browser") if entry["level"] in ("SEVERE", "WARNING")]


@needs_dot
@needs_browser
@pytest.mark.parametrize("which", ["walkthrough", "backoff"])
@pytest.mark.process
@pytest.mark.browser
def test_browser_steps_through_every_line_highlighting_what_status_path_derives(
        browser, request, tmp_path, which):
    log = request.getfixturevalue(f"{which}_log")
    page = tmp_path / f"{which}.html"
    assert trainjob("replay", log, "-o", page).returncode == 0
    open_page(browser, page)
    derived = list(path_states(log).items())
    raw = log.read_text().splitlines()
    shown = browser.execute_script(SHOWN)
    for number, (source, dest) in derived:
        assert (shown["current"], shown["state"], shown["just"]) == ([dest], dest, [f"{source}->{dest}"]), number
        assert shown["raw"] == raw[number - 1] and shown["position"].startswith(f"line {number} ")
        if (which, number) in (("walkthrough", 5), ("walkthrough", 10), ("backoff", 15)):
            browser.save_screenshot(str(tmp_path / f"{which}-line{number}.png"))
        shown = press(browser, "ARROW_RIGHT")
    assert shown["position"].startswith(f"line {derived[-1][0]} ")  # the last line stays the last
    assert set(shown["taken"]) == {f"{source}->{dest}" for _, (source, dest) in derived}  # each edge taken, marked
    assert press(browser, "HOME")["position"].startswith("line 1 ")
    assert press(browser, "ARROW_LEFT")["position"].startswith("line 1 ")
    assert press(browser, "END")["position"].startswith(f"line {derived[-1][0]} ")
    browser.find_element("id", "prev").click()
    assert browser.execute_script(SHOWN)["position"].startswith(f"line {derived[-2][0]} ")
    browser.find_element("id", "first").click()
    assert browser.execute_script(SHOWN)["state"] == derived[0][1][1]
    assert console_errors(browser) == []
    assert len(list(tmp_path.glob("*.png"))) == (2 if which == "walkthrough" else 1)


@needs_browser
@pytest.mark.process
@pytest.mark.browser
def test_browser_shows_hostile_text_as_text_and_runs_none_of_it(browser, tmp_path):
    page = tmp_path / "hostile.html"
    page.write_bytes(build(hostile_log(tmp_path)))
    open_page(browser, page)
    shown = browser.execute_script(SHOWN)
    assert "</script><script>window.pwned = 1</script><img src=x" in shown["raw"]
    assert "\\u0007\\u001b[31m" in shown["raw"]  # JSON's escapes, as the log holds them
    assert press(browser, "ARROW_RIGHT")["raw"].endswith("more characters not shown)")
    third = press(browser, "ARROW_RIGHT")
    assert third["now"] == "skipped seen" and "\\u0007" in third["raw"]  # a raw control character, made visible
    assert third["state"] == "checkpointed"
    assert press(browser, "ARROW_RIGHT")["now"] == "aside seen"
    assert browser.execute_script("return [window.pwned, document.images.length, document.scripts.length, "
                                  "document.title]") == [None, 0, 2, "trainjob replay: hostile.jsonl"]
    assert console_errors(browser) == []


@needs_browser
@pytest.mark.process
@pytest.mark.browser
@pytest.mark.torchrun
def test_browser_renders_every_kind_of_line_and_marks_an_illegal_one(browser, tmp_path, every_kind_log):
    page = tmp_path / "every_kind.html"
    page.write_bytes(build(every_kind_log))
    open_page(browser, page)
    seen = [browser.execute_script(SHOWN)]
    for _ in range(len(every_kind_log.read_text().splitlines()) - 1):
        seen.append(press(browser, "ARROW_RIGHT"))
    assert [s["now"].split()[0] for s in seen].count("step") == len(seen) - 3
    assert seen[-1]["state"] == "completed" and seen[-1]["current"] == ["completed"]
    assert console_errors(browser) == []
    illegal = tmp_path / "illegal.jsonl"
    illegal.write_text(every_kind_log.read_text() + line("job_started", "steps=10 attempt=2"))
    page.write_bytes(build(illegal))
    open_page(browser, page)
    end = press(browser, "END")
    assert end["now"] == "illegal seen" and "ILLEGAL: the replay stops here" in end["position"]
    assert end["current"] == ["completed"] and end["just"] == []
    browser.save_screenshot(str(tmp_path / "illegal.png"))
    assert console_errors(browser) == []
