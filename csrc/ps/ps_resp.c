/* RESP (the Redis protocol) for the staging job's own Redis client (ps_redis.c): commands encoded
 * into a growing buffer, replies measured and read in place, and the byte streams of a connection
 * (plain TCP, a unix socket, or TLS through ps_tls.c) moved without blocking.
 *
 * Why our own: the store's rows went through redis-py under the GIL, a Python callback per table
 * and batch; a batch's pipelines are a few kB of headers around the rows, which C writes and reads
 * at memcpy speed with the GIL left alone.
 */
#include "ps_redis.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <fcntl.h>

/* ------------------------------------------------------------------ buffers */
int buf_reserve(Buf *b, size_t extra) {
    if (b->len + extra <= b->cap) return 1;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra) cap *= 2;
    char *d = (char *)realloc(b->data, cap);
    if (!d) return 0;
    b->data = d;
    b->cap = cap;
    return 1;
}

void buf_release(Buf *b) {
    free(b->data);
    b->data = NULL;
    b->len = b->cap = b->off = 0;
}

static inline void put_raw(Buf *b, const void *p, size_t n) {
    memcpy(b->data + b->len, p, n);
    b->len += n;
}

/* "<c><n>\r\n" (c: '*' or '$', n >= 0): a batch writes one per key and row, so no snprintf
 * (PS v7: it was most of the client's encoding time) */
static inline void put_head(Buf *b, char c, i64 n) {
    char digits[24];
    int k = 0;
    u64 v = (u64)n;
    do {
        digits[k++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    char *p = b->data + b->len;
    *p++ = c;
    while (k) *p++ = digits[--k];
    *p++ = '\r';
    *p++ = '\n';
    b->len = (size_t)(p - b->data);
}

/* Room for an array head of `args` arguments and `bytes` of their contents. */
int resp_reserve(Buf *b, i64 args, i64 bytes) { return buf_reserve(b, (size_t)(32 + args * 24 + bytes)); }

void resp_array(Buf *b, i64 args) { put_head(b, '*', args); }

void resp_bulk(Buf *b, const void *p, i64 n) {
    put_head(b, '$', n);
    put_raw(b, p, (size_t)n);
    put_raw(b, "\r\n", 2);
}

int resp_command(Buf *b, int argc, const char **argv, const i64 *lens) {
    i64 bytes = 0;
    for (int i = 0; i < argc; i++) bytes += lens[i];
    if (!resp_reserve(b, argc, bytes)) return 0;
    resp_array(b, argc);
    for (int i = 0; i < argc; i++) resp_bulk(b, argv[i], lens[i]);
    return 1;
}

/* ------------------------------------------------------------------ replies */
static i64 number(const char *p, const char *end) {
    int neg = 0;
    if (p < end && *p == '-') {
        neg = 1;
        p++;
    }
    i64 v = 0;
    while (p < end && *p >= '0' && *p <= '9') v = v * 10 + (*p++ - '0');
    return neg ? -v : v;
}

i64 resp_reply_len(const char *p, i64 avail) {
    if (avail < 3) return 0;
    const char *nl = (const char *)memchr(p, '\n', (size_t)avail);
    if (!nl) return 0;
    const i64 line = nl - p + 1;
    switch (p[0]) {
    case '+':
    case '-':
    case ':':
        return line;
    case '$': {
        const i64 k = number(p + 1, nl);
        if (k < 0) return line;
        return avail < line + k + 2 ? 0 : line + k + 2;
    }
    case '*': {
        const i64 k = number(p + 1, nl);
        i64 at = line;
        for (i64 i = 0; i < k; i++) {
            const i64 l = resp_reply_len(p + at, avail - at);
            if (l <= 0) return l;
            at += l;
        }
        return at;
    }
    default:
        return -1;
    }
}

i64 resp_header(const char *p, i64 len, i64 *head) {
    const char *nl = (const char *)memchr(p, '\n', (size_t)len);
    *head = nl ? nl - p + 1 : len;
    return number(p + 1, nl ? nl : p + len);
}

/* ------------------------------------------------------------------ connections */
void conn_close(Conn *c) {
    if (c->tls) ps_tls_close(c->tls);
    c->tls = NULL;
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    c->out.len = c->out.off = 0;
    c->in.len = c->in.off = 0;
}

/* A non-blocking socket connected to `host`:`port` (or the unix socket `path`) within `timeout`
 * seconds; -1 with `err` set. */
static int dial(const char *host, int port, const char *path, double timeout, char *err, size_t errlen) {
    const double deadline = ps_now() + timeout;
    if (path && path[0]) {
        struct sockaddr_un a;
        memset(&a, 0, sizeof(a));
        a.sun_family = AF_UNIX;
        if (strlen(path) >= sizeof(a.sun_path)) {
            snprintf(err, errlen, "unix socket path too long");
            return -1;
        }
        strcpy(a.sun_path, path);
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
            snprintf(err, errlen, "connecting to unix socket %s: %s", path, strerror(errno));
            if (fd >= 0) close(fd);
            return -1;
        }
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
        return fd;
    }
    char service[16];
    snprintf(service, sizeof(service), "%d", port);
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    int gai = getaddrinfo(host, service, &hints, &res);
    if (gai != 0) {
        snprintf(err, errlen, "resolving %s: %s", host, gai_strerror(gai));
        return -1;
    }
    int fd = -1;
    snprintf(err, errlen, "connecting to %s:%d: no address", host, port);
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
        if (fd < 0) continue;
        int r = connect(fd, a->ai_addr, a->ai_addrlen);
        if (r != 0 && errno == EINPROGRESS) {
            if (ps_wait_fd(fd, POLLOUT, deadline)) {
                int soerr = 0;
                socklen_t sl = sizeof(soerr);
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
                r = soerr ? -1 : 0;
                errno = soerr;
            } else {
                errno = ETIMEDOUT;
            }
        }
        if (r == 0) break;
        snprintf(err, errlen, "connecting to %s:%d: %s", host, port, strerror(errno));
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd >= 0) {
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    }
    return fd;
}

int conn_open(Conn *c, const char *host, int port, const char *path, const TlsConfig *tls, double timeout,
              char *err, size_t errlen) {
    conn_close(c);
    int fd = dial(host, port, path, timeout, err, errlen);
    if (fd < 0) return -1;
    c->fd = fd;
    if (tls && tls->enabled) {
        c->tls = ps_tls_connect(tls, fd, host, timeout, err, errlen);
        if (!c->tls) {
            conn_close(c);
            return -1;
        }
    }
    return 0;
}

/* Writes what it can of c->out: bytes written (>0), 0 none (done or would block), -1 failed. */
long conn_flush(Conn *c, char *err, size_t errlen) {
    long total = 0;
    while (c->out.off < c->out.len) {
        const size_t want = c->out.len - c->out.off;
        long k;
        if (c->tls) {
            k = ps_tls_write(c->tls, c->out.data + c->out.off, want);
            if (k == PS_TLS_AGAIN) return total;
        } else {
            k = send(c->fd, c->out.data + c->out.off, want, MSG_NOSIGNAL);
            if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return total;
            if (k < 0 && errno == EINTR) continue;
        }
        if (k <= 0) {
            snprintf(err, errlen, "writing to the server: %s", c->tls ? "TLS write failed" : strerror(errno));
            return -1;
        }
        c->out.off += (size_t)k;
        total += k;
    }
    return total;
}

/* Reads what is there into c->in: bytes read (>0), 0 would block, -1 failed or closed. */
long conn_fill(Conn *c, char *err, size_t errlen) {
    if (c->in.off > 0 && c->in.off == c->in.len) c->in.off = c->in.len = 0;
    if (c->in.cap - c->in.len < 65536) {
        if (c->in.off > 0) { /* drop what was read already before growing */
            memmove(c->in.data, c->in.data + c->in.off, c->in.len - c->in.off);
            c->in.len -= c->in.off;
            c->in.off = 0;
        }
        if (!buf_reserve(&c->in, 262144)) {
            snprintf(err, errlen, "out of memory reading a reply");
            return -1;
        }
    }
    long total = 0;
    for (;;) {
        const size_t room = c->in.cap - c->in.len;
        if (room == 0) return total;
        long k;
        if (c->tls) {
            k = ps_tls_read(c->tls, c->in.data + c->in.len, room);
            if (k == PS_TLS_AGAIN) return total;
        } else {
            k = recv(c->fd, c->in.data + c->in.len, room, 0);
            if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return total;
            if (k < 0 && errno == EINTR) continue;
        }
        if (k == 0) {
            snprintf(err, errlen, "the server closed the connection");
            return -1;
        }
        if (k < 0) {
            snprintf(err, errlen, "reading from the server: %s", c->tls ? "TLS read failed" : strerror(errno));
            return -1;
        }
        c->in.len += (size_t)k;
        total += k;
        if ((size_t)k < room && !c->tls) return total;
    }
}

short conn_events(const Conn *c) {
    short ev = POLLIN;
    if (c->out.off < c->out.len) ev |= POLLOUT;
    if (c->tls) ev |= ps_tls_wants(c->tls);
    return ev;
}
