"""Scripted policies for the envs that ship: fakes of a model, for tests and the demo.

Each reads the conversation so far and picks the next tool call, with ``rng`` (seeded per
request) deciding where a real model would vary: a right or a wrong fix, a typo, an early
submit, a missed or an extra file.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from ..core import ToolCall, new_call_id
from ..policy import PolicyReply

# (function, the buggy line, its fix, a plausible wrong fix)
CODEFIX_FIXES = (
    ("mean", "return sum(values) // len(values)", "return sum(values) / len(values)",
     "return sum(values) // max(len(values), 1)"),
    ("median", "ordered = list(values)", "ordered = sorted(values)", "ordered = list(reversed(values))"),
    ("percent_change", "return (new - old) / new * 100", "return (new - old) / old * 100",
     "return (old - new) / old * 100"),
)


def history(messages: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], str]]:
    """The tool calls made so far, as (name, arguments, result)."""
    results = {m.get("tool_call_id"): m.get("content", "") for m in messages if m.get("role") == "tool"}
    calls = []
    for message in messages:
        for call in message.get("tool_calls") or []:
            function = call["function"]
            calls.append((function["name"], json.loads(function["arguments"] or "{}"), results.get(call["id"], "")))
    return calls


def reply(name: str, arguments: dict[str, Any], text: str = "") -> PolicyReply:
    return PolicyReply(text=text, tool_calls=[ToolCall(name, arguments, new_call_id())], finish_reason="tool_calls")


def codefix(messages: list[dict[str, Any]], rng: random.Random) -> PolicyReply:
    """Run the tests, read stats.py, fix the three bugs (each right 70% of the time), test, submit."""
    done = history(messages)
    names = [name for name, _, _ in done]
    if not done:
        return reply("run_tests", {}, "Let me see which tests fail.")
    if not any(name == "read_file" and not result.startswith("error") for name, _, result in done):
        path = "stat.py" if rng.random() < 0.1 else "stats.py"  # a typo the env reports back
        return reply("read_file", {"path": path}, "Now the code under test.")
    edited = {args.get("old") for name, args, result in done if name == "edit_file" and result.startswith("edited")}
    for function, old, right, wrong in CODEFIX_FIXES:
        if old not in edited:
            if names[-1] == "run_tests" and len(edited) and rng.random() < 0.1:
                return reply("submit", {}, "Good enough; submitting.")
            new = right if rng.random() < 0.7 else wrong
            return reply("edit_file", {"path": "stats.py", "old": old, "new": new}, f"Fixing {function}.")
    if names[-1] != "run_tests":
        return reply("run_tests", {}, "Checking the fixes.")
    return reply("submit", {}, "Submitting.")


# The task of examples/swe_image: (file, the buggy line, its fix, a plausible fix that changes nothing)
SWEFIX_FIX = ("more_itertools/more.py", "remaining = n - item_count % n if next_multiple",
              "remaining = (n - item_count) % n if next_multiple", "remaining = n - (item_count % n) if next_multiple")


def swefix(messages: list[dict[str, Any]], rng: random.Random) -> PolicyReply:
    """For examples/swe_image's task: run the tests, find padded's count, fix it (30% of the time a no-op
    first, fixed again after the tests still fail), test, submit."""
    done = history(messages)
    path, old, right, wrong = SWEFIX_FIX
    edits = [args for name, args, result in done if name == "edit_file" and result.startswith("edited")]
    if not done:
        return reply("run_tests", {}, "Let me see the failure first.")
    if len(done) == 1:
        return reply("shell", {"command": f"grep -n 'remaining = ' {path}"}, "padded fails; where it counts its fill.")
    if not edits:
        new = wrong if rng.random() < 0.3 else right
        return reply("edit_file", {"path": path, "old": old, "new": new}, "The fill count is off for exact multiples.")
    if done[-1][0] == "edit_file":
        return reply("run_tests", {}, "Checking the fix.")
    if edits[-1]["new"] == wrong and "FAILED" in done[-1][2]:
        return reply("edit_file", {"path": path, "old": wrong, "new": right}, "The modulo must cover the difference.")
    return reply("submit", {}, "The suite passes; submitting.")


_QUESTION = re.compile(r"(runbook of the (?P<service>\w+) service|incident (?P<code>INC-\d+)|feature flag (?P<flag>[\w-]+))")


def corpus(messages: list[dict[str, Any]], rng: random.Random) -> PolicyReply:
    """Search for the question's key term, read a hit, submit what was found (sometimes one too few or many)."""
    question = next(m["content"] for m in messages if m.get("role") == "user")
    match = _QUESTION.search(question)
    done = history(messages)
    if match is None:
        return reply("submit", {"paths": []}, "I cannot tell what to look for.")
    if match["service"]:
        if not done:
            return reply("find", {"name": "*runbook*"}, "Runbooks by name.")
        found = [line for line in done[-1][2].splitlines() if f"/{match['service']}/" in line]
        return reply("submit", {"paths": found[:1]}, "That one.")
    term = match["code"] or f"flag:{match['flag']}"
    if not done:
        return reply("search", {"pattern": re.escape(term), "path": "/corpus"}, f"Searching for {term}.")
    hits = sorted({line.split(":", 1)[0] for line in done[0][2].splitlines() if line.startswith("/corpus/")})
    if len(done) == 1 and hits:
        return reply("read_file", {"path": hits[0]}, "Checking the first hit.")
    if hits and rng.random() < 0.15:
        hits = hits[:-1]  # a miss
    elif rng.random() < 0.1:
        hits.append("/corpus/auth/faq.md")  # a wrong extra
    return reply("submit", {"paths": hits}, "These are the documents.")


_URL = re.compile(r"http://server:(?P<port>\d+)/secret")
HANDOFF_FETCH = ("python3 - <<'EOF'\nimport time, urllib.request\nfor _ in range(100):\n    try:\n"
                 "        print(urllib.request.urlopen('{url}', timeout=2).read().decode().strip()); break\n"
                 "    except OSError:\n        time.sleep(0.1)\nelse:\n    raise SystemExit('no answer')\nEOF")


def handoff(messages: list[dict[str, Any]], rng: random.Random) -> PolicyReply:
    """Either agent of the handoff env (told apart by its system prompt). The server starts an HTTP
    server on the secret's directory, then waits; the client waits a step, fetches, and reports."""
    task = next(m["content"] for m in messages if m.get("role") == "user")
    port = _URL.search(task)["port"]
    done = history(messages)
    if "agent `server`" in messages[0]["content"]:
        if not done:
            return reply("shell", {"command": f"cd /srv && nohup python3 -m http.server {port} --bind 0.0.0.0 "
                                              ">/dev/null 2>&1 & echo serving"}, "Serving the secret's directory.")
        return reply("wait", {}, "Serving; waiting for the client.")
    if not done:
        return reply("wait", {}, "Giving the server a step to come up.")
    name, _, result = done[-1]
    status, _, body = result.partition("\n")
    if name == "shell" and status == "exit code 0" and body.strip():
        return reply("report", {"secret": body.strip()}, "Reporting what the server sent.")
    return reply("shell", {"command": HANDOFF_FETCH.format(url=f"http://server:{port}/secret")}, "Fetching.")
