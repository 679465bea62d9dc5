"""The main job: rollouts of the code-fix env fanned out over one golden image, some of them forked.

Builds the code-fix env, keeps a warm pool, and runs ``--rollouts`` episodes with
``fleet.map``, ``--concurrency`` at a time. Every 4th episode forks after 3 turns (a CRIU
memory fork of its sandbox) into two branches that play on with different policy seeds.
Steps go to a SQLite trajectory store as they happen; at the end it prints the rewards and
a summary, and writes ``report.html``, ``trajectories.jsonl`` and ``trajectories.parquet``.

The policy is the scripted one that ships with the env, or an OpenAI-compatible server
(vLLM, SGLang) with ``--policy-url`` (or ``FANFOLD_POLICY_URL``).

    python examples/rl_demo.py [--rollouts 64] [--concurrency 16] [--out demo-out] [--policy-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fanfold import AsyncFleet, FanfoldError, RolloutResult, RolloutStats
from fanfold.config import env_policy_url
from fanfold.rl import (Episode, Policy, PolicyReply, TrajectoryStore, default_policy, env_class, make_async,
                        run_episode)

from report import RunData, write_report

ENV = "codefix"
FORK_EVERY, FORK_AT, FORK_COUNT = 4, 3, 2
EXEC_TOOLS, FILE_TOOLS = ("run_tests", "submit"), ("read_file", "edit_file")
TABLE_ROWS = 20
STYLES = {"success": "green", "failure": "red", "truncated": "yellow"}


class CountedPolicy:
    """The policy, counting its requests and the seconds they took."""

    def __init__(self, inner: Policy, name: str) -> None:
        self.inner, self.name = inner, name
        self.requests, self.seconds = 0, 0.0

    async def act(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *,
                  seed: int | None = None) -> PolicyReply:
        started = time.perf_counter()
        try:
            return await self.inner.act(messages, tools, seed=seed)
        finally:
            self.requests += 1
            self.seconds += time.perf_counter() - started

    async def tokenize(self, text: str) -> list[int] | None:
        return await self.inner.tokenize(text)

    async def close(self) -> None:
        await self.inner.close()


@dataclass
class Run:
    """What the rollouts left, gathered for the table, the summary and the report."""

    results: list[RolloutResult] = field(default_factory=list)
    stats: RolloutStats | None = None
    reset_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    total_s: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def episodes(self) -> list[Episode]:
        return [e for r in sorted(self.results, key=lambda r: r.index) if r.ok for e in r.value]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=64, help="episodes to run (default 64)")
    parser.add_argument("--concurrency", type=int, default=16, help="rollouts at once (default 16)")
    parser.add_argument("--out", type=Path, default=Path("demo-out"), help="output directory (default demo-out/)")
    parser.add_argument("--db", type=Path, help="trajectory store (default OUT/trajectories.db)")
    parser.add_argument("--policy-url", default=env_policy_url(),
                        help="OpenAI-compatible server, e.g. http://gpu:8000/v1 (default $FANFOLD_POLICY_URL; "
                             "none: the scripted policy)")
    parser.add_argument("--model", help="model name on the policy server (default: the first it lists)")
    parser.add_argument("--no-pool", dest="pool", action="store_false", help="no warm pool: every reset creates")
    args = parser.parse_args(argv)
    if args.rollouts < 1 or args.concurrency < 1:
        parser.error("--rollouts and --concurrency must be at least 1")
    args.db = args.db or args.out / "trajectories.db"
    return args


async def main(args: argparse.Namespace) -> int:
    console = Console(highlight=False)
    started, since = time.perf_counter(), time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        policy = make_policy(args)
        with TrajectoryStore(args.db) as store:
            try:
                async with AsyncFleet() as fleet:
                    image = await prepare(fleet, console, args)
                    run = await fan_out(fleet, image, policy, store, args)
            finally:
                await policy.close()
            exports = {fmt: args.out / f"trajectories.{fmt}" for fmt in ("jsonl", "parquet")}
            for path in exports.values():  # this run's episodes, however they ended
                store.export(path, since=since, include_incomplete=True)
    except FanfoldError as exc:
        console.print(f"[red]error:[/red] {escape(f'{type(exc).__name__}: {exc}')}")
        console.print("`make setup` prepares the host; `.venv/bin/fanfold doctor` says what it lacks")
        return 2
    run.total_s = time.perf_counter() - started
    summary = summarize(run, policy, args)
    console.print(episode_table(run, args))
    for line in error_lines(run):
        console.print(f"[magenta]rollout error:[/magenta] {escape(line)}")
    console.print(summary_table(summary))
    report = write_report(args.out / "report.html", report_data(run, summary, args))
    console.print(f"wrote {report.name}, {exports['jsonl'].name} and {exports['parquet'].name} in {args.out}/")
    console.print(f"trajectory store: {args.db}")
    if not any(r.ok for r in run.results):
        console.print("[red]no rollout finished: the fleet or the policy is not working (the errors are above)[/red]")
        return 1
    return 0


def make_policy(args: argparse.Namespace) -> CountedPolicy:
    """The server at ``--policy-url``, else the scripted policy that ships with the env."""
    return CountedPolicy(default_policy(ENV, url=args.policy_url, model=args.model), args.policy_url or "scripted")


async def prepare(fleet: AsyncFleet, console: Console, args: argparse.Namespace) -> Any:
    """The golden image, and (unless ``--no-pool``) a warm pool for the env's sandbox limits."""
    with console.status("building the code-fix golden env"):
        image = await env_class(ENV).prepare(fleet)
    console.print(f"golden env [bold]{image.id}[/bold]: {len(image.layers)} layers")
    if args.pool:
        limits = make_async(ENV, fleet, image=image).limits  # the pool serves creates with exactly these
        with console.status(f"warming a pool of {args.concurrency} sandboxes"):
            started = time.perf_counter()
            pool = await fleet.pool(image, size=args.concurrency, wait=60, **limits)
        console.print(f"warm pool: {pool.ready} of {pool.size} ready in {time.perf_counter() - started:.1f}s")
    return image


async def fan_out(fleet: AsyncFleet, image: Any, policy: CountedPolicy, store: TrajectoryStore,
                  args: argparse.Namespace) -> Run:
    run = Run()

    async def rollout(i: int) -> list[Episode]:
        env = make_async(ENV, fleet, image=image)
        started = time.time()
        try:
            episodes = await run_episode(env, policy, seed=i, store=store, rollout_id=f"demo-{i}",
                                         fork_at=FORK_AT if i % FORK_EVERY == 0 else None, fork_count=FORK_COUNT)
        finally:
            await env.close()
        if episodes[0].steps:  # the first request follows the reset at once
            run.reset_s.append(episodes[0].steps[0].started_at - started)
        return episodes

    started = time.perf_counter()
    async with fleet.map(rollout, range(args.rollouts), concurrency=args.concurrency, retries=2, deadline=120,
                         progress=True) as rollouts:
        run.results = [result async for result in rollouts]
        run.stats = rollouts.stats
    run.wall_s = time.perf_counter() - started
    run.metrics = await fleet.metrics()
    return run


# Reporting -------------------------------------------------------------------------------------


def branch_label(episode: Episode, forked: set[str]) -> str:
    if episode.parent_id is not None:
        return f"branch {episode.metadata.get('branch', '?')} (forked at step {episode.fork_step})"
    return f"parent of {FORK_COUNT - 1}" if episode.id in forked else "-"


def episode_rows(run: Run) -> list[dict[str, Any]]:
    """One row per episode, then one per rollout that returned none, with its error."""
    episodes = run.episodes
    forked = {e.parent_id for e in episodes if e.parent_id}
    rows = [{"rollout": e.rollout_id, "seed": e.seed, "branch": branch_label(e, forked), "steps": len(e.steps),
             "outcome": e.outcome, "reward": round(e.total_reward, 3), "error": e.error} for e in episodes]
    for result in sorted(run.results, key=lambda r: r.index):
        if not result.ok:
            rows.append({"rollout": f"demo-{result.item}", "seed": result.item, "branch": "-", "steps": None,
                         "outcome": result.status, "reward": None,
                         "error": f"{type(result.error).__name__}: {result.error} ({result.attempts} attempts)"})
    return rows


def episode_table(run: Run, args: argparse.Namespace) -> Table:
    rows = episode_rows(run)
    shown = rows if len(rows) <= TABLE_ROWS + 4 else rows[:TABLE_ROWS]
    table = Table(title=f"{len(run.episodes)} episodes of {args.rollouts} rollouts" +
                  (f" (the first {len(shown)}; all in report.html)" if len(shown) < len(rows) else ""))
    for column in ("rollout", "seed", "branch / parent", "steps", "outcome", "reward"):
        table.add_column(column, justify="right" if column in ("seed", "steps", "reward") else "left")
    for row in shown:
        style = STYLES.get(row["outcome"], "magenta")
        table.add_row(row["rollout"], str(row["seed"]), row["branch"], "-" if row["steps"] is None else str(row["steps"]),
                      f"[{style}]{row['outcome']}[/{style}]", "-" if row["reward"] is None else f"{row['reward']:.2f}")
    if len(shown) < len(rows):
        table.add_row("...", "", f"{len(rows) - len(shown)} more", "", "", "")
    return table


def error_lines(run: Run, most: int = 5) -> list[str]:
    """The distinct errors of rollouts that returned no episode, most common first."""
    counts = Counter(f"{type(r.error).__name__}: {r.error}" for r in run.results if not r.ok)
    return [f"{n} x {error}" for error, n in counts.most_common(most)]


def fork_pairs(episodes: list[Episode]) -> list[tuple[float, float]]:
    """(parent, branch) final rewards: the parent played on from the same fork point."""
    by_id = {e.id: e for e in episodes}
    return [(by_id[e.parent_id].total_reward, e.total_reward) for e in episodes if e.parent_id in by_id]


def fork_seconds(episodes: list[Episode]) -> list[float]:
    """Per fork: from the end of the last step before it to the branch's next turn (CRIU dump and restore)."""
    spans = []
    for e in episodes:
        if e.parent_id and e.fork_step and len(e.steps) > e.fork_step:
            before = e.steps[e.fork_step - 1]
            spans.append(e.steps[e.fork_step].started_at - before.started_at - before.duration_s)
    return spans


def pct(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms" if value >= 1 else f"{value:.2f} ms"


def tool_times(episodes: list[Episode], tools: tuple[str, ...]) -> list[float]:
    """``tool_s`` of each step made with one of ``tools``; a branch's copied prefix is counted once."""
    return [s.info["tool_s"] for e in episodes for s in e.steps
            if s.info.get("tool") in tools and "tool_s" in s.info and s.index >= (e.fork_step or 0)]


def summarize(run: Run, policy: CountedPolicy, args: argparse.Namespace) -> list[tuple[str, str]]:
    episodes, stats = run.episodes, run.stats or RolloutStats()
    rewards = [e.total_reward for e in episodes]
    complete = [e for e in episodes if e.complete]
    successes = sum(e.outcome == "success" for e in complete)
    pairs = fork_pairs(episodes)
    better, worse = sum(b > p for p, b in pairs), sum(b < p for p, b in pairs)
    create, execs = run.metrics.get("create_ms") or {}, run.metrics.get("exec_ms") or {}
    reset_ms = [s * 1000 for s in run.reset_s]
    fork_ms = [s * 1000 for s in fork_seconds(episodes)]
    return [
        ("episodes", f"{len(episodes)}: {len(episodes) - len(pairs)} rollouts + {len(pairs)} forked branches"),
        ("success rate", f"{_share(successes, len(complete))} ({successes} of {len(complete)} complete episodes)"),
        ("reward mean / median", f"{statistics.fmean(rewards):.3f} / {statistics.median(rewards):.3f}" if rewards else "-"),
        ("fork branch vs parent", f"mean {statistics.fmean(b for _, b in pairs):.2f} vs "
                                  f"{statistics.fmean(p for p, _ in pairs):.2f} (better {better} / worse {worse} / "
                                  f"tie {len(pairs) - better - worse})" if pairs else "no forks"),
        ("rollouts (their own)", f"ok {stats.ok}, failed {stats.failed}, timeout {stats.timeout}"),
        ("infra errors", f"{stats.infra_error} rollouts lost, {stats.infra_retries} attempts retried"),
        ("wall time", f"{run.wall_s:.1f} s fan-out ({args.concurrency} at a time), {run.total_s:.1f} s in all"),
        ("throughput", f"{len(run.results) / run.wall_s:.2f} rollouts/s, {len(episodes) / run.wall_s:.2f} episodes/s"
                       if run.wall_s else "-"),
        ("create p50 / p99 (engine)", f"{ms(create.get('p50'))} / {ms(create.get('p99'))}"),
        ("exec p50 / p99 (engine)", f"{ms(execs.get('p50'))} / {ms(execs.get('p99'))}"),
        ("reset p50 / p99 (measured)", f"{ms(pct(reset_ms, 0.5))} / {ms(pct(reset_ms, 0.99))}"),
        ("fork p50 / max (measured)", f"{ms(pct(fork_ms, 0.5))} / {ms(max(fork_ms, default=None))}"),
        ("policy requests", f"{policy.requests} ({policy.name}), {policy.seconds:.2f} s"),
    ]


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else "-"


def summary_table(rows: list[tuple[str, str]]) -> Table:
    table = Table(title="summary", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for label, value in rows:
        table.add_row(label, value)
    return table


def report_data(run: Run, summary: list[tuple[str, str]], args: argparse.Namespace) -> RunData:
    episodes = run.episodes
    spans = [(r.started_at, r.started_at + r.duration_s) for r in run.results]
    return RunData(
        title=f"fanfold: {args.rollouts} code-fix rollouts, {args.concurrency} at a time",
        summary=summary, episodes=episode_rows(run), rewards=[e.total_reward for e in episodes],
        forked_rewards=fork_pairs(episodes), reset_s=run.reset_s, exec_s=tool_times(episodes, EXEC_TOOLS),
        file_s=tool_times(episodes, FILE_TOOLS), spans=spans,
        notes={
            "summary": "Forks: every 4th rollout forks after 3 turns (CRIU memory fork); its parent plays on from "
                       "the same point, so each pair compares two continuations. Rollout failures and timeouts are "
                       "the rollouts' own; infra errors are the fleet's, retried by fleet.map and never scored. "
                       "Engine create and exec figures are fleet.metrics() percentiles over its last "
                       f"{run.metrics.get('window_s', 300) / 60:g} minutes (creates served by the warm pool "
                       "included, and fork children, which are restores from a memory snapshot). Reset is "
                       "measured here (see its plot); fork is measured from the end of the last step before "
                       "the fork to the branch's next turn.",
            "rewards": "Final reward of every episode (share of the pristine tests passing at submit); "
                       "forked branches overlaid.",
            "reset": "Reset latency, measured per rollout: from run_episode's call to its first policy request "
                     "(sandbox create, from the warm pool when one is ready, task set-up, store write).",
            "exec": "Tool-call latency: env.step time of each tool call (info['tool_s']); run_tests and submit "
                    "run the test suite in the sandbox, read_file and edit_file are file calls.",
            "timeline": "Rollouts in flight and completed over the fan-out (fleet.map's RolloutResult "
                        "started_at and duration_s).",
        },
    )


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
