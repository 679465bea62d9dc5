"""``fanfold traj``: list, show, export and prune the episodes of a trajectory store."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table

from ..errors import InvalidRequest
from ..rl.export import FORMATS
from ..rl.store import TrajectoryStore, default_path
from ..rl.trajectory import OUTCOMES, Episode, Step

SHORT_ID = 12
SHOWN_CHARS = 400  # of each tool result and model output in `show`; --json has them whole
UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _db_option(fn):  # type: ignore[no-untyped-def]
    return click.option("--db", "db", default=None, metavar="PATH",
                        help="The store's SQLite file [default: $FANFOLD_TRAJECTORIES, else trajectories.db in the "
                             "state dir].")(fn)


def _filter_options(fn):  # type: ignore[no-untyped-def]
    for option in reversed([
        click.option("--task", default=None, help="Only episodes of this task."),
        click.option("--outcome", "outcomes", multiple=True, type=click.Choice(OUTCOMES),
                     help="Only episodes with this outcome (repeatable); replaces the default of complete ones."),
        click.option("--all", "everything", is_flag=True,
                     help="Include incomplete episodes (running, partial, error, infra_error)."),
    ]):
        fn = option(fn)
    return fn


def _open(ctx: click.Context, db: str | None) -> TrajectoryStore:
    """The store named by --db, else the default one for --state-dir; never creates one."""
    state_dir = (ctx.find_root().obj or {}).get("state_dir")
    return TrajectoryStore(db or default_path(state_dir), create=False)


@click.group()
def traj() -> None:
    """Trajectories of RL rollouts: list, show, export, dedupe, expire."""


@traj.command(name="ls")
@_db_option
@_filter_options
@click.option("--limit", type=click.IntRange(min=0), default=None, help="At most this many, newest first.")
@click.option("--json", "as_json", is_flag=True, help="One JSON array of episodes, without their steps.")
@click.pass_context
def ls(ctx, db, task, outcomes, everything, limit, as_json) -> None:  # type: ignore[no-untyped-def]
    """List episodes, newest first.

    Only complete ones (success, failure, truncated) unless --all or --outcome says otherwise.
    """
    with _open(ctx, db) as store:
        found = store.episodes(task=task, outcome=outcomes or None, include_incomplete=everything, limit=limit,
                               with_steps=False)
        counts = store.step_counts(e.id for e in found)
    if as_json:
        click.echo(json.dumps([_header(e, counts[e.id]) for e in found]))
        return
    table = Table(Column("ID", no_wrap=True), "TASK", Column("SEED", justify="right"), "OUTCOME",
                  Column("REWARD", justify="right"), Column("STEPS", justify="right"), Column("CREATED", no_wrap=True),
                  box=None, pad_edge=False)
    for e in found:
        table.add_row(e.id[:SHORT_ID], e.task, "" if e.seed is None else str(e.seed), e.outcome,
                      f"{e.total_reward:g}", str(counts[e.id]), _when(e.created_at))
    Console().print(table)


@traj.command()
@_db_option
@click.argument("episode_id", metavar="ID")
@click.option("--steps", "window", default=None, metavar="START:STOP",
              help="Only steps with START <= index < STOP (either may be left out; N alone is one step).")
@click.option("--json", "as_json", is_flag=True, help="The episode as JSON, with the selected steps.")
@click.pass_context
def show(ctx: click.Context, db: str | None, episode_id: str, window: str | None, as_json: bool) -> None:
    """Show episode ID (an unambiguous prefix will do) and its steps."""
    start, stop = _slice(window)
    with _open(ctx, db) as store:
        episode = store.get(store.resolve(episode_id), with_steps=False)
        count = store.step_counts([episode.id])[episode.id]
        episode.steps = store.steps(episode.id, start, stop)
    if as_json:
        click.echo(json.dumps(episode.to_dict()))
        return
    out = Console(highlight=False)
    for key, value in _shown_header(episode, count).items():
        if value not in (None, {}, ""):
            out.print(f"[bold]{key:<14}[/bold] {escape(str(value))}", soft_wrap=True)
    for step in episode.steps:
        _print_step(out, step)


def _print_step(out: Console, step: Step) -> None:
    tokens = "" if step.loss_mask is None else f"  mask {len(step.loss_mask)} ({sum(step.loss_mask)} model)"
    policy = f"  policy {step.policy_version}" if step.policy_version else ""
    out.print(f"\n[bold cyan]step {step.index}[/bold cyan]  reward {step.reward:g}{tokens}{policy}")
    if step.model_output:
        out.print(_clip(step.model_output.rstrip()), markup=False, soft_wrap=True)
    if step.tool_call is not None:
        call = f"{step.tool_call.get('name')}({step.tool_call.get('arguments', '')})"
        out.print(f"[yellow]call[/yellow] {escape(call)}", soft_wrap=True)
    if step.tool_result is not None:
        out.print(f"[green]result[/green] {escape(_clip(step.tool_result.rstrip()))}", soft_wrap=True)


@traj.command()
@_db_option
@click.argument("path", type=click.Path(dir_okay=False, writable=True))
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="jsonl: one episode a line; parquet: one row per step. [default: from PATH's suffix]")
@_filter_options
@click.pass_context
def export(ctx, db, path, fmt, task, outcomes, everything) -> None:  # type: ignore[no-untyped-def]
    """Write episodes to PATH as JSONL or Parquet; print how many.

    Only complete ones unless --all or --outcome says otherwise. Parquet has one row per
    step (an episode without steps gets one row) and its format version in the file's metadata.
    """
    with _open(ctx, db) as store:
        written = store.export(path, format=fmt, task=task, outcome=outcomes or None, include_incomplete=everything)
    click.echo(f"{written} episode{'' if written == 1 else 's'} written to {path}")


@traj.command()
@_db_option
@click.pass_context
def dedupe(ctx: click.Context, db: str | None) -> None:
    """Delete duplicate complete episodes; print how many.

    Episodes are duplicates when task, seed, image, snapshot and every step's output, tool
    call, result and reward match; the earliest of each set stays.
    """
    with _open(ctx, db) as store:
        removed = store.dedupe()
    click.echo(f"{removed} duplicate episode{'' if removed == 1 else 's'} deleted")


@traj.command()
@_db_option
@click.option("--older-than", "age", required=True, metavar="AGE",
              help="Delete episodes created longer ago than this: seconds, or a number with s, m, h or d (7d).")
@click.pass_context
def expire(ctx: click.Context, db: str | None, age: str) -> None:
    """Delete episodes older than --older-than; print how many.

    Running episodes stay: their writers are still adding to them.
    """
    with _open(ctx, db) as store:
        removed = store.expire(_seconds(age))
    click.echo(f"{removed} episode{'' if removed == 1 else 's'} older than {age} deleted")


def _header(episode: Episode, steps: int) -> dict[str, Any]:
    header = episode.to_dict()
    del header["steps"]
    return {**header, "steps": steps}


def _shown_header(episode: Episode, steps: int) -> dict[str, Any]:
    """The header in reading order, with times as dates and metadata as JSON."""
    header = _header(episode, steps)
    first = {name: header.pop(name) for name in ("id", "task", "outcome", "total_reward", "steps")}
    header["metadata"] = json.dumps(header["metadata"], ensure_ascii=False) if header["metadata"] else None
    for name in ("created_at", "finished_at"):
        header[name] = None if header[name] is None else _when(header[name])
    return {**first, **header}


def _slice(text: str | None) -> tuple[int, int | None]:
    """``START:STOP`` (either side optional) or ``N``, as step-index bounds."""
    if text is None:
        return 0, None
    match = re.fullmatch(r"\s*(\d*)\s*(:?)\s*(\d*)\s*", text)
    if match is None or not (match[1] or match[3]) or (match[3] and not match[2]):
        raise InvalidRequest(f"--steps takes START:STOP, START:, :STOP or N with whole numbers >= 0, got {text!r}")
    start = int(match[1] or 0)
    if not match[2]:
        return start, start + 1
    stop = int(match[3]) if match[3] else None
    if stop is not None and stop < start:
        raise InvalidRequest(f"--steps {text}: STOP comes before START")
    return start, stop


def _seconds(text: str) -> float:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text.lower())
    if match is None:
        raise InvalidRequest(f"--older-than takes seconds or a number with s, m, h or d (as 7d), got {text!r}")
    return float(match[1]) * UNITS[match[2]]


def _when(stamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))


def _clip(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... [{len(text) - SHOWN_CHARS} more chars]"
