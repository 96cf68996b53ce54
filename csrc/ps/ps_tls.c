/* TLS for rediss:// through the system's libssl, loaded with dlopen on first use.
 *
 * Why at run time: the library builds with the C compiler alone (no OpenSSL headers, which a fresh
 * CI machine lacks), and libssl itself is present wherever Python's ssl module works (it links
 * it). The few OpenSSL 1.1 / 3 functions used are declared here by their stable ABI.
 */
#include "ps_redis.h"

#include <dlfcn.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SSL_ERROR_WANT_READ 2
#define SSL_ERROR_WANT_WRITE 3
#define SSL_ERROR_ZERO_RETURN 6
#define SSL_VERIFY_NONE 0
#define SSL_VERIFY_PEER 1
#define SSL_FILETYPE_PEM 1
#define SSL_CTRL_SET_TLSEXT_HOSTNAME 55
#define TLSEXT_NAMETYPE_host_name 0

static struct {
    int loaded;
    char why[256];
    const void *(*TLS_client_method)(void);
    void *(*SSL_CTX_new)(const void *);
    void (*SSL_CTX_free)(void *);
    void (*SSL_CTX_set_verify)(void *, int, void *);
    int (*SSL_CTX_load_verify_locations)(void *, const char *, const char *);
    int (*SSL_CTX_set_default_verify_paths)(void *);
    int (*SSL_CTX_use_certificate_chain_file)(void *, const char *);
    int (*SSL_CTX_use_PrivateKey_file)(void *, const char *, int);
    void *(*SSL_new)(void *);
    void (*SSL_free)(void *);
    int (*SSL_set_fd)(void *, int);
    long (*SSL_ctrl)(void *, int, long, void *);
    int (*SSL_set1_host)(void *, const char *);
    int (*SSL_connect)(void *);
    int (*SSL_read)(void *, void *, int);
    int (*SSL_write)(void *, const void *, int);
    int (*SSL_get_error)(const void *, int);
    int (*SSL_shutdown)(void *);
    unsigned long (*ERR_get_error)(void);
    void (*ERR_error_string_n)(unsigned long, char *, size_t);
} S;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void load(void) {
    const char *names[] = {"libssl.so.3", "libssl.so", "libssl.so.1.1"};
    void *h = NULL;
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]) && !h; i++) h = dlopen(names[i], RTLD_NOW | RTLD_GLOBAL);
    if (!h) {
        snprintf(S.why, sizeof(S.why), "rediss:// needs libssl (libssl.so.3 or .so.1.1), which cannot be loaded");
        return;
    }
#define SYM(name)                                                                       \
    if (!(*(void **)&S.name = dlsym(h, #name))) {                                        \
        snprintf(S.why, sizeof(S.why), "the loaded libssl lacks %s", #name);              \
        return;                                                                          \
    }
    SYM(TLS_client_method) SYM(SSL_CTX_new) SYM(SSL_CTX_free) SYM(SSL_CTX_set_verify)
    SYM(SSL_CTX_load_verify_locations) SYM(SSL_CTX_set_default_verify_paths)
    SYM(SSL_CTX_use_certificate_chain_file) SYM(SSL_CTX_use_PrivateKey_file) SYM(SSL_new) SYM(SSL_free)
    SYM(SSL_set_fd) SYM(SSL_ctrl) SYM(SSL_set1_host) SYM(SSL_connect) SYM(SSL_read) SYM(SSL_write)
    SYM(SSL_get_error) SYM(SSL_shutdown) SYM(ERR_get_error) SYM(ERR_error_string_n)
#undef SYM
    S.loaded = 1;
}

struct Tls {
    void *ctx, *ssl;
    short wants; /* what the last call that could not finish waits for */
};

static void ssl_error(const char *what, char *err, size_t errlen) {
    unsigned long e = S.ERR_get_error();
    char text[200] = "unknown error";
    if (e) S.ERR_error_string_n(e, text, sizeof(text));
    snprintf(err, errlen, "TLS %s: %s", what, text);
    while (S.ERR_get_error()) {
    }
}

void ps_tls_close(Tls *t) {
    if (!t) return;
    if (t->ssl) S.SSL_free(t->ssl);
    if (t->ctx) S.SSL_CTX_free(t->ctx);
    free(t);
}

Tls *ps_tls_connect(const TlsConfig *cfg, int fd, const char *host, double timeout, char *err, size_t errlen) {
    pthread_once(&once, load);
    if (!S.loaded) {
        snprintf(err, errlen, "%s", S.why);
        return NULL;
    }
    Tls *t = (Tls *)calloc(1, sizeof(Tls));
    if (!t) return NULL;
    t->ctx = S.SSL_CTX_new(S.TLS_client_method());
    if (!t->ctx) {
        ssl_error("context", err, errlen);
        goto fail;
    }
    S.SSL_CTX_set_verify(t->ctx, cfg->verify ? SSL_VERIFY_PEER : SSL_VERIFY_NONE, NULL);
    if (cfg->verify) {
        int ok = cfg->ca_certs[0] ? S.SSL_CTX_load_verify_locations(t->ctx, cfg->ca_certs, NULL)
                                  : S.SSL_CTX_set_default_verify_paths(t->ctx);
        if (ok != 1) {
            ssl_error("loading CA certificates", err, errlen);
            goto fail;
        }
    }
    if (cfg->certfile[0]) {
        if (S.SSL_CTX_use_certificate_chain_file(t->ctx, cfg->certfile) != 1 ||
            S.SSL_CTX_use_PrivateKey_file(t->ctx, cfg->keyfile[0] ? cfg->keyfile : cfg->certfile, SSL_FILETYPE_PEM) != 1) {
            ssl_error("loading the client certificate", err, errlen);
            goto fail;
        }
    }
    t->ssl = S.SSL_new(t->ctx);
    if (!t->ssl || S.SSL_set_fd(t->ssl, fd) != 1) {
        ssl_error("session", err, errlen);
        goto fail;
    }
    S.SSL_ctrl(t->ssl, SSL_CTRL_SET_TLSEXT_HOSTNAME, TLSEXT_NAMETYPE_host_name, (void *)host);
    if (cfg->verify && cfg->check_hostname && S.SSL_set1_host(t->ssl, host) != 1) {
        ssl_error("host name check", err, errlen);
        goto fail;
    }
    /* the handshake on the non-blocking socket, within the connect timeout */
    const double deadline = ps_now() + timeout;
    for (;;) {
        int r = S.SSL_connect(t->ssl);
        if (r == 1) break;
        int e = S.SSL_get_error(t->ssl, r);
        if (e != SSL_ERROR_WANT_READ && e != SSL_ERROR_WANT_WRITE) {
            ssl_error("handshake", err, errlen);
            goto fail;
        }
        if (!ps_wait_fd(fd, (short)(e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT), deadline)) {
            snprintf(err, errlen, "TLS handshake: timed out");
            goto fail;
        }
    }
    return t;
fail:
    ps_tls_close(t);
    return NULL;
}

static long io_result(Tls *t, int r) {
    if (r > 0) {
        t->wants = 0;
        return r;
    }
    int e = S.SSL_get_error(t->ssl, r);
    if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
        t->wants = e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT;
        return PS_TLS_AGAIN;
    }
    while (S.ERR_get_error()) {
    }
    return e == SSL_ERROR_ZERO_RETURN ? 0 : -1;
}

long ps_tls_read(Tls *t, void *p, size_t n) { return io_result(t, S.SSL_read(t->ssl, p, n > 1 << 30 ? 1 << 30 : (int)n)); }

long ps_tls_write(Tls *t, const void *p, size_t n) {
    return io_result(t, S.SSL_write(t->ssl, p, n > 1 << 30 ? 1 << 30 : (int)n));
}

short ps_tls_wants(const Tls *t) { return t->wants; }
