from pathlib import Path

from fanfold import EnvSpec, Fleet

spec = (
    EnvSpec("host")                      # or "debian:bookworm" (debootstrap, built once)
    .workdir("/env")
    .copy(Path(__file__).parent / "demo_project", "/env")
    .env(PYTHONDONTWRITEBYTECODE="1")
    .run("python3 -m compileall -q /env")  # reaches the outside through NAT, nothing of the host
    .service("web", "python3 -m http.server 8000 --bind 127.0.0.1")
)

with Fleet() as fleet:                   # no address: the engine runs in this process
    image = fleet.build(spec)            # one layer per step; a rebuild is nearly free
    with fleet.create(image, memory_mb=256, pids=128, deadline=600) as sandbox:
        result = sandbox.exec("python3 -m unittest -q", timeout=30)
        print(result.outcome, result.exit_code)          # Outcome.EXITED 1
        print(result.stderr.decode().splitlines()[-1])   # FAILED (failures=1): unittest reports on stderr
        sandbox.files.write("notes.txt", "relative paths start at the workdir")
        print(sorted(entry.name for entry in sandbox.files.list()))
