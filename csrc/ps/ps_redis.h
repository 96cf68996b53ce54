/* The staging job's Redis client: RESP and connections (ps_resp.c), TLS through a libssl loaded at
 * run time (ps_tls.c), and the redis:// / unix:// / rediss:// / redis+cluster:// row store
 * (ps_redis.c). */
#ifndef RECOM_REC_PS_REDIS_H
#define RECOM_REC_PS_REDIS_H

#include "ps_host.h"

#include <errno.h>
#include <poll.h>
#include <stddef.h>
#include <time.h>

typedef struct {
    char *data;
    size_t len, cap, off; /* off: the first byte not yet sent (out) or parsed (in) */
} Buf;

/* Whether `fd` is ready for `events` (POLLIN / POLLOUT) before `deadline` (ps_now() seconds). Here,
 * not in ps_resp.c, because the connection (ps_resp.c) and the TLS handshake (ps_tls.c) both wait. */
static inline int ps_wait_fd(int fd, short events, double deadline) {
    for (;;) {
        int ms = (int)((deadline - ps_now()) * 1000.0);
        if (ms < 0) return 0;
        struct pollfd p = {fd, events, 0};
        int r = poll(&p, 1, ms);
        if (r > 0) return 1;
        if (r == 0) return 0;
        if (errno != EINTR) return 0;
    }
}

int buf_reserve(Buf *b, size_t extra);
void buf_release(Buf *b);

int resp_reserve(Buf *b, i64 args, i64 bytes);
void resp_array(Buf *b, i64 args);
void resp_bulk(Buf *b, const void *p, i64 n);
int resp_command(Buf *b, int argc, const char **argv, const i64 *lens);
/* The length of the complete reply at p, 0 while incomplete, -1 when it is not RESP. */
i64 resp_reply_len(const char *p, i64 avail);
/* The number after a reply's type byte ($n, *n, :n), and the length of that line in *head. */
i64 resp_header(const char *p, i64 len, i64 *head);

/* ------------------------------------------------------------------ TLS (ps_tls.c) */
typedef struct {
    int enabled;
    int verify;          /* ssl_cert_reqs=required (default) */
    int check_hostname;  /* ssl_check_hostname */
    char ca_certs[512], certfile[512], keyfile[512];
} TlsConfig;
typedef struct Tls Tls;
#define PS_TLS_AGAIN (-2)
Tls *ps_tls_connect(const TlsConfig *cfg, int fd, const char *host, double timeout, char *err, size_t errlen);
long ps_tls_read(Tls *t, void *p, size_t n);
long ps_tls_write(Tls *t, const void *p, size_t n);
short ps_tls_wants(const Tls *t);
void ps_tls_close(Tls *t);

/* ------------------------------------------------------------------ a connection (ps_resp.c) */
typedef struct {
    int fd;
    Tls *tls;
    Buf out, in;
} Conn;

int conn_open(Conn *c, const char *host, int port, const char *path, const TlsConfig *tls, double timeout,
              char *err, size_t errlen);
void conn_close(Conn *c);
long conn_flush(Conn *c, char *err, size_t errlen);
long conn_fill(Conn *c, char *err, size_t errlen);
short conn_events(const Conn *c);

#endif
