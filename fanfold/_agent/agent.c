/*
 * fanfold-agent: PID 1 of a fanfold sandbox. Wire protocol: PROTOCOL.md.
 *
 * One single-threaded poll() loop over: a signalfd (SIGCHLD), the listening
 * socket (fd 3, or --listen PATH for testing), host connections, the pipes
 * (or pseudo-terminals) of running commands, and the relays of gVisor's sandbox networks (listeners
 * inside, spliced connections). Everything is non-blocking and every buffer is
 * bounded, so a slow host or a noisy command can never grow the agent's memory.
 *
 * Build: cc -static -O2 -Wall -Wextra -o fanfold-agent agent.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <grp.h>
#include <fcntl.h>
#include <arpa/inet.h>
#include <net/if.h>
#include <net/route.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <termios.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define MAX_FRAME (1u << 20)
#define OBUF_CAP (256 * 1024) /* output bound per connection: the backpressure point */
#define OBUF_SLACK 1024       /* extra room so small control frames always fit */
#define CHUNK (64 * 1024)     /* one `o`/`r` frame at most */
#define DRAIN_US 100000       /* forward leftovers this long after the child exits */
#define DEFAULT_LIMIT 16777216ULL
#define MAX_GROUPS 256        /* supplementary groups one `u` frame may name */
#define SPLICE_BUF (64 * 1024) /* per direction of a spliced connection */
#define RELAY_BACKLOG 1024

enum { K_NEW, K_PING, K_WAIT, K_EXEC, K_AUTH };
enum { S_SETUP, S_RUN, S_DRAIN, S_DONE };

struct conn {
	struct conn *next;
	int fd, kind, state, dead, close_after, rd_eof;
	/* frame being received */
	unsigned char hdr[5];
	uint32_t hgot, plen, pgot;
	char *pl;
	/* bytes queued for the host */
	char *ob;
	size_t olen, ooff;
	/* exec request */
	char **argv, **envp, *cwd;
	int argc, envc, stdin_pipe, bad;
	unsigned short rows, cols; /* the `y` frame: run on a pseudo-terminal of this size (0: none) */
	unsigned long long timeout_ms, limit;
	struct user *user; /* the `u` frame: whom the child runs as (NULL: as the agent) */
	/* running command */
	pid_t pid;
	int fds[2], in_fd; /* stdout/stderr read ends, stdin write end */
	char *pend;        /* an `i` payload not yet written to the child */
	size_t pend_len, pend_off;
	unsigned long long bytes[2];
	int trunc[2], timed_out, status;
	int64_t t_start, t_end, deadline, drain_deadline;
	int pi_sock, pi_fd[2], pi_in; /* indexes into this round's pollfd array */
	char nonce[33];                /* `n`: what the host's next frame must carry a MAC of */
};

struct user {
	uid_t uid;
	gid_t gid;
	int ngroups;
	gid_t groups[MAX_GROUPS];
};

struct service {
	const char *name, *cmd;
	int oneshot;
	pid_t pid;
};

static struct conn *conns;
static struct service *svcs;
/* `l`: a TCP listener on 127.0.0.1:port inside, each connection spliced to the unix socket at path
 * (a host socket under gVisor). Held from a `q` until the next `l` of its port: no new connection
 * to the host may appear between a `q` and the checkpoint it prepares. */
struct relay {
	struct relay *next;
	int port, fd, held, pi;
	char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
};

/* Bytes passed both ways between two sockets: fd[0] came to us (a connection to a relay's
 * listener, or the host's `o` request), fd[1] is the one we connected. */
struct splice {
	struct splice *next;
	int fd[2], pi[2];
	int port;       /* the relay's port, 0 for an `o` */
	int connecting; /* fd[1]'s connect is in flight */
	int answer;     /* `o`: tell the host how the connect went, before any byte */
	int eof[2];     /* fd[i] said end of file: once buf[i] is written, fd[1-i] is shut for writing */
	int shut[2];    /* fd[i] is shut for writing */
	int dead;
	char *buf[2];   /* read from fd[i], to be written to fd[1-i] */
	size_t len[2], off[2];
};

static struct relay *relays;
static struct splice *splices;
static int nsvc, next_svc, ready, listen_fd = -1, sig_fd = -1;
static int held;                  /* --hold: services wait for the host's `g` */
static int rebinds;               /* --hold: a runtime without fd passing (gVisor) may have us drop
                                   * our listener (`q`); under others we never do */
static const char *listen_path;   /* --listen: bound again on SIGUSR2 after a `q` */
static char host_key[65];         /* the first `g`'s payload (--hold): see mac() */
static int64_t accept_resume; /* listener paused until then (fd exhaustion) */
static char ready_msg[600];
static char scratch[256 * 1024]; /* sink for output past the limit */
static char *empty_env[] = { NULL };
static struct rlimit nofile; /* as inherited; restored in children */
static int null_fd = -1;     /* opened once: the sandbox may delete /dev/null later */
static const char *svc_root = ""; /* --root: where services run and log ("" is /) */
static const char *init_path;     /* --init: what becomes PID 1 (systemd) once the host has locked us in */

static int64_t now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void xclose(int *fd)
{
	if (*fd >= 0)
		close(*fd);
	*fd = -1;
}

static void set_nonblock(int fd)
{
	fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

/* ---- child side ------------------------------------------------------- */

/* What failed before a command could run: the caller's cwd must be named
 * apart from the program, or a missing directory reads as a missing /bin/sh. */
enum stage { STAGE_EXEC, STAGE_CHDIR, STAGE_USER };

/* Runs in the forked child: never returns. Failures before exec go to the
 * parent as a raw {errno, stage} over errfd (closed by a successful exec). */
static void child(char **argv, char **envp, const char *cwd, const struct user *u, int in, int out, int err,
		  int errfd, int tty)
{
	struct sigaction sa = { .sa_handler = SIG_DFL };
	sigset_t none;
	int fd, report[2] = { 0, STAGE_EXEC };

	setsid();
	/* a terminal: the slave (in, out and err alike) becomes the new session's controlling terminal,
	 * so its line discipline signals the foreground group (Ctrl-C) and a resize sends SIGWINCH */
	if (tty && ioctl(in, TIOCSCTTY, 0) < 0)
		goto fail;
	/* the agent ignores several signals; ignored dispositions survive exec */
	for (int s = 1; s < NSIG; s++)
		sigaction(s, &sa, NULL);
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);
	if ((fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC)) >= 0) {
		if (write(fd, "0", 1) < 0) { /* best effort */ }
		close(fd);
	}
	if (in < 0)
		in = null_fd;
	/* fds 0-2 are always open in the agent, so these never alias 0-2 and
	 * dup2 clears CLOEXEC on the copies */
	if (dup2(in, 0) < 0 || dup2(out, 1) < 0 || dup2(err, 2) < 0)
		goto fail;
	if (nofile.rlim_max) /* after the opens above: they may need the raised limit */
		setrlimit(RLIMIT_NOFILE, &nofile);
	/* groups first, uid last: each step needs the rights the next one drops */
	if (u && (setgroups(u->ngroups, u->groups) < 0 || setgid(u->gid) < 0 || setuid(u->uid) < 0)) {
		report[1] = STAGE_USER;
		goto fail;
	}
	if (chdir(cwd) < 0) {
		report[1] = STAGE_CHDIR;
		goto fail;
	}
	environ = envp; /* execvp searches the PATH of the given env */
	execvp(argv[0], argv);
fail:
	report[0] = errno;
	if (errfd >= 0 && write(errfd, report, sizeof report) < 0) { /* parent gone */ }
	_exit(127);
}

/* Fork and exec; returns the pid, or -1 with *errp set (and *stagep, when
 * given, saying whether the cwd or the exec failed). Waits only until the
 * child has exec'd (or failed), which is immediate in practice. */
static pid_t spawn(char **argv, char **envp, const char *cwd, const struct user *u, int in, int out, int err,
		   int tty, int *errp, int *stagep)
{
	int ep[2], report[2];
	ssize_t n;
	pid_t pid;

	if (pipe2(ep, O_CLOEXEC) < 0)
		return *errp = errno, -1;
	if ((pid = fork()) == 0) {
		close(ep[0]);
		child(argv, envp, cwd, u, in, out, err, ep[1], tty);
	}
	close(ep[1]);
	if (pid < 0) {
		*errp = errno;
		close(ep[0]);
		return -1;
	}
	do
		n = read(ep[0], report, sizeof report);
	while (n < 0 && errno == EINTR);
	close(ep[0]);
	if (n != (ssize_t)sizeof report)
		return pid;
	if (stagep)
		*stagep = report[1];
	return *errp = report[0], -1; /* the child _exits; reaped as an orphan */
}

/* ---- output to the host ------------------------------------------------ */

static int ensure_ob(struct conn *c)
{
	if (!c->ob && !(c->ob = malloc(OBUF_CAP + OBUF_SLACK)))
		c->dead = 1;
	if (c->ooff && c->ooff == c->olen)
		c->ooff = c->olen = 0;
	return c->ob != NULL;
}

static void compact(struct conn *c)
{
	if (c->ooff) {
		memmove(c->ob, c->ob + c->ooff, c->olen - c->ooff);
		c->olen -= c->ooff;
		c->ooff = 0;
	}
}

static void put_hdr(char *p, char type, size_t n)
{
	p[0] = type;
	p[1] = (char)(n >> 24);
	p[2] = (char)(n >> 16);
	p[3] = (char)(n >> 8);
	p[4] = (char)n;
}

/* Queue a small control frame; pipe data never uses the slack, so it fits. */
static void put(struct conn *c, char type, const char *data)
{
	size_t n = strlen(data);
	if (!ensure_ob(c))
		return;
	compact(c);
	if (c->olen + 5 + n > OBUF_CAP + OBUF_SLACK)
		n = OBUF_CAP + OBUF_SLACK - c->olen - 5;
	put_hdr(c->ob + c->olen, type, n);
	memcpy(c->ob + c->olen + 5, data, n);
	c->olen += 5 + n;
}

__attribute__((format(printf, 3, 4))) static void putf(struct conn *c, char type, const char *fmt, ...)
{
	char buf[OBUF_SLACK - 16];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(buf, sizeof buf, fmt, ap);
	va_end(ap);
	put(c, type, buf);
}

/* The host is gone (or broke the protocol): kill what it started. */
static void host_gone(struct conn *c)
{
	if (c->kind == K_EXEC && (c->state == S_RUN || c->state == S_DRAIN) && c->pid > 0)
		kill(-c->pid, SIGKILL);
	c->dead = 1;
}

static void flush(struct conn *c)
{
	while (c->ooff < c->olen) {
		ssize_t n = write(c->fd, c->ob + c->ooff, c->olen - c->ooff);
		if (n < 0) {
			if (errno != EAGAIN && errno != EINTR)
				host_gone(c);
			return;
		}
		c->ooff += n;
	}
	c->ooff = c->olen = 0;
	if (c->close_after)
		c->dead = 1;
}

/* ---- exec sessions ----------------------------------------------------- */

static void drop_stdin(struct conn *c)
{
	free(c->pend);
	c->pend = NULL;
	xclose(&c->in_fd);
}

static void finish(struct conn *c)
{
	int st = c->status;
	int sig = WIFSIGNALED(st) ? WTERMSIG(st) : 0;
	int code = sig ? 128 + sig : WEXITSTATUS(st);

	drop_stdin(c);
	xclose(&c->fds[0]);
	xclose(&c->fds[1]);
	putf(c, 'z', "code=%d signal=%d timeout=%d out_bytes=%llu err_bytes=%llu "
	     "out_trunc=%d err_trunc=%d duration_us=%lld", code, sig, c->timed_out,
	     c->bytes[0], c->bytes[1], c->trunc[0], c->trunc[1],
	     (long long)(c->t_end - c->t_start));
	c->state = S_DONE;
	c->close_after = 1;
}

static void maybe_finish(struct conn *c)
{
	if (c->state == S_DRAIN && c->fds[0] < 0 && c->fds[1] < 0)
		finish(c);
}

static void fail(struct conn *c, int e, int stage)
{
	putf(c, 'f', "%d %s %s", e, stage == STAGE_CHDIR ? "chdir" : stage == STAGE_USER ? "user" : "exec",
	     strerror(e));
	c->state = S_DONE;
	c->close_after = 1;
}

/* `y`: a pseudo-terminal pair of the asked size. The slave is opened through the master
 * (TIOCGPTPEER) where the kernel can, so no name in the sandbox's /dev/pts is trusted; else by
 * its name (gVisor). grantpt is not needed: devpts gives the slave its owner itself. */
static int open_pty(struct conn *c, int *master, int *slave)
{
	struct winsize ws = { .ws_row = c->rows, .ws_col = c->cols };
	char name[64];
	int e;

	*slave = -1;
	if ((*master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC)) < 0)
		return errno;
	if (unlockpt(*master) == 0 && ioctl(*master, TIOCSWINSZ, &ws) == 0) {
		*slave = ioctl(*master, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
		if (*slave < 0 && ptsname_r(*master, name, sizeof name) == 0)
			*slave = open(name, O_RDWR | O_NOCTTY | O_CLOEXEC);
	}
	if (*slave >= 0) {
		/* the user's own terminal, as login makes it (best effort: the fds are open already) */
		if (c->user && fchown(*slave, c->user->uid, (gid_t)-1) < 0) { /* kept root's */ }
		return 0;
	}
	e = errno ? errno : EIO;
	xclose(master);
	return e;
}

static void start_exec(struct conn *c)
{
	int in[2] = { -1, -1 }, out[2] = { -1, -1 }, err[2] = { -1, -1 }, e = 0, stage = STAGE_EXEC;
	int tty = c->rows > 0, ptm = -1, pts = -1;

	if (c->argc == 0 || c->bad)
		e = EINVAL;
	else if (tty) {
		/* stdin writes go through a second descriptor: ending stdin closes it, not the output */
		if (!(e = open_pty(c, &ptm, &pts)) && (in[1] = fcntl(ptm, F_DUPFD_CLOEXEC, 3)) < 0)
			e = errno;
	} else if ((c->stdin_pipe && pipe2(in, O_CLOEXEC) < 0) || pipe2(out, O_CLOEXEC) < 0 ||
		   pipe2(err, O_CLOEXEC) < 0)
		e = errno;
	if (!e) {
		c->t_start = now_us();
		c->pid = spawn(c->argv, c->envp ? c->envp : empty_env, c->cwd ? c->cwd : "/", c->user,
			       tty ? pts : in[0], tty ? pts : out[1], tty ? pts : err[1], tty, &e, &stage);
	}
	xclose(&pts);
	xclose(&in[0]);
	xclose(&out[1]);
	xclose(&err[1]);
	if (e) {
		xclose(&ptm);
		xclose(&in[1]);
		xclose(&out[0]);
		xclose(&err[0]);
		c->pid = 0;
		fail(c, e, stage);
		return;
	}
	c->in_fd = in[1];
	c->fds[0] = tty ? ptm : out[0];
	c->fds[1] = err[0]; /* a terminal has one stream: stdout */
	for (int i = 0; i < 2; i++)
		if (c->fds[i] >= 0)
			set_nonblock(c->fds[i]);
	if (c->in_fd >= 0)
		set_nonblock(c->in_fd);
	if (c->timeout_ms && c->timeout_ms < (1ULL << 40)) /* larger: effectively none */
		c->deadline = c->t_start + (int64_t)c->timeout_ms * 1000;
	putf(c, 'p', "%d", (int)c->pid);
	c->state = S_RUN;
}

/* Forward one read from the child's stdout (i=0) or stderr (i=1). Called only
 * when the output buffer has room for a whole chunk, or past the limit. */
static void pipe_read(struct conn *c, int i)
{
	unsigned long long room = c->bytes[i] < c->limit ? c->limit - c->bytes[i] : 0;
	ssize_t n;

	if (room && ensure_ob(c)) {
		compact(c);
		n = read(c->fds[i], c->ob + c->olen + 5, CHUNK);
		if (n > 0) {
			size_t keep = (unsigned long long)n < room ? (size_t)n : (size_t)room;
			put_hdr(c->ob + c->olen, i ? 'r' : 'o', keep);
			c->olen += 5 + keep;
			if (keep < (size_t)n)
				c->trunc[i] = 1;
		}
	} else {
		n = read(c->fds[i], scratch, sizeof scratch);
		if (n > 0)
			c->trunc[i] = 1;
	}
	if (n > 0)
		c->bytes[i] += n;
	else if (n == 0 || (errno != EAGAIN && errno != EINTR)) { /* a terminal's master: EIO once no slave is open */
		xclose(&c->fds[i]);
		maybe_finish(c);
	}
}

static int pipe_wanted(struct conn *c, int i)
{
	if (c->fds[i] < 0)
		return 0;
	if (c->bytes[i] >= c->limit)
		return 1; /* dropping costs no memory */
	return c->olen - c->ooff + 5 + CHUNK <= OBUF_CAP;
}

static void stdin_push(struct conn *c)
{
	while (c->pend && c->pend_off < c->pend_len) {
		ssize_t n = write(c->in_fd, c->pend + c->pend_off, c->pend_len - c->pend_off);
		if (n < 0) {
			if (errno == EAGAIN || errno == EINTR)
				return; /* wait for POLLOUT; socket reads pause meanwhile */
			drop_stdin(c); /* EPIPE: nobody reads stdin any more */
			return;
		}
		c->pend_off += n;
	}
	free(c->pend);
	c->pend = NULL;
}

static void push_str(char ***arr, int *n, char *s)
{
	char **a = realloc(*arr, (*n + 2) * sizeof *a);
	if (!a) {
		free(s);
		return;
	}
	a[(*n)++] = s;
	a[*n] = NULL;
	*arr = a;
}

static unsigned long long parse_num(struct conn *c, const char *s)
{
	char *end;
	errno = 0;
	unsigned long long v = strtoull(s, &end, 10);
	if (errno || end == s || *end || *s == '-')
		c->bad = 1;
	return v;
}

/* `y` payload: "ROWS COLS", each 1 to 65535 (a struct winsize's fields). */
static void parse_size(struct conn *c, char *pl)
{
	char *rows = strtok(pl, " "), *cols = strtok(NULL, " ");
	unsigned long long r, k;

	if (!rows || !cols || strtok(NULL, " ")) {
		c->bad = 1;
		return;
	}
	r = parse_num(c, rows);
	k = parse_num(c, cols);
	if (!r || !k || r > 65535 || k > 65535)
		c->bad = 1;
	else
		c->rows = (unsigned short)r, c->cols = (unsigned short)k;
}

/* A uid or gid: (uid_t)-1 means "unchanged" to the kernel, so it is refused too. */
static unsigned long long parse_id(struct conn *c, const char *s)
{
	unsigned long long v = parse_num(c, s);
	if (v >= 0xffffffffULL)
		c->bad = 1;
	return v;
}

/* `u` payload: "UID GID" then, optionally, " G1,G2,..." (the supplementary groups). */
static void parse_user(struct conn *c, char *pl)
{
	char *uid = strtok(pl, " "), *gid = strtok(NULL, " "), *groups = strtok(NULL, " "), *g;

	free(c->user);
	if (!uid || !gid || strtok(NULL, " ") || !(c->user = calloc(1, sizeof *c->user))) {
		c->bad = 1;
		return;
	}
	c->user->uid = (uid_t)parse_id(c, uid);
	c->user->gid = (gid_t)parse_id(c, gid);
	for (g = groups ? strtok(groups, ",") : NULL; g; g = strtok(NULL, ",")) {
		if (c->user->ngroups == MAX_GROUPS) {
			c->bad = 1;
			return;
		}
		c->user->groups[c->user->ngroups++] = (gid_t)parse_id(c, g);
	}
}

/* ---- the host's key: HMAC-SHA256 ---------------------------------------- */

/* Under gVisor the host gives its first `g` a key (nothing of the sandbox runs before it), which
 * then proves requests both ways: the host's `q` (a MAC over a nonce of ours, `n`), and our `t` (a
 * MAC over the host's nonce, given only once our --listen path is seen to lead to us). */
struct sha256 {
	uint32_t h[8];
	uint64_t len;
	unsigned char buf[64];
	size_t n;
};

static const uint32_t sha256_k[64] = {
	0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
	0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
	0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
	0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
	0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
	0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
	0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
	0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

#define ROR(x, n) ((x) >> (n) | (x) << (32 - (n)))

static void sha256_block(struct sha256 *s, const unsigned char *p)
{
	uint32_t w[64], v[8], t1, t2;
	for (int i = 0; i < 16; i++)
		w[i] = (uint32_t)p[4 * i] << 24 | p[4 * i + 1] << 16 | p[4 * i + 2] << 8 | p[4 * i + 3];
	for (int i = 16; i < 64; i++)
		w[i] = w[i - 16] + (ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ w[i - 15] >> 3) + w[i - 7] +
		       (ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ w[i - 2] >> 10);
	memcpy(v, s->h, sizeof v);
	for (int i = 0; i < 64; i++) {
		t1 = v[7] + (ROR(v[4], 6) ^ ROR(v[4], 11) ^ ROR(v[4], 25)) + ((v[4] & v[5]) ^ (~v[4] & v[6])) +
		     sha256_k[i] + w[i];
		t2 = (ROR(v[0], 2) ^ ROR(v[0], 13) ^ ROR(v[0], 22)) + ((v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]));
		memmove(v + 1, v, 7 * sizeof *v);
		v[4] += t1;
		v[0] = t1 + t2;
	}
	for (int i = 0; i < 8; i++)
		s->h[i] += v[i];
}

static void sha256_init(struct sha256 *s)
{
	static const uint32_t h0[8] = { 0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
					0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19 };
	memcpy(s->h, h0, sizeof h0);
	s->len = s->n = 0;
}

static void sha256_update(struct sha256 *s, const void *data, size_t len)
{
	const unsigned char *p = data;
	s->len += len;
	while (len--) {
		s->buf[s->n++] = *p++;
		if (s->n == 64) {
			sha256_block(s, s->buf);
			s->n = 0;
		}
	}
}

static void sha256_final(struct sha256 *s, unsigned char out[32])
{
	uint64_t bits = s->len * 8;
	unsigned char pad = 0x80;
	sha256_update(s, &pad, 1);
	pad = 0;
	while (s->n != 56)
		sha256_update(s, &pad, 1);
	for (int i = 7; i >= 0; i--) {
		pad = (unsigned char)(bits >> (8 * i));
		sha256_update(s, &pad, 1);
	}
	for (int i = 0; i < 32; i++)
		out[i] = (unsigned char)(s->h[i / 4] >> (24 - 8 * (i % 4)));
}

static void to_hex(const unsigned char *p, size_t n, char *out)
{
	for (size_t i = 0; i < n; i++)
		sprintf(out + 2 * i, "%02x", p[i]);
}

static int is_hex(const char *s, size_t min, size_t max)
{
	size_t n = strspn(s, "0123456789abcdef");
	return !s[n] && n >= min && n <= max;
}

/* hex(HMAC-SHA256(key, "KIND NONCE")) into out (65 bytes) */
static void mac(const char *key, char kind, const char *nonce, char *out)
{
	unsigned char pad[64], inner[32], digest[32];
	struct sha256 s;
	size_t klen = strlen(key); /* 64 hex digits: shorter than a block, used as they are */

	for (int round = 0; round < 2; round++) {
		memset(pad, round ? 0x5c : 0x36, sizeof pad);
		for (size_t i = 0; i < klen; i++)
			pad[i] ^= (unsigned char)key[i];
		sha256_init(&s);
		sha256_update(&s, pad, sizeof pad);
		if (round) {
			sha256_update(&s, inner, sizeof inner);
		} else {
			char head[2] = { kind, ' ' };
			sha256_update(&s, head, 2);
			sha256_update(&s, nonce, strlen(nonce));
		}
		sha256_final(&s, round ? digest : inner);
	}
	to_hex(digest, sizeof digest, out);
}

/* The host's MAC over our nonce, compared in constant time. */
static int mac_ok(char kind, const char *nonce, const char *given)
{
	char want[65];
	unsigned char diff = 0;
	if (!*host_key || strlen(given) != 64)
		return 0;
	mac(host_key, kind, nonce, want);
	for (int i = 0; i < 64; i++)
		diff |= (unsigned char)(want[i] ^ given[i]);
	return diff == 0;
}

static int fresh_nonce(char out[33])
{
	unsigned char raw[16];
	if (getrandom(raw, sizeof raw, 0) != (ssize_t)sizeof raw)
		return -1;
	to_hex(raw, sizeof raw, out);
	return 0;
}

static void drop_listener(void);
static void release_services(void);
static void relay_listen(struct conn *c, char *pl);
static void relay_stop(int port);
static void open_port(struct conn *c, const char *pl);
static void signal_exec(struct conn *c, const char *pl);
static void resize_exec(struct conn *c, const char *pl);
static int listening_at_path(void);

/* Takes ownership of pl (NUL-terminated, n bytes). */
static void handle_frame(struct conn *c, char t, char *pl, uint32_t n)
{
	if (c->kind == K_AUTH) {
		/* the frame after `n`: only a `q` with the host's MAC over our nonce lets go */
		int ok = t == 'q' && mac_ok('q', c->nonce, pl);
		if (ok)
			drop_listener();
		put(c, t == 'q' ? 'q' : 'n', ok ? "ok" : "fail EPERM");
		c->kind = K_PING;
		c->close_after = 1;
	} else if (c->kind == K_NEW) {
		if (t == 'h') {
			c->kind = K_PING;
			put(c, 'h', "fanfold-agent 6");
			c->close_after = 1;
		} else if (t == 'n') {
			c->kind = K_AUTH;
			if (fresh_nonce(c->nonce) == 0) {
				put(c, 'n', c->nonce);
			} else {
				put(c, 'n', "fail EAGAIN");
				c->close_after = 1;
			}
		} else if (t == 'q') {
			/* unproven (a process of the sandbox may send it): the listener stays */
			c->kind = K_PING;
			put(c, 'q', "fail EPERM");
			c->close_after = 1;
		} else if (t == 'g') {
			c->kind = K_PING;
			if (held && !*host_key && is_hex(pl, 64, 64))
				memcpy(host_key, pl, 65); /* nothing of the sandbox has run yet: only the host can say it */
			release_services();
			put(c, 'g', "ok");
			c->close_after = 1;
		} else if (t == 't') {
			char proof[65];
			c->kind = K_PING;
			if (!n) {
				put(c, 't', ""); /* no nonce, no proof */
			} else if (is_hex(pl, 32, 64) && *host_key && listening_at_path()) {
				mac(host_key, 't', pl, proof);
				put(c, 't', proof);
			} else {
				put(c, 't', "fail EPERM");
			}
			c->close_after = 1;
		} else if (t == 'k') {
			c->kind = K_PING;
			signal_exec(c, pl); /* a signal of its own: never behind stdin the command does not read */
			c->close_after = 1;
		} else if (t == 'Y') {
			c->kind = K_PING;
			resize_exec(c, pl); /* likewise: a resize never waits behind stdin */
			c->close_after = 1;
		} else if (t == 'w') {
			c->kind = K_WAIT;
			if (ready) {
				put(c, 'w', ready_msg);
				c->close_after = 1;
			}
		} else if (t == 'l' || t == 'L') {
			/* first frame `l`: a relay (an exec's `l`, its output limit, never comes first) */
			c->kind = K_PING;
			if (t == 'l')
				relay_listen(c, pl);
			else {
				relay_stop(atoi(pl));
				put(c, 'L', "ok");
			}
			c->close_after = 1;
		} else if (t == 'o') {
			c->kind = K_PING;
			open_port(c, pl); /* the connection is the splice's now */
		} else if (t && strchr("aectlsuxy", t)) {
			c->kind = K_EXEC;
		} else {
			host_gone(c);
		}
	}
	if (c->kind != K_EXEC) {
		free(pl);
		return;
	}
	if (c->state == S_SETUP) {
		switch (t) {
		case 'a': push_str(&c->argv, &c->argc, pl); return;
		case 'e': push_str(&c->envp, &c->envc, pl); return;
		case 'c': free(c->cwd); c->cwd = pl; return;
		case 't': c->timeout_ms = parse_num(c, pl); break;
		case 'l': c->limit = parse_num(c, pl); break;
		case 's': c->stdin_pipe = strcmp(pl, "pipe") == 0; break;
		case 'u': parse_user(c, pl); break;
		case 'y': parse_size(c, pl); break;
		case 'x': start_exec(c); break;
		default: c->bad = 1; /* a frame we do not know: refuse rather than half-honour */
		}
	} else if (c->state == S_RUN || c->state == S_DRAIN) {
		if (t == 'i' && c->in_fd >= 0) {
			if (n == 0) {
				drop_stdin(c);
			} else {
				c->pend = pl, c->pend_len = n, c->pend_off = 0;
				stdin_push(c);
				return;
			}
		} else if (t == 'k') {
			int sig = atoi(pl);
			if (sig > 0 && sig < NSIG && c->pid > 0)
				kill(-c->pid, sig);
		}
	}
	free(pl);
}

static int want_read(struct conn *c)
{
	return !c->rd_eof && !c->pend && !c->dead &&
	       (c->kind == K_NEW || (c->kind == K_AUTH && !c->close_after) || (c->kind == K_EXEC && c->state != S_DONE));
}

static void conn_read(struct conn *c)
{
	while (want_read(c)) {
		ssize_t n;
		if (c->hgot < 5)
			n = read(c->fd, c->hdr + c->hgot, 5 - c->hgot);
		else /* complete frames are consumed below, so pgot < plen here */
			n = read(c->fd, c->pl + c->pgot, c->plen - c->pgot);
		if (n == 0) {
			/* half-close: treat as end of stdin; a full close shows up as POLLHUP */
			c->rd_eof = 1;
			if (c->kind == K_EXEC)
				drop_stdin(c);
			return;
		}
		if (n < 0) {
			if (errno != EAGAIN && errno != EINTR)
				host_gone(c);
			return;
		}
		if (c->hgot < 5) {
			c->hgot += n;
			if (c->hgot < 5)
				continue;
			c->plen = (uint32_t)c->hdr[1] << 24 | c->hdr[2] << 16 | c->hdr[3] << 8 | c->hdr[4];
			if (c->plen > MAX_FRAME || !(c->pl = malloc(c->plen + 1))) {
				host_gone(c);
				return;
			}
			c->pgot = 0;
		} else {
			c->pgot += n;
		}
		if (c->pgot == c->plen) {
			char *pl = c->pl;
			pl[c->plen] = 0;
			c->pl = NULL;
			c->hgot = 0;
			handle_frame(c, (char)c->hdr[0], pl, c->plen);
		}
	}
}

static void free_conn(struct conn *c)
{
	xclose(&c->fd);
	xclose(&c->fds[0]);
	xclose(&c->fds[1]);
	drop_stdin(c);
	for (int i = 0; i < c->argc; i++)
		free(c->argv[i]);
	for (int i = 0; i < c->envc; i++)
		free(c->envp[i]);
	free(c->argv);
	free(c->envp);
	free(c->cwd);
	free(c->user);
	free(c->pl);
	free(c->ob);
	free(c);
	accept_resume = 0;
}

static void add_conn(int fd)
{
	struct conn *c = calloc(1, sizeof *c);
	if (!c) {
		close(fd);
		return;
	}
	c->fd = fd;
	c->fds[0] = c->fds[1] = c->in_fd = -1;
	c->pi_sock = c->pi_fd[0] = c->pi_fd[1] = c->pi_in = -1;
	c->limit = DEFAULT_LIMIT;
	c->next = conns;
	conns = c;
}

static void do_accept(void)
{
	for (;;) {
		int fd = accept4(listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0) {
			/* out of fds or memory: pause the listener until a connection
			 * ends or 100 ms pass, rather than spin on it */
			if (errno == EMFILE || errno == ENFILE || errno == ENOMEM || errno == ENOBUFS)
				accept_resume = now_us() + DRAIN_US;
			return;
		}
		add_conn(fd);
	}
}

/* `t`: does --listen PATH lead to our listener? Asked once the host has locked the socket's dir, so
 * nothing can make a new way to our listener meanwhile: a process that put its own socket there
 * and passes the host's `t` to us, over connections it made before, gets no proof. We take in what
 * waits first, connect to PATH and write a mark: PATH is ours when a connection carrying it comes. */
static int listening_at_path(void)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	unsigned char mark[16], got[16];
	struct pollfd p = { listen_fd, POLLIN, 0 };
	int probe, fd, mine = 0;

	if (listen_fd < 0 || !listen_path || strlen(listen_path) >= sizeof sa.sun_path ||
	    getrandom(mark, sizeof mark, 0) != (ssize_t)sizeof mark)
		return 0;
	do_accept(); /* connections made before the probe: none of them can carry its mark */
	strcpy(sa.sun_path, listen_path);
	if ((probe = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)) < 0)
		return 0;
	if (connect(probe, (struct sockaddr *)&sa, sizeof sa) == 0 && write(probe, mark, sizeof mark) == sizeof mark) {
		/* a unix connection is queued at its listener once connect returns: the wait is a margin */
		while (!mine && poll(&p, 1, 100) > 0) {
			if ((fd = accept4(listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC)) < 0)
				break;
			struct pollfd q = { fd, POLLIN, 0 };
			mine = poll(&q, 1, 100) > 0 && recv(fd, got, sizeof got, MSG_PEEK) == (ssize_t)sizeof got &&
			       !memcmp(got, mark, sizeof mark);
			if (mine)
				close(fd);
			else
				add_conn(fd); /* someone else's, through PATH too: served as usual */
		}
	}
	close(probe);
	return mine;
}

/* `k PID SIGNAL`: signal the process group of the exec whose command is PID, while it runs. */
static void signal_exec(struct conn *c, const char *pl)
{
	int pid = 0, sig = 0, used = 0;
	const char *answer = "gone";

	if (sscanf(pl, "%d %d%n", &pid, &sig, &used) != 2 || pl[used] || pid <= 0 || sig <= 0 || sig >= NSIG) {
		put(c, 'k', "fail EINVAL");
		return;
	}
	for (struct conn *e = conns; e; e = e->next)
		if (e->kind == K_EXEC && (e->state == S_RUN || e->state == S_DRAIN) && e->pid == pid) {
			kill(-pid, sig);
			answer = "ok";
			break;
		}
	put(c, 'k', answer);
}

/* `Y PID ROWS COLS`: resize the terminal of the exec whose command is PID; the kernel then sends
 * SIGWINCH to the terminal's foreground process group. */
static void resize_exec(struct conn *c, const char *pl)
{
	int pid = 0, rows = 0, cols = 0, used = 0;
	const char *answer = "gone";

	if (sscanf(pl, "%d %d %d%n", &pid, &rows, &cols, &used) != 3 || pl[used] || pid <= 0 || rows < 1 ||
	    rows > 65535 || cols < 1 || cols > 65535) {
		put(c, 'Y', "fail EINVAL");
		return;
	}
	for (struct conn *e = conns; e; e = e->next)
		if (e->kind == K_EXEC && (e->state == S_RUN || e->state == S_DRAIN) && e->pid == pid && e->rows) {
			struct winsize ws = { .ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols };
			int fd = e->fds[0] >= 0 ? e->fds[0] : e->in_fd;
			if (fd >= 0 && ioctl(fd, TIOCSWINSZ, &ws) == 0)
				answer = "ok";
			break;
		}
	put(c, 'Y', answer);
}

/* ---- relays: sandbox networks under gVisor ------------------------------ */

static const char *errno_name(int e)
{
	static char num[16];
	switch (e) {
	case EADDRINUSE: return "EADDRINUSE";
	case EADDRNOTAVAIL: return "EADDRNOTAVAIL";
	case ECONNREFUSED: return "ECONNREFUSED";
	case ECONNRESET: return "ECONNRESET";
	case ETIMEDOUT: return "ETIMEDOUT";
	case ENOENT: return "ENOENT";
	case EACCES: return "EACCES";
	case EINVAL: return "EINVAL";
	case EMFILE: return "EMFILE";
	case ENFILE: return "ENFILE";
	case ENOMEM: return "ENOMEM";
	case ENOBUFS: return "ENOBUFS";
	case EAGAIN: return "EAGAIN";
	}
	snprintf(num, sizeof num, "%d", e);
	return num;
}

static void splice_close(struct splice *s)
{
	xclose(&s->fd[0]);
	xclose(&s->fd[1]);
	s->dead = 1;
}

static struct splice *splice_new(int fd0, int fd1, int port)
{
	struct splice *s = calloc(1, sizeof *s);
	if (s && (!(s->buf[0] = malloc(SPLICE_BUF)) || !(s->buf[1] = malloc(SPLICE_BUF)))) {
		free(s->buf[0]);
		free(s);
		s = NULL;
	}
	if (!s) {
		close(fd0);
		close(fd1);
		return NULL;
	}
	s->fd[0] = fd0;
	s->fd[1] = fd1;
	s->pi[0] = s->pi[1] = -1; /* made this round: not polled yet */
	s->port = port;
	s->next = splices;
	splices = s;
	return s;
}

/* The connect of fd[1] finished with error e (0: connected). */
static void splice_connected(struct splice *s, int e)
{
	s->connecting = 0;
	if (s->answer) {
		/* the frame goes before any byte of the service's: buf[1] is still empty */
		char text[32];
		size_t n = (size_t)snprintf(text, sizeof text, e ? "fail %s" : "ok", errno_name(e));
		put_hdr(s->buf[1], 'o', n);
		memcpy(s->buf[1] + 5, text, n);
		s->len[1] = 5 + n;
		if (e) { /* the host reads the answer, then the end of file */
			xclose(&s->fd[1]);
			s->eof[1] = 1;
			s->eof[0] = s->shut[1] = 1;
		}
		return;
	}
	if (e)
		splice_close(s);
}

/* A non-blocking connect of a new socket to sa; *fd is -1 when there is none to wait for. */
static int connect_to(int family, const struct sockaddr *sa, socklen_t len, int *fd)
{
	int e = 0;
	if ((*fd = socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)) < 0)
		return errno;
	if (connect(*fd, sa, len) == 0)
		return 0;
	if (errno == EINPROGRESS)
		return EINPROGRESS;
	e = errno; /* a unix socket's full backlog is EAGAIN: refused like the rest */
	xclose(fd);
	return e;
}

/* `o PORT`: connect to 127.0.0.1:PORT inside; the rest of the host's connection is spliced to it. */
static void open_port(struct conn *c, const char *pl)
{
	struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	int port = atoi(pl), inside = -1, e = EINVAL;
	struct splice *s;

	if (port > 0 && port < 65536) {
		sa.sin_port = htons(port);
		e = connect_to(AF_INET, (struct sockaddr *)&sa, sizeof sa, &inside);
	}
	s = splice_new(c->fd, inside, 0);
	c->fd = -1;
	c->dead = 1;
	if (!s)
		return;
	s->answer = 1;
	if (e == EINPROGRESS)
		s->connecting = 1;
	else
		splice_connected(s, e);
}

static struct relay *relay_of(int port)
{
	for (struct relay *r = relays; r; r = r->next)
		if (r->port == port)
			return r;
	return NULL;
}

/* `l PORT PATH`: listen on 127.0.0.1:PORT (or keep listening there: a restored sandbox, another
 * engine) and relay each connection to PATH. */
static void relay_listen(struct conn *c, char *pl)
{
	struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	char *space = strchr(pl, ' ');
	int port = atoi(pl), one = 1, fd;
	struct relay *r;

	if (!space || port <= 0 || port > 65535 || space[1] != '/' || strlen(space + 1) >= sizeof r->path) {
		put(c, 'l', "fail EINVAL");
		return;
	}
	if (!(r = relay_of(port))) {
		sa.sin_port = htons(port);
		/* SO_REUSEADDR passes connections in TIME_WAIT, never a listener; no SO_REUSEPORT, so
		 * nothing in the sandbox can listen beside us */
		if ((fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)) < 0 ||
		    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0 ||
		    bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(fd, RELAY_BACKLOG) < 0 ||
		    !(r = calloc(1, sizeof *r))) {
			putf(c, 'l', "fail %s", errno_name(errno));
			if (fd >= 0)
				close(fd);
			return;
		}
		r->fd = fd;
		r->port = port;
		r->next = relays;
		relays = r;
	}
	snprintf(r->path, sizeof r->path, "%s", space + 1);
	r->held = 0;
	put(c, 'l', "ok");
}

/* Close the relayed connections of port (0: every splice, `o` ones included). */
static void splices_close(int port)
{
	for (struct splice *s = splices; s; s = s->next)
		if (!port || s->port == port)
			splice_close(s);
}

/* `L PORT`: stop listening there; its connections end. */
static void relay_stop(int port)
{
	struct relay **pp, *r;
	for (pp = &relays; (r = *pp); pp = &r->next)
		if (r->port == port) {
			*pp = r->next;
			close(r->fd);
			free(r);
			break;
		}
	if (port > 0)
		splices_close(port);
}

/* `q`: every connection to the host ends (gVisor cannot save one), and no new one is made until
 * the host says `l` again; the listeners inside stay (netstack saves them). */
static void relays_hold(void)
{
	splices_close(0);
	for (struct relay *r = relays; r; r = r->next)
		r->held = 1;
}

static void relay_accept(struct relay *r)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fd, host, e;
	struct splice *s;

	strcpy(sa.sun_path, r->path);
	while (!r->held) {
		if ((fd = accept4(r->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC)) < 0) {
			if (errno == EMFILE || errno == ENFILE || errno == ENOMEM || errno == ENOBUFS)
				accept_resume = now_us() + DRAIN_US;
			return;
		}
		e = connect_to(AF_UNIX, (struct sockaddr *)&sa, sizeof sa, &host);
		if (e && e != EINPROGRESS) {
			close(fd); /* the host is not listening: the client sees the connection close */
			continue;
		}
		if ((s = splice_new(fd, host, r->port)))
			s->connecting = e == EINPROGRESS;
	}
}

static short splice_events(struct splice *s, int i)
{
	short ev = 0;
	if (s->fd[i] < 0)
		return 0;
	if (i == 1 && s->connecting)
		return POLLOUT;
	if (!s->connecting && !s->eof[i] && s->len[i] < SPLICE_BUF)
		ev |= POLLIN;
	if (s->len[1 - i] > s->off[1 - i])
		ev |= POLLOUT;
	return ev;
}

static void splice_io(struct splice *s, int i, short revents)
{
	ssize_t n;
	if (i == 1 && s->connecting) {
		int e = 0;
		socklen_t len = sizeof e;
		if (getsockopt(s->fd[1], SOL_SOCKET, SO_ERROR, &e, &len) < 0)
			e = errno;
		splice_connected(s, e);
		return;
	}
	if ((revents & (POLLIN | POLLHUP | POLLERR)) && !s->eof[i] && s->len[i] < SPLICE_BUF) {
		n = read(s->fd[i], s->buf[i] + s->len[i], SPLICE_BUF - s->len[i]);
		if (n > 0)
			s->len[i] += n;
		else if (n == 0)
			s->eof[i] = 1;
		else if (errno != EAGAIN && errno != EINTR)
			return splice_close(s);
	}
	if ((revents & (POLLOUT | POLLERR)) && s->len[1 - i] > s->off[1 - i]) {
		n = write(s->fd[i], s->buf[1 - i] + s->off[1 - i], s->len[1 - i] - s->off[1 - i]);
		if (n < 0 && errno != EAGAIN && errno != EINTR)
			return splice_close(s);
		if (n > 0 && (s->off[1 - i] += n) == s->len[1 - i])
			s->off[1 - i] = s->len[1 - i] = 0;
	}
}

/* Pass each end of file on once what came before it is written; done when both ways are. */
static void splice_settle(struct splice *s)
{
	for (int i = 0; i < 2 && !s->dead; i++)
		if (s->eof[i] && s->len[i] == s->off[i] && !s->shut[1 - i]) {
			s->shut[1 - i] = 1;
			if (s->fd[1 - i] >= 0)
				shutdown(s->fd[1 - i], SHUT_WR);
		}
	if (s->shut[0] && s->shut[1] && s->len[0] == s->off[0] && s->len[1] == s->off[1])
		splice_close(s);
}

static void splices_reap(void)
{
	struct splice **pp, *s;
	for (pp = &splices; (s = *pp);) {
		if (s->dead) {
			*pp = s->next;
			free(s->buf[0]);
			free(s->buf[1]);
			free(s);
			accept_resume = 0;
		} else {
			pp = &s->next;
		}
	}
}

/* ---- services ---------------------------------------------------------- */

static void set_ready(const char *msg)
{
	ready = 1;
	snprintf(ready_msg, sizeof ready_msg, "%s", msg);
	for (struct conn *c = conns; c; c = c->next)
		if (c->kind == K_WAIT && !c->close_after) {
			put(c, 'w', ready_msg);
			c->close_after = 1;
		}
}

static int start_service(struct service *s)
{
	char *argv[] = { "/bin/sh", "-c", (char *)s->cmd, NULL };
	char path[4096];
	int e = 0, log;

	snprintf(path, sizeof path, "%s/var", svc_root);
	mkdir(path, 0755);
	snprintf(path, sizeof path, "%s/var/log", svc_root);
	mkdir(path, 0755);
	snprintf(path, sizeof path, "%s/var/log/fanfold", svc_root);
	mkdir(path, 0755);
	snprintf(path, sizeof path, "%s/var/log/fanfold/%s.log", svc_root, s->name);
	log = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
	if (log < 0)
		log = open("/dev/null", O_WRONLY | O_CLOEXEC);
	s->pid = spawn(argv, environ, *svc_root ? svc_root : "/", NULL, -1, log, log, 0, &e, NULL);
	close(log);
	return s->pid > 0 ? 0 : -1;
}

static void oneshot_failed(struct service *s, int code)
{
	char msg[sizeof ready_msg];
	snprintf(msg, sizeof msg, "fail %.500s %d", s->name, code);
	set_ready(msg);
}

/* Start the next oneshot, or, once all have succeeded, every simple service. */
static void services_next(void)
{
	for (; next_svc < nsvc; next_svc++) {
		if (!svcs[next_svc].oneshot)
			continue;
		if (start_service(&svcs[next_svc]) == 0)
			return; /* resumed when it exits */
		oneshot_failed(&svcs[next_svc], 127);
		return;
	}
	for (int i = 0; i < nsvc; i++)
		if (!svcs[i].oneshot)
			start_service(&svcs[i]);
	set_ready("ok");
}

/* ---- PID 1 duties ------------------------------------------------------ */

/* --init PATH: PID 1 execs PATH (an init such as systemd, which must be PID 1), and the agent goes
 * on as its child, with the listening socket: every process still descends from PID 1, so a
 * checkpoint takes the whole tree. Called once the host has locked the channel dir, so nothing of
 * the sandbox runs before that. Returns in the child. */
static void hand_pid1_to(const char *path)
{
	char *argv[] = { (char *)path, NULL };
	pid_t pid = fork();

	if (pid < 0) {
		perror("fanfold-agent: fork for --init");
		exit(1);
	}
	if (pid == 0)
		return;
	close_range(3, ~0U, 0); /* the listener and every inherited fd stay with the agent */
	execv(path, argv);
	_exit(127); /* PID 1 gone ends the sandbox: the host reports the agent died */
}

static void listen_again(void);

static void reap(void)
{
	struct signalfd_siginfo si;
	pid_t pid;
	int st;

	while (read(sig_fd, &si, sizeof si) > 0)
		if (si.ssi_signo == SIGUSR2)
			listen_again();
	/* signals coalesce, so reap everything, orphans included */
	while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
		for (struct conn *c = conns; c; c = c->next)
			if (c->kind == K_EXEC && c->state == S_RUN && c->pid == pid) {
				c->status = st;
				c->t_end = now_us();
				c->drain_deadline = c->t_end + DRAIN_US;
				c->state = S_DRAIN;
				drop_stdin(c);
				maybe_finish(c);
				break;
			}
		for (int i = 0; i < nsvc; i++)
			if (svcs[i].pid == pid) {
				svcs[i].pid = 0;
				if (!svcs[i].oneshot)
					break;
				if (WIFEXITED(st) && WEXITSTATUS(st) == 0) {
					next_svc++;
					services_next();
				} else {
					oneshot_failed(&svcs[i], WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
				}
				break;
			}
	}
}

static void lo_up(void)
{
	struct ifreq ifr;
	int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (s < 0)
		return;
	memset(&ifr, 0, sizeof ifr);
	strcpy(ifr.ifr_name, "lo");
	if (ioctl(s, SIOCGIFFLAGS, &ifr) == 0) {
		ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
		ioctl(s, SIOCSIFFLAGS, &ifr);
	}
	close(s);
}

/* The addresses a sandbox had beside lo (a group member's on its group's network), given comma-separated
 * as ADDRESS/PREFIX in FANFOLD_RESTORE_ADDRESSES: each bound as a /32 alias of lo (lo:0, lo:1, ...), its
 * network routed to lo (metric 1000), before CRIU binds and connects the sandbox's sockets again, so
 * a connection to another member comes back. Not the address with its prefix on lo: that would make
 * the whole network local, and a restored socket's first segment to its peer would come back to it
 * as a reset. As the member rejoins, its eth0 takes the address and the stand-ins go. */
static void lo_aliases(const char *list)
{
	char buf[256], *save = NULL, *item;
	int s, n = 0;
	if (!list || !*list || strlen(list) >= sizeof buf || (s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0)) < 0)
		return;
	strcpy(buf, list);
	for (item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save), n++) {
		struct ifreq ifr;
		struct rtentry rt;
		struct sockaddr_in *sin = (struct sockaddr_in *)&ifr.ifr_addr;
		char *slash = strchr(item, '/');
		int prefix = slash ? atoi(slash + 1) : 32;
		uint32_t mask;
		if (slash)
			*slash = 0;
		memset(&ifr, 0, sizeof ifr);
		snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "lo:%d", n);
		sin->sin_family = AF_INET;
		if (prefix < 1 || prefix > 32 || inet_pton(AF_INET, item, &sin->sin_addr) != 1 || ioctl(s, SIOCSIFADDR, &ifr) < 0)
			continue;
		sin->sin_addr.s_addr = 0xffffffffu; /* a /32: SIOCSIFADDR alone gives 10.x the classful /8 */
		ioctl(s, SIOCSIFNETMASK, &ifr);
		inet_pton(AF_INET, item, &sin->sin_addr);
		mask = htonl(0xffffffffu << (32 - prefix));
		memset(&rt, 0, sizeof rt);
		((struct sockaddr_in *)&rt.rt_dst)->sin_family = AF_INET;
		((struct sockaddr_in *)&rt.rt_dst)->sin_addr.s_addr = sin->sin_addr.s_addr & mask;
		((struct sockaddr_in *)&rt.rt_genmask)->sin_family = AF_INET;
		((struct sockaddr_in *)&rt.rt_genmask)->sin_addr.s_addr = mask;
		rt.rt_flags = RTF_UP;
		rt.rt_metric = 1001; /* the ioctl's metric is one more than the route's */
		rt.rt_dev = "lo";
		ioctl(s, SIOCADDRT, &rt);
	}
	close(s);
}

static int listen_on(const char *path)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fd;
	if (strlen(path) >= sizeof sa.sun_path)
		return -1;
	strcpy(sa.sun_path, path);
	unlink(path);
	if ((fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0)) < 0)
		return -1;
	if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(fd, SOMAXCONN) < 0) {
		close(fd);
		return -1;
	}
	return fd;
}

/* `q`: close the listener, so that nothing of the host is left in the agent (gVisor
 * cannot checkpoint a socket bound on the host). The gate holds every other request back. */
static void drop_listener(void)
{
	relays_hold();
	if (rebinds && listen_fd >= 0 && listen_path) {
		close(listen_fd);
		listen_fd = -1;
	}
}

/* SIGUSR2 after a `q` (the host, once the checkpoint or restore is done): bind again,
 * unlinking what is at the path first. Ignored while listening. */
static void listen_again(void)
{
	if (listen_fd >= 0 || !listen_path)
		return;
	if ((listen_fd = listen_on(listen_path)) >= 0)
		set_nonblock(listen_fd);
}

/* `g`: the host has locked the channel dir; the services held by --hold may start. */
static void release_services(void)
{
	if (held) {
		held = 0;
		services_next();
	}
}

int main(int argc, char **argv)
{
	int acc = 0, ready_fd = -1;
	socklen_t alen = sizeof acc;
	struct pollfd *pfd = NULL;
	size_t pcap = 0;
	sigset_t mask;

	const char *action = getenv("CRTOOLS_SCRIPT_ACTION");
	if (argc == 1 && action) {
		/* not the agent: CRIU's action script for a restore into an empty network namespace
		 * of its own, run at each stage; once the namespaces exist, bring lo up in it before
		 * the sandbox's sockets are bound again (a shell with nsenter and ip took ~20 ms) */
		const char *init = getenv("CRTOOLS_INIT_PID");
		char path[64];
		int ns;
		if (strcmp(action, "setup-namespaces") || !init)
			return 0;
		snprintf(path, sizeof path, "/proc/%s/ns/net", init);
		if ((ns = open(path, O_RDONLY | O_CLOEXEC)) < 0 || setns(ns, CLONE_NEWNET) < 0) {
			perror("fanfold-agent: joining the restored network namespace");
			return 1;
		}
		lo_up();
		lo_aliases(getenv("FANFOLD_RESTORE_ADDRESSES"));
		return 0;
	}
	if (argc == 3 && !strcmp(argv[1], "--sethostname")) {
		/* not the agent: a one-off run by the host in a restored gVisor sandbox, which keeps
		 * the name of the one it was checkpointed from (the agent itself may not rename it) */
		if (sethostname(argv[2], strlen(argv[2])) < 0) {
			perror("fanfold-agent: sethostname");
			return 1;
		}
		return 0;
	}
	svcs = calloc(argc, sizeof *svcs);
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--listen") && i + 1 < argc) {
			listen_path = argv[++i];
		} else if (!strcmp(argv[i], "--root") && i + 1 < argc) {
			svc_root = strcmp(argv[++i], "/") ? argv[i] : "";
		} else if (!strcmp(argv[i], "--init") && i + 1 < argc) {
			init_path = argv[++i];
		} else if (!strcmp(argv[i], "--hold")) {
			/* no fd 3 to wait on (a runtime that cannot pass one): the host says `g` */
			held = rebinds = 1;
		} else if (!strcmp(argv[i], "--subreaper")) {
			/* not PID 1 (a process of a backend without namespaces): adopt what
			 * commands leave behind, so it stays in our tree and we reap it */
			prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
		} else if (!strcmp(argv[i], "--undumpable")) {
			/* a sandbox with containers inside sees all of /proc: keep its
			 * root out of our memory (/proc/1/mem) */
			prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
		} else if ((!strcmp(argv[i], "--oneshot") || !strcmp(argv[i], "--simple")) && i + 2 < argc) {
			svcs[nsvc].oneshot = argv[i][2] == 'o';
			svcs[nsvc].name = argv[i + 1];
			svcs[nsvc++].cmd = argv[i + 2];
			i += 2;
		} else {
			fprintf(stderr, "fanfold-agent: ignoring argument %s\n", argv[i]);
		}
	}

	/* check fd 3 before opening anything that could land on it */
	if (getsockopt(3, SOL_SOCKET, SO_ACCEPTCONN, &acc, &alen) == 0 && acc)
		listen_fd = 3;
	else if (listen_path && fcntl(3, F_GETFD) >= 0)
		ready_fd = 3; /* the host waits on this pipe until we listen */
	/* keep 0-2 open so pipe fds never land there (see child()) */
	for (int fd = 0; fd < 3; fd++)
		if (fcntl(fd, F_GETFD) < 0 && open("/dev/null", O_RDWR) < 0)
			return 1;
	null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	if (listen_fd < 0 && listen_path)
		listen_fd = listen_on(listen_path);
	if (listen_fd < 0) {
		fprintf(stderr, "fanfold-agent: no listening socket on fd 3 (use --listen PATH)\n");
		return 1;
	}
	if (ready_fd >= 0) {
		int nul = open("/dev/null", O_RDWR);
		/* stdio inherited from the host would tie the sandbox to host files that a
		 * checkpoint cannot carry; from here on our output goes nowhere */
		for (int fd = 0; nul >= 0 && fd < 3; fd++)
			dup2(nul, fd);
		if (nul > 2)
			close(nul);
		if (write(ready_fd, "r", 1) != 1)
			return 1;
		/* on a socket, wait until the host has locked our socket's directory (it closes
		 * its end): no service may run before that (a pipe answers EBADF at once) */
		char go;
		while (read(ready_fd, &go, 1) < 0 && errno == EINTR)
			;
		close(ready_fd);
	}
	if (init_path)
		hand_pid1_to(init_path);
	/* whatever we inherited (fd 3 included) must not leak into commands */
	close_range(3, ~0U, CLOSE_RANGE_CLOEXEC);
	fcntl(listen_fd, F_SETFD, FD_CLOEXEC);
	set_nonblock(listen_fd);

	/* the sandbox is destroyed by SIGKILL from outside; nothing else stops us */
	signal(SIGPIPE, SIG_IGN);
	signal(SIGTERM, SIG_IGN);
	signal(SIGINT, SIG_IGN);
	signal(SIGHUP, SIG_IGN);
	signal(SIGCHLD, SIG_DFL); /* SIG_IGN would auto-reap and hide exit codes */
	sigemptyset(&mask);
	sigaddset(&mask, SIGCHLD);
	sigaddset(&mask, SIGUSR2);
	sigprocmask(SIG_BLOCK, &mask, NULL);
	if ((sig_fd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC)) < 0) {
		perror("fanfold-agent: signalfd");
		return 1;
	}

	/* each exec needs ~5 fds; commands still get the inherited limit */
	if (getrlimit(RLIMIT_NOFILE, &nofile) == 0) {
		struct rlimit raised = { nofile.rlim_max, nofile.rlim_max };
		setrlimit(RLIMIT_NOFILE, &raised);
	}
	lo_up();
	if (!held)
		services_next();

	for (;;) {
		size_t n = 0, cnt = 0;
		struct relay *r;
		struct splice *s;
		int pi_listen = -1, timeout = -1;
		int64_t now = now_us(), next = INT64_MAX;
		struct conn *c, **pp;

		for (c = conns; c; c = c->next)
			cnt += 4;
		for (r = relays; r; r = r->next)
			cnt++;
		for (s = splices; s; s = s->next)
			cnt += 2;
		if (pcap < 2 + cnt) {
			pcap = 2 * (2 + cnt);
			if (!(pfd = realloc(pfd, pcap * sizeof *pfd)))
				abort();
		}
		pfd[n++] = (struct pollfd){ sig_fd, POLLIN, 0 };
		if (listen_fd < 0) {
			/* between a `q` and SIGUSR2: no listener to poll */
		} else if (now >= accept_resume) {
			pi_listen = n;
			pfd[n++] = (struct pollfd){ listen_fd, POLLIN, 0 };
		} else {
			next = accept_resume;
		}
		for (r = relays; r; r = r->next) {
			r->pi = -1;
			if (r->held)
				continue;
			if (now >= accept_resume) {
				r->pi = n;
				pfd[n++] = (struct pollfd){ r->fd, POLLIN, 0 };
			} else if (accept_resume < next) {
				next = accept_resume;
			}
		}
		for (s = splices; s; s = s->next)
			for (int i = 0; i < 2; i++) {
				/* one that wants nothing is not polled: a hang-up would only spin us */
				short ev = splice_events(s, i);
				s->pi[i] = ev ? (int)n : -1;
				if (ev)
					pfd[n++] = (struct pollfd){ s->fd[i], ev, 0 };
			}
		for (c = conns; c; c = c->next) {
			/* always polled: POLLHUP tells us the host went away */
			c->pi_sock = n;
			pfd[n++] = (struct pollfd){ c->fd, (short)((want_read(c) ? POLLIN : 0) |
					(c->olen > c->ooff ? POLLOUT : 0)), 0 };
			for (int i = 0; i < 2; i++) {
				c->pi_fd[i] = -1;
				if (pipe_wanted(c, i)) {
					c->pi_fd[i] = n;
					pfd[n++] = (struct pollfd){ c->fds[i], POLLIN, 0 };
				}
			}
			c->pi_in = -1;
			if (c->pend) {
				c->pi_in = n;
				pfd[n++] = (struct pollfd){ c->in_fd, POLLOUT, 0 };
			}
			if (c->state == S_RUN && c->deadline && c->deadline < next)
				next = c->deadline;
			if (c->state == S_DRAIN && c->drain_deadline < next)
				next = c->drain_deadline;
		}
		if (next != INT64_MAX)
			timeout = next <= now ? 0 : (int)((next - now + 999) / 1000 > 1 << 30
							  ? 1 << 30 : (next - now + 999) / 1000);

		if (poll(pfd, n, timeout) < 0)
			continue;

		if (pfd[0].revents)
			reap();
		if (pi_listen >= 0 && pfd[pi_listen].revents)
			do_accept();
		for (r = relays; r; r = r->next)
			if (r->pi >= 0 && pfd[r->pi].revents)
				relay_accept(r);
		for (s = splices; s; s = s->next) {
			for (int i = 0; i < 2; i++)
				if (!s->dead && s->pi[i] >= 0 && pfd[s->pi[i]].revents)
					splice_io(s, i, pfd[s->pi[i]].revents);
			if (!s->dead)
				splice_settle(s);
		}
		for (c = conns; c; c = c->next) {
			if (c->dead || c->pi_sock < 0)
				continue; /* accepted this round: not polled yet */
			short r = pfd[c->pi_sock].revents;
			if (r & (POLLHUP | POLLERR | POLLNVAL)) {
				host_gone(c);
				continue;
			}
			if (r & POLLIN)
				conn_read(c);
			for (int i = 0; i < 2; i++)
				if (c->pi_fd[i] >= 0 && pfd[c->pi_fd[i]].revents && c->fds[i] >= 0)
					pipe_read(c, i);
			if (c->pi_in >= 0 && pfd[c->pi_in].revents && c->pend)
				stdin_push(c);
		}

		now = now_us();
		for (c = conns; c; c = c->next) {
			if (c->dead)
				continue;
			if (c->state == S_RUN && c->deadline && now >= c->deadline) {
				kill(-c->pid, SIGKILL);
				c->timed_out = 1;
				c->deadline = 0;
			}
			/* a background process may hold the pipes open forever */
			if (c->state == S_DRAIN && now >= c->drain_deadline)
				finish(c);
			flush(c);
		}
		splices_reap();
		for (pp = &conns; (c = *pp);) {
			if (c->dead) {
				*pp = c->next;
				free_conn(c);
			} else {
				pp = &c->next;
			}
		}
	}
}
