// A native backtrace when a process dies of SIGSEGV or SIGBUS (Python's faulthandler prints only the
// Python frames). Loaded with LD_PRELOAD (tools/gpu_session.sh, NATIVE_BACKTRACE=1): faulthandler,
// installed later, prints its dump and re-raises to this handler, which prints the native frames
// (library + offset; `addr2line -e LIB OFFSET` names them where the library has symbols) and dies.
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void print_and_die(int sig) {
  static const char head[] = "\n=== native backtrace (tools/segv_backtrace.c) ===\n";
  void *frames[128];
  (void)!write(2, head, sizeof head - 1);
  backtrace_symbols_fd(frames, backtrace(frames, 128), 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  // backtrace() loads libgcc_s's unwinder on its first call, which mallocs: done here, not in a
  // handler whose process may have a corrupted heap (the handler then died silently)
  void *prime[1];
  (void)backtrace(prime, 1);
  static char stack[1 << 16];  // the handler's own stack: a stack overflow still gets its backtrace
  stack_t alt = {.ss_sp = stack, .ss_size = sizeof stack, .ss_flags = 0};
  struct sigaction action;
  sigaltstack(&alt, 0);
  memset(&action, 0, sizeof action);
  action.sa_handler = print_and_die;
  action.sa_flags = SA_ONSTACK;
  sigaction(SIGSEGV, &action, 0);
  sigaction(SIGBUS, &action, 0);
}
