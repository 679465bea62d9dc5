# An unmodified E2B script: only the environment points it at fanfold serve.
#   E2B_API_URL=http://HOST:8700/e2b E2B_SANDBOX_URL=http://HOST:8700/e2b/envd E2B_API_KEY=<fanfold token>
from e2b import Sandbox

with Sandbox.create(timeout=300, metadata={"run": "demo"}) as sbx:
    sbx.files.write("/tmp/greet.sh", "echo hello from $(uname -s)\nexit 3\n")
    result = sbx.commands.run("bash /tmp/greet.sh || echo exit code $?")
    print(result.stdout, end="")
    server = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(server.pid, "typed in\n")
    sbx.commands.close_stdin(server.pid)
    print(server.wait().stdout, end="")
    print(sorted(entry.name for entry in sbx.files.list("/tmp") if entry.name.endswith(".sh")))
