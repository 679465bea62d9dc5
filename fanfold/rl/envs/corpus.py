"""The corpus search env: find the documents that answer a question in a read-only corpus.

The golden image holds a generated corpus of runbooks, design notes, FAQs, changelogs and
postmortems at ``/corpus`` (files mode 0444). The seed picks the question; the agent
searches (``search``, ``find``, ``read_file``, ``shell``) and ``submit``s paths. The reward is
the F1 score of the submitted files against the right ones, computed on the host from the paths
alone (normalised under ``/corpus``, never resolved in the sandbox): whatever the agent does to the
sandbox's corpus (writing, deleting, symlinking, replacing ``find``) changes no reward.
"""

from __future__ import annotations

import functools
import posixpath
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import tools as generic
from ...errors import InvalidRequest, ToolError
from ...spec import EnvSpec
from ..core import AsyncSandboxEnv, Tool, ToolCall, ToolOutcome

ROOT = "/corpus"
VERSION = 1
SERVICES = ("billing", "search", "auth", "ledger", "media", "notify", "gateway", "storage")
FLAGS = ("fast-path", "dual-write", "shadow-reads", "batch-commit", "lazy-index", "geo-pinning")
WORDS = ("latency", "quota", "replica", "shard", "token", "backoff", "cache", "queue", "rollout", "schema",
         "alert", "budget", "cursor", "lease", "snapshot", "retry", "window", "region", "payload", "index")


@dataclass(frozen=True)
class Question:
    id: str
    text: str
    answer: tuple[str, ...]
    """Paths relative to ``/corpus``."""


def _prose(rng: random.Random, sentences: int) -> str:
    lines = []
    for _ in range(sentences):
        words = rng.sample(WORDS, 6)
        lines.append(f"The {words[0]} {words[1]} keeps the {words[2]} within its {words[3]} "
                     f"while the {words[4]} {words[5]} is tuned.")
    return " ".join(lines)


@functools.cache
def generate() -> tuple[dict[str, str], tuple[Question, ...]]:
    """The corpus (path relative to ``/corpus`` to text) and its questions: always the same."""
    rng = random.Random(VERSION)
    docs: dict[str, str] = {}
    questions: list[Question] = []
    flag_docs: dict[str, list[str]] = {flag: [] for flag in FLAGS}
    for service in SERVICES:
        for kind in ("runbook", "design", "faq", "changelog"):
            path = f"{service}/{kind}.md"
            text = f"# {service} {kind}\n\n{_prose(rng, 4)}\n"
            if kind == "design":
                for flag in rng.sample(FLAGS, 2):
                    text += f"\nThe feature flag `flag:{flag}` gates this path. {_prose(rng, 1)}\n"
                    flag_docs[flag].append(path)
            docs[path] = text
        questions.append(Question(f"runbook-{service}", f"Which document is the runbook of the {service} service?",
                                  (f"{service}/runbook.md",)))
    for number in range(10):
        service, code = rng.choice(SERVICES), f"INC-{4100 + number * 37}"
        post = f"postmortems/{2026 - number % 3}-{number:02d}-{service}.md"
        docs[post] = f"# Postmortem {code}: {service}\n\n{_prose(rng, 5)}\n"
        docs[f"{service}/changelog.md"] += f"\n- Fix for {code}: {_prose(rng, 1)}\n"
        answer = sorted({post, f"{service}/changelog.md"})
        questions.append(Question(f"incident-{code}", f"Which documents mention incident {code}?", tuple(answer)))
    for flag, paths in flag_docs.items():
        if paths:
            questions.append(Question(f"flag-{flag}", f"Which documents discuss the feature flag {flag}?",
                                      tuple(sorted(paths))))
    return docs, tuple(questions)


def corpus_dir() -> Path:
    """The corpus written out on the host, for the image build to copy."""
    directory = Path(tempfile.gettempdir()) / f"fanfold-corpus-v{VERSION}"
    for path, text in generate()[0].items():
        target = directory / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists() or target.read_text() != text:
            target.write_text(text)
    return directory


TOOLS = (
    *(t for t in (generic.TOOLS["search"], generic.TOOLS["read_file"],
                                                             generic.TOOLS["shell"])),
    Tool("find", "List files under /corpus whose name matches a glob, e.g. *runbook*.",
            {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
             "additionalProperties": False}),
    Tool("submit", "Finish with the documents that answer the question (paths under /corpus).",
            {"type": "object", "properties": {"paths": {"type": "array", "items": {"type": "string"}}},
             "required": ["paths"], "additionalProperties": False}),
)


class CorpusSearchEnv(AsyncSandboxEnv):
    """Find the right files in ``/corpus``; reward = F1 of the submitted paths."""

    name = "corpus"
    tools = TOOLS
    system_prompt = ("You answer questions about a document corpus in /corpus by finding the documents that "
                     "answer them. Search, list and read files with the tools, then submit the paths.")
    max_steps = 12

    @classmethod
    def env_spec(cls) -> EnvSpec:
        return (EnvSpec("host").workdir(ROOT).copy(corpus_dir(), ROOT)
                .run(f"find {ROOT} -type f -exec chmod 0444 {{}} + && find {ROOT} -type d -exec chmod 0555 {{}} +"))

    async def begin(self, options: dict[str, Any]) -> str:
        questions = generate()[1]
        by_id = {q.id: q for q in questions}
        if "question" in options and options["question"] not in by_id:
            raise InvalidRequest(f"unknown question {options['question']!r}; see fanfold.rl.envs.corpus.generate()")
        question = by_id[options["question"]] if "question" in options else \
            questions[int(self.np_random.integers(len(questions)))]
        self.task = {"id": question.id, "question": question.text, "answer": list(question.answer)}
        return f"{question.text} Submit the paths of all of them, and only them."

    async def call(self, tool: ToolCall) -> ToolOutcome:
        if tool.name == "submit":
            return self._grade(tool.arguments["paths"])
        if tool.name == "find":
            name = tool.arguments["name"]
            if not name:
                raise ToolError("find needs a non-empty `name` glob")
            result = await self.sandbox.exec(["find", ROOT, "-name", name, "-type", "f"], timeout=30)
            return ToolOutcome("\n".join(sorted(result.stdout.decode().split())) or "no files match")
        # step() checked the arguments against this tool's schema already.
        return ToolOutcome(await self.sandbox.run_tool(tool.name, tool.arguments, timeout=30))

    def _grade(self, paths: list[str]) -> ToolOutcome:
        chosen = {posixpath.relpath(posixpath.normpath(posixpath.join(ROOT, p)), ROOT) for p in paths}
        right = set(self.task["answer"])
        hits = len(chosen & right)
        f1 = 0.0 if not hits else 2 * hits / (len(chosen) + len(right))
        return ToolOutcome(f"submitted {len(chosen)} paths: {hits} of {len(right)} right (F1 {f1:.2f})",
                           reward=f1, done=True)

    def solved(self, total_reward: float) -> bool:
        return total_reward >= 0.999
