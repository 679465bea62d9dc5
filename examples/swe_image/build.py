"""Build a SWE-style task image: more-itertools 10.2.0 with a bug, for the ``swefix`` env.

The image is a real root filesystem in two layers: a runtime (this host's Python interpreter,
its standard library, ``/bin/sh``, coreutils, grep, sed, find, diff and the libraries they
load; nothing else of the host) and the task (the project's sdist from PyPI, pinned by
sha256, at ``/env`` with one bug put in, a pristine copy of its tests for the grader at
``/opt/grader`` with the oracle checks beside them (root's alone: the agent cannot read the
expected values), and ``/opt/swefix/task.json``). It runs as the user ``agent``, who owns
``/env`` and cannot write the grader's files. The grader itself ships with fanfold.

    python examples/swe_image/build.py --push localhost:5000/swe/more-itertools:padded
    python examples/swe_image/build.py --oci-layout ./swe-layout      # then: fanfold import ./swe-layout
    python examples/swe_image/build.py --docker-archive ./swe.tar     # a `docker load`-able tarball

Needs ``skopeo`` for ``--push`` and ``--docker-archive``; ``--tls-verify=false`` for a
plain-HTTP registry. See README.md beside this file.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROJECT, VERSION = "more-itertools", "10.2.0"
SDIST_SHA256 = "8fccb480c43d3e99a00087634c06dd02b0d50fbf088b380de5a41a015ec239e1"
# The bug: padded(next_multiple=True) loses the parentheses around its difference, so an input
# whose length is already a multiple of n gets n fill values instead of none.
BUG_FILE = "more_itertools/more.py"
FIXED = "remaining = (n - item_count) % n if next_multiple else n - item_count"
BUGGY = "remaining = n - item_count % n if next_multiple else n - item_count"
FAILING_TEST = "tests.test_more.PaddedTest.test_next_multiple"
ISSUE = ("padded(iterable, fillvalue, n, next_multiple=True) should pad only up to the next multiple of n, "
         "but when the input's length is already a multiple of n it appends n fill values: "
         "list(padded([1, 2, 3], '?', 3, next_multiple=True)) gives [1, 2, 3, '?', '?', '?'] instead of [1, 2, 3].")
# Calls whose results the grader compares out of the library's process (fanfold.rl.graders.swefix):
# other inputs than the issue's, so only a fix passes them, and behaviour the fix must keep.
ORACLE = {"imports": ["more_itertools"], "checks": [
    {"expr": "list(more_itertools.padded([1, 2, 3, 4], None, 2, next_multiple=True))", "expected": [1, 2, 3, 4]},
    {"expr": "''.join(more_itertools.padded('abcdef', 'x', 3, next_multiple=True))", "expected": "abcdef"},
    {"expr": "list(more_itertools.padded([], 0, 3, next_multiple=True))", "expected": []},
    {"expr": "list(more_itertools.padded([1, 2, 3, 4, 5], 0, 4, next_multiple=True))",
     "expected": [1, 2, 3, 4, 5, 0, 0, 0]},
    {"expr": "list(more_itertools.padded([1, 2], 0, 5))", "expected": [1, 2, 0, 0, 0]},
]}
SUBMISSION = ["more_itertools/*.py"]
"""What grading copies from an episode's /env: the library's sources."""
WORKDIR, GRADER, TASK_FILE = "/env", "/opt/grader", "/opt/swefix/task.json"
AGENT_UID = 1000
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fanfold/swe_image"
"""Where the sdist is kept between builds."""
EPOCH = 1_700_000_000
"""The time of what the build itself writes (dirs, /etc, task.json): the same tree gives the same digest."""
TOOLS = ("sh", "bash", "cat", "ls", "head", "tail", "wc", "sort", "uniq", "cut", "tr", "echo", "env", "true",
         "false", "pwd", "id", "mkdir", "rm", "cp", "mv", "touch", "stat", "sleep", "dd", "grep", "sed", "find",
         "xargs", "diff", "patch", "basename", "dirname", "readlink", "chmod", "uname")
# Parts of the standard library no test run needs: the static libpython, IDLE, Tk, the test suite.
STDLIB_SKIP = {"config-", "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data",
               "site-packages", "dist-packages", "distutils"}
CONFIG = {
    "User": "agent", "WorkingDir": WORKDIR, "Cmd": ["python3", "-m", "unittest", "-q"],
    "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8", "PYTHONDONTWRITEBYTECODE=1", "HOME=/home/agent"],
    "Labels": {"org.opencontainers.image.title": f"swefix {PROJECT} {VERSION}"},
}


# -- the project ----------------------------------------------------------------------------------


def fetch_sdist(cache: Path) -> Path:
    """The project's sdist from PyPI (kept in ``cache``), its sha256 checked."""
    sdist = cache / f"{PROJECT}-{VERSION}.tar.gz"
    if not sdist.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
                            "-d", tmp, f"{PROJECT}=={VERSION}"], check=True)
            os.replace(Path(tmp) / sdist.name, sdist)
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        sdist.unlink()
        raise SystemExit(f"{sdist.name}: sha256 {digest}, expected {SDIST_SHA256}; removed it, run again")
    return sdist


def task_tree(root: Path, sdist: Path) -> Path:
    """The task layer: the project with its bug at /env, the grader and its pristine tests, task.json."""
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        shutil.copytree(Path(tmp) / f"{PROJECT}-{VERSION}", root / WORKDIR.lstrip("/"))
    project = root / WORKDIR.lstrip("/")
    source = project / BUG_FILE
    text = source.read_text()
    if text.count(FIXED) != 1:
        raise SystemExit(f"{BUG_FILE} of {PROJECT} {VERSION} does not hold the line to break exactly once")
    stat = source.stat()
    source.write_text(text.replace(FIXED, BUGGY))
    os.utime(source, (stat.st_atime, stat.st_mtime))  # the same bytes out on every build
    grader = root / GRADER.lstrip("/")
    shutil.copytree(project / "tests", grader / "tests")
    oracle = grader / "oracle.json"
    oracle.write_text(json.dumps(ORACLE, indent=2) + "\n")
    oracle.chmod(0o600)  # root's: the agent sees the checks' results, never what they expect
    task = {"id": f"{PROJECT}-{VERSION}-padded", "project": PROJECT, "version": VERSION, "workdir": WORKDIR,
            "failing_test": FAILING_TEST, "issue": ISSUE, "test_command": "python3 -m unittest -q",
            "user": "agent", "submission": SUBMISSION, "tests": f"{GRADER}/tests", "oracle": f"{GRADER}/oracle.json"}
    (root / TASK_FILE.lstrip("/")).parent.mkdir(parents=True)
    (root / TASK_FILE.lstrip("/")).write_text(json.dumps(task, indent=2) + "\n")
    return root


# -- the runtime ----------------------------------------------------------------------------------


def runtime_tree(root: Path, python: str = "/usr/bin/python3") -> Path:
    """The runtime layer: ``python``'s interpreter and standard library, a shell and ``TOOLS``, the libraries
    all of them load, and /etc with root and ``agent``; merged-/usr, as Debian lays it out."""
    paths = json.loads(subprocess.run(
        [python, "-c", "import json, sys, sysconfig; p = sysconfig.get_paths(); "
                       "print(json.dumps([sys.executable, p['stdlib'], p['platstdlib'], sys.version_info[:2]]))"],
        check=True, capture_output=True, text=True).stdout)
    executable, stdlib, platstdlib, (major, minor) = paths
    (root / "usr/bin").mkdir(parents=True)
    for name, target in (("bin", "usr/bin"), ("sbin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")):
        os.symlink(target, root / name)
    for name in ("etc", "tmp", "root", "home/agent", "usr/lib", "usr/lib64", "usr/local/bin"):
        (root / name).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "tmp", 0o1777)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1000:agent:/home/agent:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\nagent:x:1000:\n")
    binaries = [Path(executable).resolve()]
    _copy(binaries[0], root)
    for name in ("python3", "python"):
        if not os.path.lexists(root / "usr/bin" / name):
            os.symlink(binaries[0], root / "usr/bin" / name)
    for where in dict.fromkeys((stdlib, platstdlib)):
        shutil.copytree(where, _inside(root, Path(where)), symlinks=False, dirs_exist_ok=True,
                        ignore=lambda d, names: [n for n in names if n in STDLIB_SKIP or n.startswith("config-")])
    binaries += sorted(Path(platstdlib, "lib-dynload").glob("*.so"))
    for tool in TOOLS:
        found = shutil.which(tool)
        if found and not (root / "usr/bin" / tool).exists():
            shutil.copy2(Path(found).resolve(), root / "usr/bin" / tool)
            binaries.append(Path(found).resolve())
    libs: set[str] = set()
    for binary in binaries:
        listed = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
        libs.update(part for line in listed.splitlines() for part in line.split() if part.startswith("/"))
    for lib in sorted(libs):
        _copy(Path(lib), root, follow=True)
    print(f"runtime: python {major}.{minor} from {executable}, {len(libs)} libraries", file=sys.stderr)
    return root


def _inside(root: Path, path: Path) -> Path:
    """Where host ``path`` goes in a merged-/usr ``root`` (/lib/x is /usr/lib/x)."""
    rel = str(path).lstrip("/")
    return root / (rel if rel.startswith("usr/") or not rel.startswith(("bin/", "lib/", "lib64/", "sbin/"))
                   else f"usr/{rel}")


def _copy(path: Path, root: Path, *, follow: bool = False) -> None:
    target = _inside(root, path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        shutil.copy2(path.resolve() if follow else path, target)


# -- the image ------------------------------------------------------------------------------------


def layer(root: Path, out: Path, *, owners: dict[str, int] | None = None, since: float | None = None) -> Path:
    """A gzipped layer of the tree ``root``: sorted, owned by root (or ``owners``: path prefix -> uid=gid).

    Files keep their times (stale ones would void the interpreter's cached bytecode); directories and
    what was written after ``since`` get ``EPOCH``, so building the same tree again gives the same digest.
    """
    owners = owners or {}
    since = time.time() - 600 if since is None else since
    with open(out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(root.rglob("*")):
            name = str(path.relative_to(root))
            info = tar.gettarinfo(str(path), arcname=name)
            owner = next((uid for prefix, uid in owners.items() if name == prefix or name.startswith(prefix + "/")), 0)
            info.uid = info.gid = owner
            info.uname = info.gname = ""
            if info.isdir() or info.mtime >= since:
                info.mtime = EPOCH
            if info.isreg():
                with open(path, "rb") as handle:
                    tar.addfile(info, handle)
            else:
                tar.addfile(info)
    return out


def write_layout(path: Path, layers: list[Path], *, tag: str = "latest", config: dict | None = None) -> str:
    """Write an OCI image layout at ``path`` of gzipped ``layers`` (bottom first); return the manifest digest."""
    blobs = path / "blobs/sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    (path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')

    def blob(data: bytes) -> tuple[str, int]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return "sha256:" + digest, len(data)

    descriptors, diff_ids = [], []
    for tar in layers:
        data = tar.read_bytes()
        digest, size = blob(data)
        descriptors.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": digest, "size": size})
        diff_ids.append("sha256:" + hashlib.sha256(gzip.decompress(data)).hexdigest())
    image_config = {"architecture": _arch(), "os": "linux", "config": config or CONFIG,
                    "rootfs": {"type": "layers", "diff_ids": diff_ids}}
    config_digest, config_size = blob(json.dumps(image_config, sort_keys=True).encode())
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest,
                           "size": config_size},
                "layers": descriptors}
    digest, size = blob(json.dumps(manifest, sort_keys=True).encode())
    index = {"schemaVersion": 2, "manifests": [{"mediaType": manifest["mediaType"], "digest": digest, "size": size,
                                                "annotations": {"org.opencontainers.image.ref.name": tag}}]}
    (path / "index.json").write_text(json.dumps(index))
    return digest


def _arch() -> str:
    machine = os.uname().machine
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def build(layout: Path, *, cache: Path = CACHE, python: str = "/usr/bin/python3", tag: str = "latest") -> str:
    """Build the task image into the OCI layout dir ``layout``; return its manifest digest."""
    since = time.time() - 1
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        runtime = layer(runtime_tree(work / "runtime", python), work / "runtime.tar.gz",
                        owners={"home/agent": AGENT_UID}, since=since)
        task = layer(task_tree(work / "task", fetch_sdist(cache)), work / "task.tar.gz",
                     owners={WORKDIR.lstrip("/"): AGENT_UID}, since=since)
        return write_layout(layout, [runtime, task], tag=tag)


def push(layout: Path, ref: str, *, tag: str = "latest", tls_verify: bool = True,
         extra: tuple[str, ...] = ()) -> str:
    """``skopeo copy`` the layout's image to ``docker://ref``; return ``REPO@DIGEST`` as pushed."""
    with tempfile.NamedTemporaryFile() as digest_file:
        subprocess.run(["skopeo", "copy", "-q", f"--dest-tls-verify={str(tls_verify).lower()}", *extra,
                        "--digestfile", digest_file.name, f"oci:{layout}:{tag}", f"docker://{ref}"], check=True)
        digest = Path(digest_file.name).read_text().strip()
    repo = ref.rsplit("@", 1)[0]
    if ":" in repo.rsplit("/", 1)[-1]:
        repo = repo.rsplit(":", 1)[0]
    return f"{repo}@{digest}"


def docker_archive(layout: Path, out: Path, ref: str, *, tag: str = "latest") -> Path:
    """A ``docker save``-format tarball of the layout's image, named ``ref``."""
    out.unlink(missing_ok=True)
    subprocess.run(["skopeo", "copy", "-q", f"oci:{layout}:{tag}", f"docker-archive:{out}:{ref}"], check=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--push", metavar="REGISTRY/NAME:TAG", help="push the image there with skopeo")
    parser.add_argument("--tls-verify", default="true", choices=["true", "false"],
                        help="false for a plain-HTTP registry such as localhost:5000")
    parser.add_argument("--oci-layout", metavar="DIR", type=Path, help="keep the OCI layout in DIR")
    parser.add_argument("--docker-archive", metavar="FILE", type=Path, help="write a docker-save tarball")
    parser.add_argument("--python", default="/usr/bin/python3", help="the interpreter to put in the image")
    parser.add_argument("--cache", type=Path, default=CACHE, help=f"where the sdist is kept (default {CACHE})")
    args = parser.parse_args(argv)
    if not (args.push or args.oci_layout or args.docker_archive):
        parser.error("give at least one of --push, --oci-layout, --docker-archive")
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        layout = args.oci_layout or Path(tmp) / "layout"
        if layout.exists() and any(layout.iterdir()):
            parser.error(f"{layout} is not empty")
        digest = build(layout, cache=args.cache, python=args.python)
        print(f"built {digest} in {time.monotonic() - started:.1f}s", file=sys.stderr)
        if args.docker_archive:
            docker_archive(layout, args.docker_archive, args.push or f"swefix/{PROJECT}:{VERSION}")
            print(f"wrote {args.docker_archive}", file=sys.stderr)
        if args.push:
            print(push(layout, args.push, tls_verify=args.tls_verify == "true"))


if __name__ == "__main__":
    main()
