/* The redis:// / unix:// / rediss:// / redis+cluster:// row store, spoken by the staging job itself
 * (recom_rec/ps/stores/redis_store.py opens it; the Python client keeps the control path: PING,
 * SCAN, DEL).
 *
 * Layout, as redis_store.py's: the row of (table, id) is the value of the key
 * "{prefix}:{table}:" + the id as 8 bytes little-endian, holding the row's raw bytes; on a cluster
 * the key starts with a hash tag, "{" + tag + "}", one of CLUSTER_BUCKETS (see make_key).
 *
 * A batch's get or put is pipelined: MGET / MSET commands of up to MGET_KEYS keys each; on a
 * cluster one per hash tag (slot) and kind, on the connection of the slot's master, every
 * master's pipeline written and read at once on non-blocking sockets under one poll. A -MOVED
 * reply refreshes the slot map (CLUSTER SLOTS) and sends the command's keys again to their new
 * master; -ASK sends them to the node named, after ASKING. A slot being migrated answers a
 * command whose keys are partly moved with -TRYAGAIN: the batch is retried, as below.
 *
 * Failures, as redis_store.py's: a connection error, a timeout, -LOADING / -TRYAGAIN /
 * -CLUSTERDOWN / -MASTERDOWN close the connections and the whole batch is sent again (the commands
 * are idempotent) with backoff from 50 ms doubling to 1 s, until retry_timeout seconds since the
 * batch began; then the store is unavailable. Refused credentials and other error replies fail at
 * once. A put returns 0 only when every key's write was acknowledged.
 */
#include "ps_redis.h"

#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define SLOTS 16384
#define MGET_KEYS 512 /* keys per MGET / MSET command */
#define MAX_NODES 256
#define MAX_ROUNDS 16 /* redirections followed in one attempt */
#define BACKOFF_START 0.05
#define BACKOFF_CAP 1.0
#define KEEP_BUFFER ((size_t)16 << 20) /* a connection's buffers larger than this are freed after a batch */

enum { OK = 0, TRANSIENT = 1, FATAL = 2, AUTH_FAILED = 3 };
enum { R_AUTH, R_SELECT, R_MGET, R_MSET, R_ASKING, R_RAW };

/* Counters since the client was made (ps_redis_stats): commands, bytes out, bytes in, rows got,
 * rows put, exchanges, seconds in exchanges, MOVED, ASK, attempts that failed and were retried,
 * CPU seconds of the calling thread in exchanges (the rest of their time it waits for the
 * servers), CPU seconds encoding the commands. */
enum { S_COMMANDS, S_BYTES_OUT, S_BYTES_IN, S_ROWS_GOT, S_ROWS_PUT, S_EXCHANGES, S_SECONDS, S_MOVED, S_ASK,
       S_RETRIES, S_CPU_SECONDS, S_ENCODE_SECONDS, N_STATS };

static double thread_cpu(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

typedef struct {
    int kind;
    i64 first, count; /* positions node->pos[first .. first + count) */
} Req;

typedef struct {
    char host[256];
    int port;
    Conn conn;
    int connected;
    /* this exchange's work */
    i64 *pos;
    i64 n_pos, cap_pos;
    Req *reqs;
    i64 n_reqs, cap_reqs, next;
    int active;
    char *raw; /* an R_RAW reply */
    i64 raw_len;
} Node;

typedef struct RedisClient {
    pthread_mutex_t mu;
    char url[512]; /* redacted */
    int cluster;
    char path[256]; /* unix socket */
    TlsConfig tls;
    char user[256], pass[512];
    int db;
    double connect_timeout, io_timeout, retry_timeout;
    Node *nodes[MAX_NODES];
    int n_nodes;
    int16_t slot_node[SLOTS];
    int slots_known;
    double stats[N_STATS];
} RedisClient;

typedef struct RedisTable {
    RedisClient *c;
    char head[512];
    int head_len;
    char name[256];
    i64 row_bytes;
    int error_kind; /* 1 unavailable, 2 any other failure (ps_redis_take_error) */
    char error[1024];
} RedisTable;

/* One batch operation's state across its exchanges: positions [0, n_put) are the put's keys,
 * [n_put, n_put + n_get) the get's. */
typedef struct {
    RedisTable *t;
    i64 n_put;
    const i64 *put_ids, *get_ids;
    const char *put_rows;
    char *rows; /* the get's */
    uint8_t *found;
    i64 *redo, n_redo;            /* -MOVED: again after the slot map's refresh */
    i64 *ask_pos, n_ask;          /* -ASK: again on ask_node after ASKING */
    int *ask_node;
    char why[512];
} Batch;

/* ------------------------------------------------------------------ slots (as Redis: CRC16-XMODEM) */
/* CRC16 of each byte value (polynomial 0x1021): a byte a step, as Redis computes it; every key
 * of a cluster batch is hashed. */
static const uint16_t CRC16_TABLE[256] = {
    0x0000, 0x1021, 0x2042, 0x3063, 0x4084, 0x50a5, 0x60c6, 0x70e7,
    0x8108, 0x9129, 0xa14a, 0xb16b, 0xc18c, 0xd1ad, 0xe1ce, 0xf1ef,
    0x1231, 0x0210, 0x3273, 0x2252, 0x52b5, 0x4294, 0x72f7, 0x62d6,
    0x9339, 0x8318, 0xb37b, 0xa35a, 0xd3bd, 0xc39c, 0xf3ff, 0xe3de,
    0x2462, 0x3443, 0x0420, 0x1401, 0x64e6, 0x74c7, 0x44a4, 0x5485,
    0xa56a, 0xb54b, 0x8528, 0x9509, 0xe5ee, 0xf5cf, 0xc5ac, 0xd58d,
    0x3653, 0x2672, 0x1611, 0x0630, 0x76d7, 0x66f6, 0x5695, 0x46b4,
    0xb75b, 0xa77a, 0x9719, 0x8738, 0xf7df, 0xe7fe, 0xd79d, 0xc7bc,
    0x48c4, 0x58e5, 0x6886, 0x78a7, 0x0840, 0x1861, 0x2802, 0x3823,
    0xc9cc, 0xd9ed, 0xe98e, 0xf9af, 0x8948, 0x9969, 0xa90a, 0xb92b,
    0x5af5, 0x4ad4, 0x7ab7, 0x6a96, 0x1a71, 0x0a50, 0x3a33, 0x2a12,
    0xdbfd, 0xcbdc, 0xfbbf, 0xeb9e, 0x9b79, 0x8b58, 0xbb3b, 0xab1a,
    0x6ca6, 0x7c87, 0x4ce4, 0x5cc5, 0x2c22, 0x3c03, 0x0c60, 0x1c41,
    0xedae, 0xfd8f, 0xcdec, 0xddcd, 0xad2a, 0xbd0b, 0x8d68, 0x9d49,
    0x7e97, 0x6eb6, 0x5ed5, 0x4ef4, 0x3e13, 0x2e32, 0x1e51, 0x0e70,
    0xff9f, 0xefbe, 0xdfdd, 0xcffc, 0xbf1b, 0xaf3a, 0x9f59, 0x8f78,
    0x9188, 0x81a9, 0xb1ca, 0xa1eb, 0xd10c, 0xc12d, 0xf14e, 0xe16f,
    0x1080, 0x00a1, 0x30c2, 0x20e3, 0x5004, 0x4025, 0x7046, 0x6067,
    0x83b9, 0x9398, 0xa3fb, 0xb3da, 0xc33d, 0xd31c, 0xe37f, 0xf35e,
    0x02b1, 0x1290, 0x22f3, 0x32d2, 0x4235, 0x5214, 0x6277, 0x7256,
    0xb5ea, 0xa5cb, 0x95a8, 0x8589, 0xf56e, 0xe54f, 0xd52c, 0xc50d,
    0x34e2, 0x24c3, 0x14a0, 0x0481, 0x7466, 0x6447, 0x5424, 0x4405,
    0xa7db, 0xb7fa, 0x8799, 0x97b8, 0xe75f, 0xf77e, 0xc71d, 0xd73c,
    0x26d3, 0x36f2, 0x0691, 0x16b0, 0x6657, 0x7676, 0x4615, 0x5634,
    0xd94c, 0xc96d, 0xf90e, 0xe92f, 0x99c8, 0x89e9, 0xb98a, 0xa9ab,
    0x5844, 0x4865, 0x7806, 0x6827, 0x18c0, 0x08e1, 0x3882, 0x28a3,
    0xcb7d, 0xdb5c, 0xeb3f, 0xfb1e, 0x8bf9, 0x9bd8, 0xabbb, 0xbb9a,
    0x4a75, 0x5a54, 0x6a37, 0x7a16, 0x0af1, 0x1ad0, 0x2ab3, 0x3a92,
    0xfd2e, 0xed0f, 0xdd6c, 0xcd4d, 0xbdaa, 0xad8b, 0x9de8, 0x8dc9,
    0x7c26, 0x6c07, 0x5c64, 0x4c45, 0x3ca2, 0x2c83, 0x1ce0, 0x0cc1,
    0xef1f, 0xff3e, 0xcf5d, 0xdf7c, 0xaf9b, 0xbfba, 0x8fd9, 0x9ff8,
    0x6e17, 0x7e36, 0x4e55, 0x5e74, 0x2e93, 0x3eb2, 0x0ed1, 0x1ef0,
};

static uint16_t crc16(const unsigned char *p, i64 n) {
    uint16_t crc = 0;
    for (i64 i = 0; i < n; i++) crc = (uint16_t)((crc << 8) ^ CRC16_TABLE[((crc >> 8) ^ p[i]) & 0xff]);
    return crc;
}

/* The slot of a key: the CRC16 of the part between the first '{' and the next '}' when that part
 * is not empty, else of the whole key. */
int ps_redis_key_slot(const char *key, i64 n) {
    const unsigned char *k = (const unsigned char *)key;
    i64 open = -1;
    for (i64 i = 0; i < n; i++)
        if (k[i] == '{') {
            open = i;
            break;
        }
    if (open >= 0)
        for (i64 j = open + 1; j < n; j++)
            if (k[j] == '}') {
                if (j > open + 1) return crc16(k + open + 1, j - open - 1) & (SLOTS - 1);
                break;
            }
    return crc16(k, n) & (SLOTS - 1);
}

/* A cluster table's keys carry one of CLUSTER_BUCKETS hash tags, so that a command can move many
 * keys (a multi-key command must stay within one slot): the key of (table, id) is
 * "{" tag(bucket(id)) "}" + head + id, bucket(id) the top 6 bits of id * 0x9E3779B97F4A7C15 (mod
 * 2^64), tag(b) the smallest integer j, in decimal, whose slot lies in [b, b + 1) * SLOTS /
 * CLUSTER_BUCKETS: the buckets' slots spread evenly over the slot space, so over the masters'
 * ranges, and a batch of ~1,850 keys makes ~30 keys a command. One server: no tag. */
#define CLUSTER_BUCKETS 64
static char bucket_tag[CLUSTER_BUCKETS][12];
static int bucket_tag_len[CLUSTER_BUCKETS], bucket_slot[CLUSTER_BUCKETS];
static pthread_once_t buckets_once = PTHREAD_ONCE_INIT;

static void make_bucket_tags(void) {
    int left = CLUSTER_BUCKETS;
    for (long j = 0; left > 0; j++) {
        char text[12];
        const int n = snprintf(text, sizeof(text), "%ld", j);
        const int slot = crc16((const unsigned char *)text, n) & (SLOTS - 1);
        const int b = slot * CLUSTER_BUCKETS / SLOTS;
        if (bucket_tag_len[b]) continue;
        memcpy(bucket_tag[b], text, (size_t)n);
        bucket_tag_len[b] = n;
        bucket_slot[b] = slot;
        left--;
    }
}

static inline int bucket_of(i64 id) { return (int)(((u64)id * 0x9E3779B97F4A7C15ULL) >> 58); }

/* The hash tag of bucket b (0..CLUSTER_BUCKETS-1) into out (without braces); its length. */
int ps_redis_bucket_tag(int b, char *out, int len) {
    pthread_once(&buckets_once, make_bucket_tags);
    if (b < 0 || b >= CLUSTER_BUCKETS || len <= bucket_tag_len[b]) return -1;
    memcpy(out, bucket_tag[b], (size_t)bucket_tag_len[b]);
    out[bucket_tag_len[b]] = 0;
    return bucket_tag_len[b];
}

int ps_redis_buckets(void) { return CLUSTER_BUCKETS; }

/* The key of id into key (room for head_len + 24 bytes); its length. */
static inline i64 make_key(const RedisTable *t, i64 id, char *key) {
    i64 at = 0;
    if (t->c->cluster) {
        const int b = bucket_of(id);
        key[0] = '{';
        memcpy(key + 1, bucket_tag[b], (size_t)bucket_tag_len[b]);
        key[1 + bucket_tag_len[b]] = '}';
        at = 2 + bucket_tag_len[b];
    }
    memcpy(key + at, t->head, (size_t)t->head_len);
    for (int b = 0; b < 8; b++) key[at + t->head_len + b] = (char)((u64)id >> (8 * b)); /* little-endian */
    return at + t->head_len + 8;
}

/* ------------------------------------------------------------------ nodes */
static int node_of(RedisClient *c, const char *host, int port) {
    for (int k = 0; k < c->n_nodes; k++)
        if (c->nodes[k]->port == port && strcmp(c->nodes[k]->host, host) == 0) return k;
    if (c->n_nodes == MAX_NODES) return -1;
    Node *nd = (Node *)calloc(1, sizeof(Node));
    if (!nd) return -1;
    snprintf(nd->host, sizeof(nd->host), "%s", host);
    nd->port = port;
    nd->conn.fd = -1;
    c->nodes[c->n_nodes] = nd;
    return c->n_nodes++;
}

static void close_all(RedisClient *c) {
    for (int k = 0; k < c->n_nodes; k++) {
        conn_close(&c->nodes[k]->conn);
        c->nodes[k]->connected = 0;
    }
}

static int add_req(Node *nd, int kind, i64 first, i64 count) {
    Req *reqs = (Req *)ps_room_for_one(nd->reqs, &nd->cap_reqs, nd->n_reqs, sizeof(Req), 64);
    if (!reqs) return 0;
    nd->reqs = reqs;
    nd->reqs[nd->n_reqs++] = (Req){kind, first, count};
    return 1;
}

static int add_pos(Node *nd, i64 p) {
    i64 *pos = (i64 *)ps_room_for_one(nd->pos, &nd->cap_pos, nd->n_pos, sizeof(i64), 256);
    if (!pos) return 0;
    nd->pos = pos;
    nd->pos[nd->n_pos++] = p;
    return 1;
}

static void reset_work(RedisClient *c) {
    for (int k = 0; k < c->n_nodes; k++) {
        Node *nd = c->nodes[k];
        nd->n_pos = nd->n_reqs = nd->next = 0;
        nd->active = 0;
        nd->conn.out.len = nd->conn.out.off = 0;
    }
}

/* Connects node k when it is not (its AUTH and SELECT queued first on the new connection). */
static int ensure_connected(RedisClient *c, int k, char *why, size_t whylen) {
    Node *nd = c->nodes[k];
    nd->active = 1;
    if (nd->connected) return OK;
    const int unix_socket = !c->cluster && c->path[0];
    char err[400];
    if (conn_open(&nd->conn, nd->host, nd->port, unix_socket ? c->path : NULL, &c->tls, c->connect_timeout, err,
                  sizeof(err)) != 0) {
        snprintf(why, whylen, "%s", err);
        return TRANSIENT;
    }
    nd->connected = 1;
    Buf *out = &nd->conn.out;
    if (c->pass[0]) {
        const char *argv[3] = {"AUTH", c->user, c->pass};
        i64 lens[3] = {4, (i64)strlen(c->user), (i64)strlen(c->pass)};
        int with_user = c->user[0] != 0;
        if (!(with_user ? resp_command(out, 3, argv, lens)
                        : resp_command(out, 2, (const char *[]){"AUTH", c->pass}, (i64[]){4, lens[2]})) ||
            !add_req(nd, R_AUTH, 0, 0))
            goto oom;
    }
    if (!c->cluster && c->db != 0) {
        char db[16];
        int n = snprintf(db, sizeof(db), "%d", c->db);
        const char *argv[2] = {"SELECT", db};
        i64 lens[2] = {6, n};
        if (!resp_command(out, 2, argv, lens) || !add_req(nd, R_SELECT, 0, 0)) goto oom;
    }
    return OK;
oom:
    snprintf(why, whylen, "out of memory");
    return FATAL;
}

static inline int is_put(const Batch *b, i64 pos) { return pos < b->n_put; }
static inline i64 id_at(const Batch *b, i64 pos) { return pos < b->n_put ? b->put_ids[pos] : b->get_ids[pos - b->n_put]; }

/* ------------------------------------------------------------------ replies */
static int error_reply(Batch *b, const char *p, i64 len, const char *what) {
    i64 n = len >= 2 ? len - 2 : len; /* without \r\n */
    const char *text = p + 1;
    n -= 1;
    const int transient = (n >= 7 && !memcmp(text, "LOADING", 7)) || (n >= 8 && !memcmp(text, "TRYAGAIN", 8)) ||
                          (n >= 11 && !memcmp(text, "CLUSTERDOWN", 11)) || (n >= 10 && !memcmp(text, "MASTERDOWN", 10));
    const int auth = (n >= 6 && !memcmp(text, "NOAUTH", 6)) || (n >= 9 && !memcmp(text, "WRONGPASS", 9)) ||
                     (n >= 6 && !memcmp(text, "NOPERM", 6)) || (n >= 20 && !memcmp(text, "ERR invalid password", 20));
    snprintf(b->why, sizeof(b->why), "%s: %.*s", what, (int)(n > 300 ? 300 : n), text);
    return auth ? AUTH_FAILED : transient ? TRANSIENT : FATAL;
}

/* A bulk reply (a row or nil) at p into position pos. */
static int take_row(Batch *b, const char *p, i64 len, i64 pos) {
    RedisTable *t = b->t;
    if (p[0] != '$') return error_reply(b, p, len, "GET");
    i64 head;
    const i64 k = resp_header(p, len, &head);
    pos -= b->n_put;
    char *row = b->rows + pos * t->row_bytes;
    if (k < 0) {
        b->found[pos] = 0;
        memset(row, 0, (size_t)t->row_bytes);
        return OK;
    }
    if (k != t->row_bytes) {
        snprintf(b->why, sizeof(b->why),
                 "stored row of table '%s' id %lld has %lld bytes, expected %lld; the table was written with "
                 "another width or dtype",
                 t->name, (long long)b->get_ids[pos], (long long)k, (long long)t->row_bytes);
        return FATAL;
    }
    memcpy(row, p + head, (size_t)k);
    b->found[pos] = 1;
    return OK;
}

/* A -MOVED / -ASK reply to request r (its keys share a slot): its positions are queued for the
 * next round; -1 when the reply is another error. */
static int redirect(RedisClient *c, Batch *b, const char *p, i64 len, const Node *nd, const Req *r) {
    const int moved = len > 7 && !memcmp(p, "-MOVED ", 7), ask = len > 5 && !memcmp(p, "-ASK ", 5);
    if (!moved && !ask) return -1;
    if (moved) {
        for (i64 i = 0; i < r->count; i++) b->redo[b->n_redo++] = nd->pos[r->first + i];
        c->stats[S_MOVED] += 1;
        return OK;
    }
    /* -ASK <slot> <host>:<port> */
    char text[300];
    i64 n = len - 2 < (i64)sizeof(text) - 1 ? len - 2 : (i64)sizeof(text) - 1;
    memcpy(text, p, (size_t)n);
    text[n] = 0;
    char *addr = strchr(text + 5, ' ');
    char *colon = addr ? strrchr(addr, ':') : NULL;
    if (!colon) {
        snprintf(b->why, sizeof(b->why), "malformed redirection: %s", text);
        return FATAL;
    }
    *colon = 0;
    int k = node_of(c, addr + 1, atoi(colon + 1));
    if (k < 0) {
        snprintf(b->why, sizeof(b->why), "too many cluster nodes");
        return FATAL;
    }
    for (i64 i = 0; i < r->count; i++) {
        b->ask_pos[b->n_ask] = nd->pos[r->first + i];
        b->ask_node[b->n_ask++] = k;
    }
    c->stats[S_ASK] += 1;
    return OK;
}

static int handle(RedisClient *c, Batch *b, Node *nd, const Req *r, const char *p, i64 len) {
    c->stats[S_BYTES_IN] += (double)len;
    switch (r->kind) {
    case R_AUTH:
        return p[0] == '-' ? (error_reply(b, p, len, "AUTH"), AUTH_FAILED) : OK;
    case R_SELECT:
    case R_ASKING:
        return p[0] == '+' ? OK : error_reply(b, p, len, r->kind == R_SELECT ? "SELECT" : "ASKING");
    case R_MSET:
        if (p[0] == '+') return OK;
        if (p[0] == '-' && c->cluster) {
            int s = redirect(c, b, p, len, nd, r);
            if (s >= 0) return s;
        }
        return error_reply(b, p, len, "MSET");
    case R_MGET: {
        if (p[0] == '-' && c->cluster) {
            int s = redirect(c, b, p, len, nd, r);
            if (s >= 0) return s;
        }
        if (p[0] != '*') return error_reply(b, p, len, "MGET");
        i64 head;
        const i64 k = resp_header(p, len, &head);
        if (k != r->count) {
            snprintf(b->why, sizeof(b->why), "MGET of %lld keys answered %lld values", (long long)r->count, (long long)k);
            return FATAL;
        }
        const char *q = p + head, *end = p + len;
        for (i64 i = 0; i < k; i++) {
            const i64 l = resp_reply_len(q, end - q);
            int s = take_row(b, q, l, nd->pos[r->first + i]);
            if (s != OK) return s;
            q += l;
        }
        return OK;
    }
    case R_RAW:
        free(nd->raw);
        nd->raw = (char *)malloc((size_t)len);
        if (!nd->raw) return FATAL;
        memcpy(nd->raw, p, (size_t)len);
        nd->raw_len = len;
        return OK;
    }
    return FATAL;
}

/* Sends every active node's pipeline and reads its replies, all nodes at once. */
static int exchange(RedisClient *c, Batch *b) {
    const double start = ps_now(), cpu = thread_cpu();
    struct pollfd fds[MAX_NODES];
    int which[MAX_NODES];
    c->stats[S_EXCHANGES] += 1;
    for (int k = 0; k < c->n_nodes; k++)
        if (c->nodes[k]->active) c->stats[S_BYTES_OUT] += (double)c->nodes[k]->conn.out.len;
    double last = start;
    for (;;) {
        int n = 0;
        for (int k = 0; k < c->n_nodes; k++) {
            Node *nd = c->nodes[k];
            if (!nd->active || nd->next == nd->n_reqs) continue;
            fds[n] = (struct pollfd){nd->conn.fd, conn_events(&nd->conn), 0};
            which[n++] = k;
        }
        if (n == 0) break;
        const int ms = (int)((last + c->io_timeout - ps_now()) * 1000.0);
        const int r = ms > 0 ? poll(fds, (nfds_t)n, ms) : 0;
        if (r == 0) {
            snprintf(b->why, sizeof(b->why), "no reply from %s:%d within %gs", c->nodes[which[0]]->host,
                     c->nodes[which[0]]->port, c->io_timeout);
            return TRANSIENT;
        }
        if (r < 0) continue; /* EINTR */
        for (int i = 0; i < n; i++) {
            Node *nd = c->nodes[which[i]];
            Conn *cn = &nd->conn;
            if (!fds[i].revents && !cn->tls) continue;
            char err[300];
            const long wrote = conn_flush(cn, err, sizeof(err));
            const long read = wrote < 0 ? -1 : conn_fill(cn, err, sizeof(err));
            if (read < 0) {
                snprintf(b->why, sizeof(b->why), "%s:%d: %s", nd->host, nd->port, err);
                return TRANSIENT;
            }
            if (wrote > 0 || read > 0) last = ps_now(); /* the timeout counts from the last progress */
            while (nd->next < nd->n_reqs) {
                const char *p = cn->in.data + cn->in.off;
                const i64 l = resp_reply_len(p, (i64)(cn->in.len - cn->in.off));
                if (l == 0) break;
                if (l < 0) {
                    snprintf(b->why, sizeof(b->why), "%s:%d sent a reply that is not RESP", nd->host, nd->port);
                    return FATAL;
                }
                int s = handle(c, b, nd, &nd->reqs[nd->next], p, l);
                if (s != OK) return s;
                cn->in.off += (size_t)l;
                nd->next++;
            }
        }
    }
    c->stats[S_SECONDS] += ps_now() - start;
    c->stats[S_CPU_SECONDS] += thread_cpu() - cpu;
    return OK;
}

/* ------------------------------------------------------------------ the slot map */
static i64 skip(const char *p, const char *end) { return resp_reply_len(p, end - p); }

static int parse_slots(RedisClient *c, Node *from, Batch *b) {
    const char *p = from->raw, *end = from->raw + from->raw_len;
    if (p[0] != '*') return error_reply(b, p, from->raw_len, "CLUSTER SLOTS");
    for (int s = 0; s < SLOTS; s++) c->slot_node[s] = -1;
    char host[256];
    snprintf(host, sizeof(host), "%s", from->host); /* node_of may move nothing, but keep a copy */
    i64 head;
    const i64 ranges = resp_header(p, end - p, &head);
    p += head;
    for (i64 i = 0; i < ranges; i++) {
        const i64 len = skip(p, end);
        const char *e = p, *e_end = p + len;
        i64 h, items = resp_header(e, len, &h);
        e += h;
        if (items < 3) {
            snprintf(b->why, sizeof(b->why), "a CLUSTER SLOTS entry of %lld items", (long long)items);
            return FATAL;
        }
        const i64 lo = resp_header(e, e_end - e, &h);
        e += skip(e, e_end);
        const i64 hi = resp_header(e, e_end - e, &h);
        e += skip(e, e_end);
        /* the master: [host, port, id, ...] */
        resp_header(e, e_end - e, &h);
        e += h;
        i64 hl = resp_header(e, e_end - e, &h);
        char name[256];
        if (hl < 0 || hl >= (i64)sizeof(name) || e[0] != '$') hl = 0;
        memcpy(name, e + h, (size_t)(hl > 0 ? hl : 0));
        name[hl > 0 ? hl : 0] = 0;
        e += skip(e, e_end);
        const i64 port = resp_header(e, e_end - e, &h);
        if (!name[0] || !strcmp(name, "?")) snprintf(name, sizeof(name), "%s", host);
        int k = node_of(c, name, (int)port);
        if (k < 0) {
            snprintf(b->why, sizeof(b->why), "too many cluster nodes");
            return FATAL;
        }
        for (i64 s = lo; s <= hi && s < SLOTS; s++)
            if (s >= 0) c->slot_node[s] = (int16_t)k;
        p += len;
    }
    c->slots_known = 1;
    return OK;
}

/* CLUSTER SLOTS from the first node that answers (the seeds first). */
static int refresh_slots(RedisClient *c, Batch *b) {
    int status = TRANSIENT;
    snprintf(b->why, sizeof(b->why), "no cluster node answered");
    for (int k = 0; k < c->n_nodes; k++) {
        reset_work(c);
        Node *nd = c->nodes[k];
        status = ensure_connected(c, k, b->why, sizeof(b->why));
        if (status == FATAL) return status;
        if (status != OK) continue;
        if (!resp_command(&nd->conn.out, 2, (const char *[]){"CLUSTER", "SLOTS"}, (i64[]){7, 5}) ||
            !add_req(nd, R_RAW, 0, 0))
            return FATAL;
        status = exchange(c, b);
        if (status == OK) status = parse_slots(c, nd, b);
        if (status == OK || status == FATAL || status == AUTH_FAILED) return status;
        conn_close(&nd->conn);
        nd->connected = 0;
    }
    return status;
}

/* ------------------------------------------------------------------ a batch */
/* The commands of the positions pos[0..n) for node k: MSET / MGET of up to MGET_KEYS keys, a
 * command per run of puts or gets (one server) or per slot and kind (a cluster: a multi-key
 * command stays within one slot; ASKING before each when `asking`). */
static int queue_keys(RedisClient *c, Batch *b, int k, const i64 *pos, i64 n, int asking) {
    const double cpu = thread_cpu();
    RedisTable *t = b->t;
    Node *nd = c->nodes[k];
    int s = ensure_connected(c, k, b->why, sizeof(b->why));
    if (s != OK) return s;
    Buf *out = &nd->conn.out;
    const i64 rb = t->row_bytes;
    char key[600];
    const i64 first = nd->n_pos;
    /* the cluster's positions by (bucket, put before get): a counting sort into the node's list */
    i64 at[2 * CLUSTER_BUCKETS + 1];
    if (c->cluster) {
        memset(at, 0, sizeof(at));
        for (i64 i = 0; i < n; i++) at[2 * bucket_of(id_at(b, pos[i])) + !is_put(b, pos[i]) + 1]++;
        for (int g = 0; g < 2 * CLUSTER_BUCKETS; g++) at[g + 1] += at[g];
        for (i64 i = 0; i < n; i++)
            if (!add_pos(nd, 0)) goto oom;
        for (i64 i = 0; i < n; i++)
            nd->pos[first + at[2 * bucket_of(id_at(b, pos[i])) + !is_put(b, pos[i])]++] = pos[i];
    } else {
        for (i64 i = 0; i < n; i++)
            if (!add_pos(nd, pos[i])) goto oom;
    }
    const i64 *sorted = nd->pos + first;
    for (i64 a = 0; a < n;) {
        const int put = is_put(b, sorted[a]);
        const int bucket = c->cluster ? bucket_of(id_at(b, sorted[a])) : 0;
        i64 m = 1;
        while (a + m < n && m < MGET_KEYS && is_put(b, sorted[a + m]) == put &&
               (!c->cluster || bucket_of(id_at(b, sorted[a + m])) == bucket))
            m++;
        if (!resp_reserve(out, 2 + m * (put ? 2 : 1), 16 + m * (t->head_len + 24 + (put ? rb : 0)))) goto oom;
        if (asking) {
            resp_array(out, 1);
            resp_bulk(out, "ASKING", 6);
            if (!add_req(nd, R_ASKING, 0, 0)) goto oom;
        }
        resp_array(out, 1 + m * (put ? 2 : 1));
        resp_bulk(out, put ? "MSET" : "MGET", 4);
        for (i64 i = a; i < a + m; i++) {
            const i64 key_len = make_key(t, id_at(b, sorted[i]), key);
            resp_bulk(out, key, key_len);
            if (put) resp_bulk(out, b->put_rows + sorted[i] * rb, rb);
        }
        if (!add_req(nd, put ? R_MSET : R_MGET, first + a, m)) goto oom;
        c->stats[S_COMMANDS] += 1 + asking;
        a += m;
    }
    c->stats[S_ENCODE_SECONDS] += thread_cpu() - cpu;
    return OK;
oom:
    snprintf(b->why, sizeof(b->why), "out of memory");
    return FATAL;
}

/* One try at the whole batch: its keys sent where the slot map says, redirections followed. */
static int attempt(RedisClient *c, Batch *b, i64 n, i64 *todo, i64 *group) {
    i64 n_todo = n;
    for (i64 i = 0; i < n; i++) todo[i] = i;
    b->n_ask = 0;
    for (int round = 0; round < MAX_ROUNDS; round++) {
        if (c->cluster && !c->slots_known) {
            int s = refresh_slots(c, b);
            if (s != OK) return s;
        }
        reset_work(c);
        if (!c->cluster) {
            int s = queue_keys(c, b, 0, todo, n_todo, 0);
            if (s != OK) return s;
        } else if (n_todo > 0) {
            /* group the positions by node: counting sort on the slot map's node */
            int *node = (int *)malloc(sizeof(int) * (size_t)n_todo);
            i64 count[MAX_NODES + 1];
            memset(count, 0, sizeof(count));
            if (!node) return FATAL;
            for (i64 i = 0; i < n_todo; i++) {
                const int slot = bucket_slot[bucket_of(id_at(b, todo[i]))];
                node[i] = c->slot_node[slot];
                if (node[i] < 0) {
                    free(node);
                    snprintf(b->why, sizeof(b->why), "slot %d is served by no node", slot);
                    c->slots_known = 0;
                    return TRANSIENT;
                }
                count[node[i] + 1]++;
            }
            for (int k = 0; k < c->n_nodes; k++) count[k + 1] += count[k];
            i64 at[MAX_NODES];
            memcpy(at, count, sizeof(i64) * (size_t)c->n_nodes);
            for (i64 i = 0; i < n_todo; i++) group[at[node[i]]++] = todo[i];
            free(node);
            for (int k = 0; k < c->n_nodes; k++)
                if (count[k + 1] > count[k]) {
                    int s = queue_keys(c, b, k, group + count[k], count[k + 1] - count[k], 0);
                    if (s != OK) return s;
                }
        }
        for (i64 i = 0; i < b->n_ask;) { /* a run of one reply's positions: one node, one slot */
            i64 m = 1;
            while (i + m < b->n_ask && b->ask_node[i + m] == b->ask_node[i]) m++;
            int s = queue_keys(c, b, b->ask_node[i], &b->ask_pos[i], m, 1);
            if (s != OK) return s;
            i += m;
        }
        b->n_redo = b->n_ask = 0;
        int s = exchange(c, b);
        if (s != OK) return s;
        if (b->n_redo == 0 && b->n_ask == 0) return OK;
        if (b->n_redo > 0) c->slots_known = 0; /* -MOVED: the map is out of date */
        memcpy(todo, b->redo, sizeof(i64) * (size_t)b->n_redo);
        n_todo = b->n_redo;
    }
    snprintf(b->why, sizeof(b->why), "still redirected after %d rounds (the cluster is resharding)", MAX_ROUNDS);
    return TRANSIENT;
}

/* A put of n_put rows and a get of n_get (other) ids in one exchange with the store. */
static int run_op(RedisTable *t, const i64 *put_ids, i64 n_put, const char *put_rows, const i64 *get_ids, i64 n_get,
                  char *rows, uint8_t *found) {
    const i64 n = n_put + n_get;
    if (n <= 0) return 0;
    RedisClient *c = t->c;
    const char *what = n_get == 0 ? "put" : n_put == 0 ? "get" : "put and get";
    i64 *scratch = (i64 *)malloc(sizeof(i64) * (size_t)n * 4);
    int *ask_node = (int *)malloc(sizeof(int) * (size_t)n);
    pthread_mutex_lock(&c->mu);
    if (!scratch || !ask_node) {
        free(scratch);
        free(ask_node);
        t->error_kind = 2;
        snprintf(t->error, sizeof(t->error), "%s on %s: out of memory", what, c->url);
        pthread_mutex_unlock(&c->mu);
        return -1;
    }
    Batch b = {t, n_put, put_ids, get_ids, put_rows, rows, found, scratch, 0, scratch + n, 0, ask_node, ""};
    const double deadline = ps_now() + c->retry_timeout;
    double delay = BACKOFF_START;
    int attempts = 0, s;
    for (;;) {
        attempts++;
        s = attempt(c, &b, n, scratch + 2 * n, scratch + 3 * n);
        if (s == OK) break;
        close_all(c); /* replies may be left unread */
        if (c->cluster) c->slots_known = 0;
        if (s != TRANSIENT) break;
        const double remaining = deadline - ps_now();
        if (remaining <= 0) break;
        c->stats[S_RETRIES] += 1;
        const double pause = delay < remaining ? delay : remaining;
        struct timespec ts = {(time_t)pause, (long)((pause - (double)(time_t)pause) * 1e9)};
        nanosleep(&ts, NULL);
        delay = delay * 2 < BACKOFF_CAP ? delay * 2 : BACKOFF_CAP;
    }
    for (int k = 0; k < c->n_nodes; k++) { /* a flush's pipeline of many MB is not kept */
        Conn *cn = &c->nodes[k]->conn;
        if (cn->out.cap > KEEP_BUFFER) buf_release(&cn->out);
        if (cn->in.cap > KEEP_BUFFER && cn->in.off == cn->in.len) buf_release(&cn->in);
    }
    if (s == OK) {
        c->stats[S_ROWS_GOT] += (double)n_get;
        c->stats[S_ROWS_PUT] += (double)n_put;
    } else if (s == TRANSIENT) {
        t->error_kind = 1;
        snprintf(t->error, sizeof(t->error), "%s on %s: store unreachable for %gs (%d attempts), last error: %s", what,
                 c->url, c->retry_timeout, attempts, b.why);
    } else {
        t->error_kind = 2;
        snprintf(t->error, sizeof(t->error), s == AUTH_FAILED ? "%s on %s: authentication failed: %s" : "%s on %s failed: %s",
                 what, c->url, b.why);
    }
    pthread_mutex_unlock(&c->mu);
    free(scratch);
    free(ask_node);
    return s == OK ? 0 : -1;
}

/* ------------------------------------------------------------------ the API (recom_rec/ps/stores/redis_store.py) */
RedisClient *ps_redis_client_new(const char *redacted_url, int cluster, const char *unix_path, const char *user,
                                 const char *password, int db, double connect_timeout, double io_timeout,
                                 double retry_timeout) {
    pthread_once(&buckets_once, make_bucket_tags);
    RedisClient *c = (RedisClient *)calloc(1, sizeof(RedisClient));
    if (!c) return NULL;
    pthread_mutex_init(&c->mu, NULL);
    snprintf(c->url, sizeof(c->url), "%s", redacted_url);
    c->cluster = cluster;
    snprintf(c->path, sizeof(c->path), "%s", unix_path ? unix_path : "");
    snprintf(c->user, sizeof(c->user), "%s", user ? user : "");
    snprintf(c->pass, sizeof(c->pass), "%s", password ? password : "");
    c->db = db;
    c->connect_timeout = connect_timeout;
    c->io_timeout = io_timeout;
    c->retry_timeout = retry_timeout;
    for (int s = 0; s < SLOTS; s++) c->slot_node[s] = -1;
    return c;
}

/* A server (one server: its only node; a cluster: a seed to ask for the slot map). */
int ps_redis_client_add_node(RedisClient *c, const char *host, int port) { return node_of(c, host, port); }

int ps_redis_client_tls(RedisClient *c, int verify, int check_hostname, const char *ca_certs, const char *certfile,
                        const char *keyfile) {
    c->tls.enabled = 1;
    c->tls.verify = verify;
    c->tls.check_hostname = check_hostname;
    snprintf(c->tls.ca_certs, sizeof(c->tls.ca_certs), "%s", ca_certs ? ca_certs : "");
    snprintf(c->tls.certfile, sizeof(c->tls.certfile), "%s", certfile ? certfile : "");
    snprintf(c->tls.keyfile, sizeof(c->tls.keyfile), "%s", keyfile ? keyfile : "");
    return 0;
}

void ps_redis_client_free(RedisClient *c) {
    if (!c) return;
    for (int k = 0; k < c->n_nodes; k++) {
        Node *nd = c->nodes[k];
        conn_close(&nd->conn);
        buf_release(&nd->conn.out);
        buf_release(&nd->conn.in);
        free(nd->pos);
        free(nd->reqs);
        free(nd->raw);
        free(nd);
    }
    memset(c->pass, 0, sizeof(c->pass));
    pthread_mutex_destroy(&c->mu);
    free(c);
}

/* Closes the connections (the next batch opens new ones). */
void ps_redis_client_disconnect(RedisClient *c) {
    pthread_mutex_lock(&c->mu);
    close_all(c);
    c->slots_known = 0;
    pthread_mutex_unlock(&c->mu);
}

/* The counters (N_STATS doubles, see the enum); returns N_STATS. */
int ps_redis_stats(RedisClient *c, double *out) {
    pthread_mutex_lock(&c->mu);
    memcpy(out, c->stats, sizeof(c->stats));
    pthread_mutex_unlock(&c->mu);
    return N_STATS;
}

RedisTable *ps_redis_table_new(RedisClient *c, const char *head, int head_len, const char *name, i64 row_bytes) {
    if (head_len < 0 || head_len > 500) return NULL;
    RedisTable *t = (RedisTable *)calloc(1, sizeof(RedisTable));
    if (!t) return NULL;
    t->c = c;
    memcpy(t->head, head, (size_t)head_len);
    t->head_len = head_len;
    snprintf(t->name, sizeof(t->name), "%s", name);
    t->row_bytes = row_bytes;
    return t;
}

void ps_redis_table_free(RedisTable *t) { free(t); }

/* rows [n, row_bytes] of ids (zeros where absent) and found[n]; 0, or -1 (ps_redis_error). */
int ps_redis_get(RedisTable *t, const i64 *ids, i64 n, char *rows, uint8_t *found) {
    return run_op(t, NULL, 0, NULL, ids, n, rows, found);
}

/* ids unique; 0 once every row's write was acknowledged, else -1 (ps_redis_error). */
int ps_redis_put(RedisTable *t, const i64 *ids, i64 n, const char *rows) {
    return run_op(t, ids, n, rows, NULL, 0, NULL, NULL);
}

/* A put and a get of other ids (the staging job's evictions and misses) in one exchange: the puts
 * first on each connection; 0 once every write was acknowledged and every row read. */
int ps_redis_put_get(RedisTable *t, const i64 *put_ids, i64 n_put, const char *put_rows, const i64 *get_ids,
                     i64 n_get, char *rows, uint8_t *found) {
    return run_op(t, put_ids, n_put, put_rows, get_ids, n_get, rows, found);
}

/* The last failure's kind (0 none, 1 the store was unreachable past retry_timeout, 2 any other) and
 * message into out[len], then forgets it: a failure stays until read, as a later batch (staged
 * ahead) may run before the tier reads it. */
int ps_redis_take_error(RedisTable *t, char *out, int len) {
    pthread_mutex_lock(&t->c->mu);
    const int kind = t->error_kind;
    snprintf(out, (size_t)len, "%s", t->error);
    t->error_kind = 0;
    t->error[0] = 0;
    pthread_mutex_unlock(&t->c->mu);
    return kind;
}

static int redis_store_get(void *ctx, const i64 *ids, i64 n, float *rows, uint8_t *found) {
    return ps_redis_get((RedisTable *)ctx, ids, n, (char *)rows, found);
}

static int redis_store_put(void *ctx, const i64 *ids, i64 n, const float *rows) {
    return ps_redis_put((RedisTable *)ctx, ids, n, (const char *)rows);
}

static int redis_store_put_get(void *ctx, const i64 *put_ids, i64 n_put, const float *put_rows, const i64 *get_ids,
                               i64 n_get, float *rows, uint8_t *found) {
    return ps_redis_put_get((RedisTable *)ctx, put_ids, n_put, (const char *)put_rows, get_ids, n_get, (char *)rows,
                            found);
}

/* A table of float32 rows as a StoreOps (`init` left as the caller set it). */
void ps_redis_store_ops(StoreOps *out, RedisTable *t) {
    out->ctx = t;
    out->get = redis_store_get;
    out->put = redis_store_put;
    out->put_get = redis_store_put_get;
}
