// A native backtrace when a process dies of SIGSEGV or SIGBUS (Python's faulthandler prints only the
// Python frames). Loaded with LD_PRELOAD (tools/gpu_session.sh, NATIVE_BACKTRACE=1). Its handler stays
// first: a later sigaction() for these signals (faulthandler's, torch's, a driver's) is kept as the
// handler to call next, so the native frames print first (library + offset; `addr2line -e LIB OFFSET`
// names them where the library has symbols), then the next handler runs (faulthandler: the Python
// frames), then the process dies. The thread that loads it keeps this file's alternate signal stack
// (256 KiB): a later sigaltstack() there (faulthandler's, of a few KiB) is recorded, not applied, as
// a signal frame with AVX-512/AMX state and libgcc's unwinder outgrow a small one (v48: the process
// died without a word). It writes to the stderr the process started with (a copy taken when it loads):
// pytest's capture points fd 2 at a temporary file during each test, which a dying process takes with it.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef int (*sigaction_fn)(int, const struct sigaction *, struct sigaction *);
typedef int (*sigaltstack_fn)(const stack_t *, stack_t *);
static sigaction_fn real_sigaction;
static sigaltstack_fn real_sigaltstack;
static pid_t loader_tid;
static stack_t asked_stack;  // what the loading thread last asked for (reported back as its "old" stack)
static struct sigaction next_action[2];  // SIGSEGV's, SIGBUS's, as others set them
static int installed;
static int out_fd = 2;  // the starting stderr

static int slot(int sig) { return sig == SIGSEGV ? 0 : sig == SIGBUS ? 1 : -1; }

static void die_by(int sig) {
  struct sigaction dfl;
  memset(&dfl, 0, sizeof dfl);
  dfl.sa_handler = SIG_DFL;
  real_sigaction(sig, &dfl, 0);
  raise(sig);
}

static void print_and_chain(int sig, siginfo_t *info, void *context) {
  static volatile sig_atomic_t entered;
  if (entered) die_by(sig);  // the next handler faulted, or re-raised into this one
  entered = 1;
  static const char head[] = "\n=== native backtrace (tools/segv_backtrace.c) ===\n";
  void *frames[128];
  (void)!write(out_fd, head, sizeof head - 1);
  backtrace_symbols_fd(frames, backtrace(frames, 128), out_fd);
  static const char tail[] = "=== end of native backtrace ===\n";
  (void)!write(out_fd, tail, sizeof tail - 1);
  const struct sigaction *next = &next_action[slot(sig)];
  if (next->sa_flags & SA_SIGINFO) {
    if (next->sa_sigaction) next->sa_sigaction(sig, info, context);
  } else if (next->sa_handler != SIG_DFL && next->sa_handler != SIG_IGN) {
    next->sa_handler(sig);
  }
  die_by(sig);
}

// Interposed: the process's own calls for SIGSEGV and SIGBUS set the handler chained to, not the
// installed one.
int sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
  if (!real_sigaction) real_sigaction = (sigaction_fn)dlsym(RTLD_NEXT, "sigaction");
  int i = slot(sig);
  if (!installed || i < 0) return real_sigaction(sig, act, old);
  if (old) *old = next_action[i];
  if (act) next_action[i] = *act;
  return 0;
}

int sigaltstack(const stack_t *ss, stack_t *old) {
  if (!real_sigaltstack) real_sigaltstack = (sigaltstack_fn)dlsym(RTLD_NEXT, "sigaltstack");
  if (!installed || syscall(SYS_gettid) != loader_tid) return real_sigaltstack(ss, old);
  if (old) *old = asked_stack;
  if (ss) asked_stack = *ss;
  return 0;
}

__attribute__((constructor)) static void install(void) {
  real_sigaction = (sigaction_fn)dlsym(RTLD_NEXT, "sigaction");
  real_sigaltstack = (sigaltstack_fn)dlsym(RTLD_NEXT, "sigaltstack");
  loader_tid = (pid_t)syscall(SYS_gettid);
  int copy = fcntl(2, F_DUPFD_CLOEXEC, 200);  // a high number, out of the way of fds others dup2 onto
  if (copy >= 0) out_fd = copy;
  asked_stack.ss_flags = SS_DISABLE;
  // backtrace() loads libgcc_s's unwinder on its first call, which mallocs: done here, not in a
  // handler whose process may have a corrupted heap
  void *prime[1];
  (void)backtrace(prime, 1);
  static char stack[1 << 18];  // the handler's own stack: a stack overflow still gets its backtrace
  stack_t alt = {.ss_sp = stack, .ss_size = sizeof stack, .ss_flags = 0};
  real_sigaltstack(&alt, 0);
  struct sigaction action;
  memset(&action, 0, sizeof action);
  action.sa_sigaction = print_and_chain;
  action.sa_flags = SA_ONSTACK | SA_SIGINFO | SA_NODEFER;
  for (int sig = SIGSEGV, n = 0; n < 2; sig = SIGBUS, n++) {
    real_sigaction(sig, &action, &next_action[slot(sig)]);
  }
  installed = 1;
}
