"""The main job for now: one golden env, 32 sandboxes at once, a different edit in each.

Some edits fix the bug, some break other things, one runs `rm -rf /` as root, a few
misbehave (an endless loop, a memory hog, a fork bomb). Every sandbox runs the tests;
the table shows that each outcome is its own and that the destructive one harmed no one.

    python examples/fanout_demo.py [--count 32]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fanfold import AsyncFleet, EnvSpec

HERE = Path(__file__).parent
TEST_CMD = "python3 -m unittest -q test_calc 2>&1 | tail -1"


def replace_first(old: str, new: str) -> str:
    """A shell edit that replaces the first ``old`` in calc.py with ``new``."""
    return f"python3 -c \"import pathlib; p = pathlib.Path('calc.py'); p.write_text(p.read_text().replace('{old}', '{new}', 1))\""


# (name, shell edit): each sandbox applies one
EDITS = [
    ("fix: a + b", replace_first("return a - b", "return a + b")),
    ("fix: sum()", replace_first("return a - b", "return sum((a, b))")),
    ("fix: b + a", replace_first("return a - b", "return b + a")),
    ("break mul", "sed -i 's/return a \\* b/return a ** b/' calc.py"),
    ("fix add, break sub", "sed -i 's/return a - b/return a + b/g' calc.py"),
    ("no-op", "true"),
    ("syntax error", "echo 'def broken(:' >> calc.py"),
    ("delete the tests", "rm test_calc.py"),
    ("rm -rf / as root", "rm -rf --no-preserve-root / 2>/dev/null; true"),
    ("endless loop", "python3 -c 'while True: pass'"),
    ("memory hog", "python3 -c 'x = bytearray(1 << 30)'"),
    ("fork bomb", "bomb() { bomb | bomb & }; bomb"),
]


async def one(fleet: AsyncFleet, image, index: int) -> dict:
    name, edit = EDITS[index % len(EDITS)]
    started = time.perf_counter()
    async with await fleet.create(image, memory_mb=128, pids=64, labels={"rollout_id": f"demo-{index}"}) as sandbox:
        created = time.perf_counter() - started
        edited = await sandbox.exec(edit, timeout=10)
        tests = await sandbox.exec(TEST_CMD, timeout=10)
        verdict = tests.text.strip().splitlines()[-1] if tests.text.strip() else f"(no output, exit {tests.exit_code})"
    return {
        "index": index, "edit": name, "edit_outcome": edited.outcome.value, "limits": ",".join(edited.limits_hit),
        "tests": verdict, "passed": verdict == "OK", "create_ms": created * 1000,
    }


async def main(count: int) -> int:
    console = Console()
    spec = EnvSpec("host").workdir("/env").copy(str(HERE / "demo_project"), "/env").run(
        "cd /env && python3 -m compileall -q . && (python3 -m unittest -q test_calc 2>&1 | tail -1)"
    )
    async with AsyncFleet() as fleet:
        with console.status("building the golden environment"):
            image = await fleet.build(spec)
        console.print(f"golden env [bold]{image.id}[/bold]: {len(image.layers)} layers")
        before = {s.id for s in await fleet.list()}
        with Progress(TextColumn("fan-out"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console) as bar:
            task = bar.add_task("rollouts", total=count)

            async def tracked(i: int) -> dict:
                try:
                    return await one(fleet, image, i)
                finally:
                    bar.advance(task)

            started = time.perf_counter()
            rows = await asyncio.gather(*(tracked(i) for i in range(count)))
            wall = time.perf_counter() - started
        async with await fleet.create(image) as witness:
            after_check = await witness.exec(TEST_CMD)
        leftover = {s.id for s in await fleet.list()} - before

    table = Table(title=f"{count} sandboxes from one golden env in {wall:.1f}s")
    for column in ("#", "edit", "edit outcome", "limits hit", "tests", "create ms"):
        table.add_column(column)
    for row in sorted(rows, key=lambda r: r["index"]):
        style = "green" if row["passed"] else "red" if "FAILED" in row["tests"] or "Error" in row["tests"] else "yellow"
        table.add_row(str(row["index"]), row["edit"], row["edit_outcome"], row["limits"] or "-",
                      f"[{style}]{row['tests']}[/{style}]", f"{row['create_ms']:.0f}")
    console.print(table)
    fixed = sum(r["passed"] for r in rows)
    wrecked = [r for r in rows if r["edit"].startswith("rm -rf")]
    console.print(f"{fixed}/{count} sandboxes pass the tests after their edit")
    console.print(f"the rm -rf / sandbox(es) ended with: {', '.join(r['tests'] for r in wrecked)}")
    isolation = all(r["passed"] for r in rows if r["edit"].startswith("fix:")) and "FAILED" in after_check.text
    console.print(
        f"isolation held: {'yes' if isolation else 'NO'} (every fix passed beside the wrecked sandbox; a fresh sandbox "
        f"still shows the original bug: {after_check.text.strip()}); leaked sandboxes: {len(leftover)}"
    )
    return 0 if isolation and not leftover else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=32, help="sandboxes to fan out (default 32)")
    raise SystemExit(asyncio.run(main(parser.parse_args().count)))
