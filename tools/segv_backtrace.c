/* LD_PRELOAD'ed by tools/aoti_probe.py: on SIGSEGV/SIGABRT prints the native stack (library +
 * offset per frame) to stderr, which Python's faulthandler (Python frames only) does not. */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void on_fatal(int sig) {
    void *frames[64];
    int n = backtrace(frames, 64);
    const char msg[] = "\n== native backtrace ==\n";
    write(2, msg, sizeof msg - 1);
    backtrace_symbols_fd(frames, n, 2);
    signal(sig, SIG_DFL);
    raise(sig);
}

__attribute__((constructor)) static void install(void) {
    void *warm[1];
    backtrace(warm, 1); /* loads libgcc's unwinder now, not inside the handler */
    signal(SIGSEGV, on_fatal);
    signal(SIGABRT, on_fatal);
    signal(SIGBUS, on_fatal);
}
