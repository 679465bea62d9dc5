"""The trusted half of a grader, run as root in a pristine grading sandbox: it runs the code under
test in a child of an unprivileged user and takes back from it plain JSON data only.

The child cannot write the trusted process's output (another user's pipe), signal or trace it,
or outlive it (every process of its user is killed before its data is read to the end); its
data is parsed as JSON, never run, and the verdict is decided here. Standard library only, Python
3.9 or later: it runs on the image's interpreter, written into the sandbox by the host.
"""

import json
import os
import pwd
import select
import signal
import subprocess
import sys
import time

MAX_DATA = 1 << 20
"""The most bytes a child may print; more scores as no answer."""


class NoAnswer(Exception):
    """The child gave no usable answer: it crashed, timed out, printed too much or not one JSON value."""


def account(user):
    """(uid, gid) of ``user`` (a name in the image's /etc/passwd or a number); never root."""
    if str(user).isdigit():
        uid = int(user)
        try:
            gid = pwd.getpwuid(uid).pw_gid
        except KeyError:
            gid = uid
    else:
        entry = pwd.getpwnam(user)
        uid, gid = entry.pw_uid, entry.pw_gid
    if uid == 0 or gid == 0:
        raise SystemExit("the code under test must not run as root: name an unprivileged user")
    return uid, gid


def kill_user(uid, gid, rounds=50):
    """Kill every process of ``uid`` in the sandbox (daemons the child left included)."""
    for _ in range(rounds):
        if not _processes_of(uid):
            return
        pid = os.fork()
        if pid == 0:  # a process of that user may signal exactly that user's processes, at once
            try:
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)  # every process it may signal but itself
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
    raise NoAnswer("processes of the code under test could not all be killed")


def _processes_of(uid):
    """Live (not zombie) processes whose real uid is ``uid``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/status" % pid) as handle:
                status = dict(line.split(":", 1) for line in handle if ":" in line)
        except OSError:  # gone meanwhile
            continue
        if int(status["Uid"].split()[0]) == uid and not status["State"].strip().startswith(("Z", "X")):
            found.append(int(pid))
    return found


def run_untrusted(argv, user, data=None, cwd="/", timeout=60.0, max_output=MAX_DATA, env=None):
    """Run ``argv`` as ``user`` with ``data`` as JSON on its stdin; its stdout parsed as one JSON value.

    Raises NoAnswer when it times out, exits non-zero, prints more than ``max_output`` bytes
    or anything but one JSON value. Every process of ``user`` is dead when this returns."""
    uid, gid = account(user)
    env = env or {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp"}
    kill_user(uid, gid)
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             cwd=cwd, env=env, user=uid, group=gid, extra_groups=[], start_new_session=True)
    try:
        out, why = _exchange(child, json.dumps(data).encode(), time.monotonic() + timeout, max_output)
    finally:
        child.kill()
        child.wait()
        kill_user(uid, gid)
        child.stdin.close()
        child.stdout.close()
    if why:
        raise NoAnswer(why)
    if child.returncode != 0:
        raise NoAnswer("the code under test exited with status %s" % child.returncode)
    return loads(out)


def _exchange(child, data, deadline, max_output):
    """Feed ``data`` and read the child's stdout until it closes; (output, why it failed or "")."""
    out, pending = bytearray(), memoryview(data)
    os.set_blocking(child.stdin.fileno(), False)
    readers, writers = [child.stdout], [child.stdin] if data else []
    if not data:
        child.stdin.close()
    while readers:
        left = deadline - time.monotonic()
        if left <= 0:
            return out, "the code under test timed out"
        ready_r, ready_w, _ = select.select(readers, writers, [], left)
        if ready_w:
            try:
                pending = pending[os.write(child.stdin.fileno(), pending):]
            except (BrokenPipeError, BlockingIOError):
                pending = pending[len(pending):]
            if not pending:
                writers = []
                child.stdin.close()
        if ready_r:
            chunk = os.read(child.stdout.fileno(), 65536)
            if not chunk:
                readers = []
            out += chunk
            if len(out) > max_output:
                return out, "the code under test printed more than %d bytes" % max_output
    try:
        child.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return out, "the code under test timed out"
    return out, ""


def loads(raw):
    """One JSON value from bytes: strict UTF-8, no NaN or Infinity, nothing after it."""
    try:
        return json.loads(bytes(raw).decode("utf-8"), parse_constant=_refuse)
    except (ValueError, RecursionError) as exc:
        raise NoAnswer("not one JSON value: %s" % str(exc)[:200])


def _refuse(name):
    raise ValueError("%s is not JSON" % name)


def same(value, expected):
    """Whether ``value`` (untrusted data) equals ``expected``, type for type: a number only a number
    (int and float alike, never a bool), a string only a string, lists and objects item by item."""
    number = (int, float)
    if type(expected) in number:
        return type(value) in number and value == expected
    if type(expected) in (list, tuple):
        return type(value) is list and len(value) == len(expected) and all(map(same, value, expected))
    if type(expected) is dict:
        return (type(value) is dict and set(value) == set(expected)
                and all(same(value[key], item) for key, item in expected.items()))
    return type(value) is type(expected) and value == expected


def report(verdict):
    """Print the verdict: the one line the host reads from this process's own stdout."""
    sys.stdout.write(json.dumps(verdict, sort_keys=True) + "\n")
    sys.stdout.flush()
