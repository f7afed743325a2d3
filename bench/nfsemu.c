/*
 * nfsemu: a read-only FUSE file system that serves a folder the way a network file system serves
 * it: every read request waits a latency drawn from a distribution, then its bytes cross one link
 * of a capped rate shared by every request. Used by bench/bench_nfs.py.
 *
 *   nfsemu BACKING MOUNTPOINT [--latency SPEC] [--rate BYTES_PER_S] [--max-read BYTES]
 *          [--max-background N] [--seed N] [--stats FILE] [--trace FILE]
 *
 * SPEC: "fixed:0.188" (seconds), or percentiles "p0:0.06,p50:0.126,p90:0.305,p99:1.8,p100:2.0"
 * (the latency's inverse distribution, interpolated log-linearly between the points).
 *
 * The model. A request arrives, waits its latency (a server and a network that answer after a
 * time, whatever else is in flight), and is then ready. Ready requests are served by the link in
 * the order they became ready, one after another at the link's rate (a saturated link delivers
 * the bytes of its flows in some order; the order does not change the total). A request's answer
 * is sent when its last byte has crossed. With no rate, the answer goes when the latency is over.
 * The kernel's FUSE client splits reads into requests of at most --max-read bytes (1 MiB: the
 * rsize of an NFS mount), sends read-ahead and direct I/O concurrently (up to --max-background),
 * and caches pages as an NFS client does.
 *
 * Replies are made from a small pool of threads that wait on one heap of due times, so thousands
 * of requests can be in flight without a thread each. SIGUSR1 appends one line of statistics to
 * --stats (requests, bytes, the peak of requests and bytes in flight, and their mean over the time
 * anything was in flight) and resets them; with --trace, it also appends one line per request
 * answered since the last SIGUSR1 to that file: arrived, ready and answered (seconds since the
 * last SIGUSR1), inode, offset and size.
 */
#define FUSE_USE_VERSION FUSE_MAKE_VERSION(3, 12)
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---------------------------------------------------------------- settings and latency model */

#define MAX_POINTS 16
static double lat_p[MAX_POINTS], lat_v[MAX_POINTS]; /* percentile (0..1) -> seconds */
static int lat_n;
static double rate;            /* bytes per second of the shared link; 0: no cap */
static unsigned max_read = 1 << 20;
static unsigned max_background = 4096;
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static const char *backing;
static const char *stats_path;
static const char *trace_path;

static void die(const char *msg) {
    fprintf(stderr, "nfsemu: %s\n", msg);
    exit(2);
}

static void parse_latency(const char *spec) {
    if (strncmp(spec, "fixed:", 6) == 0) {
        lat_n = 2;
        lat_p[0] = 0, lat_p[1] = 1;
        lat_v[0] = lat_v[1] = atof(spec + 6);
        return;
    }
    char *copy = strdup(spec), *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        double p, v;
        if (lat_n == MAX_POINTS || sscanf(tok, "p%lf:%lf", &p, &v) != 2 || v <= 0)
            die("--latency: expected fixed:SECONDS or pP:SECONDS,... (e.g. p0:0.06,p50:0.126,p100:2)");
        if (lat_n && p / 100 <= lat_p[lat_n - 1]) die("--latency: percentiles must increase");
        lat_p[lat_n] = p / 100, lat_v[lat_n] = v, lat_n++;
    }
    if (lat_n < 2 || lat_p[0] != 0 || lat_p[lat_n - 1] != 1) die("--latency: give p0 and p100");
    free(copy);
}

static double uniform(void) { /* xorshift64*, under the queue's lock */
    rng_state ^= rng_state >> 12, rng_state ^= rng_state << 25, rng_state ^= rng_state >> 27;
    return (double)((rng_state * 2685821657736338717ull) >> 11) / 9007199254740992.0;
}

static double draw_latency(void) {
    double u = uniform();
    for (int i = 1; i < lat_n; i++)
        if (u <= lat_p[i]) {
            double f = (u - lat_p[i - 1]) / (lat_p[i] - lat_p[i - 1]);
            return exp(log(lat_v[i - 1]) + f * (log(lat_v[i]) - log(lat_v[i - 1])));
        }
    return lat_v[lat_n - 1];
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---------------------------------------------------------------- the queue of pending reads */

struct pending {
    double due;  /* when it is ready (phase 0) or answered (phase 1) */
    int phase;
    fuse_req_t req;
    int fd;
    size_t size;
    off_t off;
    double arrived;
    double ready;    /* when its latency was over */
    fuse_ino_t ino;
};

static struct pending *heap;
static size_t heap_len, heap_cap;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed;
static double link_free; /* when the link has sent everything it was given */

/* statistics since the last SIGUSR1 */
static double st_since, st_last, st_req_seconds, st_byte_seconds, st_busy;
static uint64_t st_requests, st_bytes, st_inflight, st_inflight_bytes, st_peak, st_peak_bytes;
static uint64_t st_sizes[8];
/* --trace: one record per answered request since the last SIGUSR1 */
struct trace_rec {
    double arrived, ready, answered;
    uint64_t ino, off, size;
};
static struct trace_rec *trace;
static size_t trace_len, trace_cap;
 /* request sizes: <=4K, <=16K, <=64K, <=128K, <=256K, <=512K, <=1M, more */

static void st_tick(double t) { /* integrate the in-flight counts up to t */
    st_req_seconds += st_inflight * (t - st_last);
    st_byte_seconds += st_inflight_bytes * (t - st_last);
    if (st_inflight) st_busy += t - st_last;
    st_last = t;
}

static void push(struct pending p) {
    if (heap_len == heap_cap) {
        heap_cap = heap_cap ? heap_cap * 2 : 1024;
        heap = realloc(heap, heap_cap * sizeof *heap);
        if (!heap) die("out of memory");
    }
    size_t i = heap_len++;
    while (i && heap[(i - 1) / 2].due > p.due) heap[i] = heap[(i - 1) / 2], i = (i - 1) / 2;
    heap[i] = p;
}

static struct pending pop(void) {
    struct pending top = heap[0], last = heap[--heap_len];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= heap_len) break;
        if (c + 1 < heap_len && heap[c + 1].due < heap[c].due) c++;
        if (heap[c].due >= last.due) break;
        heap[i] = heap[c], i = c;
    }
    if (heap_len) heap[i] = last;
    return top;
}

static void *replier(void *arg) {
    (void)arg;
    char *buf = malloc(max_read);
    if (!buf) die("out of memory");
    pthread_mutex_lock(&lock);
    for (;;) {
        if (!heap_len) {
            pthread_cond_wait(&changed, &lock);
            continue;
        }
        double t = now();
        if (heap[0].due > t) {
            double d = heap[0].due;
            struct timespec ts = {(time_t)d, (long)((d - (time_t)d) * 1e9)};
            pthread_cond_timedwait(&changed, &lock, &ts);
            continue;
        }
        struct pending p = pop();
        if (p.phase == 0) { /* ready: its bytes take their turn on the link */
            p.ready = p.due;
            if (rate > 0) {
                double start = link_free > p.due ? link_free : p.due;
                link_free = start + p.size / rate;
                p.due = link_free;
            }
            p.phase = 1;
            push(p);
            pthread_cond_signal(&changed);
            continue;
        }
        pthread_mutex_unlock(&lock);
        ssize_t n = pread(p.fd, buf, p.size, p.off);
        if (n < 0)
            fuse_reply_err(p.req, errno);
        else
            fuse_reply_buf(p.req, buf, (size_t)n);
        pthread_mutex_lock(&lock);
        double t_done = now();
        st_tick(t_done);
        st_inflight--, st_inflight_bytes -= p.size;
        if (trace_path) {
            if (trace_len == trace_cap) {
                trace_cap = trace_cap ? trace_cap * 2 : 4096;
                trace = realloc(trace, trace_cap * sizeof *trace);
                if (!trace) die("out of memory");
            }
            trace[trace_len++] = (struct trace_rec){p.arrived, p.ready, t_done, p.ino, (uint64_t)p.off, p.size};
        }
    }
    return NULL;
}

/* ---------------------------------------------------------------- inodes: a path per number */

static char **paths; /* paths[ino - 1], relative to backing ("" is the root) */
static size_t n_paths, cap_paths;
static pthread_mutex_t paths_lock = PTHREAD_MUTEX_INITIALIZER;

static fuse_ino_t ino_for(const char *rel) {
    pthread_mutex_lock(&paths_lock);
    for (size_t i = 0; i < n_paths; i++)
        if (strcmp(paths[i], rel) == 0) {
            pthread_mutex_unlock(&paths_lock);
            return i + 1;
        }
    if (n_paths == cap_paths) {
        cap_paths = cap_paths ? cap_paths * 2 : 64;
        paths = realloc(paths, cap_paths * sizeof *paths);
    }
    paths[n_paths++] = strdup(rel);
    fuse_ino_t ino = n_paths;
    pthread_mutex_unlock(&paths_lock);
    return ino;
}

static void full_path(fuse_ino_t ino, char *out, size_t len) {
    pthread_mutex_lock(&paths_lock);
    const char *rel = ino >= 1 && ino <= n_paths ? paths[ino - 1] : "";
    snprintf(out, len, "%s%s%s", backing, *rel ? "/" : "", rel);
    pthread_mutex_unlock(&paths_lock);
}

static int stat_ino(fuse_ino_t ino, struct stat *st) {
    char p[4096];
    full_path(ino, p, sizeof p);
    if (lstat(p, st) < 0) return errno;
    st->st_ino = ino;
    st->st_mode &= ~0222; /* read-only */
    return 0;
}

/* ---------------------------------------------------------------- operations */

static void op_init(void *userdata, struct fuse_conn_info *conn) {
    (void)userdata;
    conn->max_read = max_read;
    conn->max_write = max_read; /* the kernel takes its request size in pages from this */
    conn->max_readahead = 16u << 20;
    conn->max_background = max_background;
    conn->congestion_threshold = max_background * 3 / 4;
    if (conn->capable & FUSE_CAP_ASYNC_DIO) conn->want |= FUSE_CAP_ASYNC_DIO;
    if (conn->capable & FUSE_CAP_ASYNC_READ) conn->want |= FUSE_CAP_ASYNC_READ;
    if (conn->capable & FUSE_CAP_SPLICE_WRITE) conn->want &= ~FUSE_CAP_SPLICE_WRITE;
}

static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name) {
    char rel[4096];
    pthread_mutex_lock(&paths_lock);
    const char *base = parent >= 1 && parent <= n_paths ? paths[parent - 1] : "";
    snprintf(rel, sizeof rel, "%s%s%s", base, *base ? "/" : "", name);
    pthread_mutex_unlock(&paths_lock);
    char p[8192];
    snprintf(p, sizeof p, "%s/%s", backing, rel);
    struct fuse_entry_param e = {0};
    if (lstat(p, &e.attr) < 0) {
        fuse_reply_err(req, errno);
        return;
    }
    e.ino = ino_for(rel);
    e.attr.st_ino = e.ino;
    e.attr.st_mode &= ~0222;
    e.attr_timeout = e.entry_timeout = 3600;
    fuse_reply_entry(req, &e);
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    (void)fi;
    struct stat st;
    int err = stat_ino(ino, &st);
    if (err)
        fuse_reply_err(req, err);
    else
        fuse_reply_attr(req, &st, 3600);
}

static void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    if ((fi->flags & O_ACCMODE) != O_RDONLY) {
        fuse_reply_err(req, EROFS);
        return;
    }
    char p[4096];
    full_path(ino, p, sizeof p);
    int fd = open(p, O_RDONLY);
    if (fd < 0) {
        fuse_reply_err(req, errno);
        return;
    }
    fi->fh = (uint64_t)fd;
    fi->keep_cache = 1; /* as an NFS client keeps an unchanged file's pages across opens */
    fuse_reply_open(req, fi);
}

static void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi) {
    pthread_mutex_lock(&lock);
    double t = now();
    struct pending p = {t + draw_latency(), 0, req, (int)fi->fh, size, off, t, 0, ino};
    push(p);
    st_tick(t);
    st_requests++, st_bytes += size, st_inflight++, st_inflight_bytes += size;
    if (st_inflight > st_peak) st_peak = st_inflight;
    if (st_inflight_bytes > st_peak_bytes) st_peak_bytes = st_inflight_bytes;
    static const size_t limits[7] = {4 << 10, 16 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20};
    int b = 0;
    while (b < 7 && size > limits[b]) b++;
    st_sizes[b]++;
    pthread_cond_signal(&changed);
    pthread_mutex_unlock(&lock);
}

static void op_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    (void)ino;
    close((int)fi->fh);
    fuse_reply_err(req, 0);
}

static void op_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi) {
    (void)fi;
    char p[4096], rel[8192];
    full_path(ino, p, sizeof p);
    DIR *d = opendir(p);
    if (!d) {
        fuse_reply_err(req, errno);
        return;
    }
    pthread_mutex_lock(&paths_lock);
    const char *base = ino >= 1 && ino <= n_paths ? paths[ino - 1] : "";
    char basecopy[4096];
    snprintf(basecopy, sizeof basecopy, "%s", base);
    pthread_mutex_unlock(&paths_lock);
    char *buf = malloc(size);
    size_t used = 0;
    off_t i = 0;
    for (struct dirent *de; (de = readdir(d)); i++) {
        if (i < off) continue;
        struct stat st = {0};
        snprintf(rel, sizeof rel, "%s%s%s", basecopy, *basecopy ? "/" : "", de->d_name);
        st.st_ino = strcmp(de->d_name, ".") && strcmp(de->d_name, "..") ? ino_for(rel) : ino;
        st.st_mode = (mode_t)de->d_type << 12;
        size_t need = fuse_add_direntry(req, buf + used, size - used, de->d_name, &st, i + 1);
        if (need > size - used) break;
        used += need;
    }
    closedir(d);
    fuse_reply_buf(req, buf, used);
    free(buf);
}

static const struct fuse_lowlevel_ops ops = {
    .init = op_init,
    .lookup = op_lookup,
    .getattr = op_getattr,
    .open = op_open,
    .read = op_read,
    .release = op_release,
    .opendir = NULL,
    .readdir = op_readdir,
};

/* ---------------------------------------------------------------- statistics and main */

static void *stats_writer(void *arg) {
    sigset_t *set = arg;
    for (int sig; sigwait(set, &sig) == 0;) {
        if (sig != SIGUSR1) continue;
        pthread_mutex_lock(&lock);
        double t = now();
        st_tick(t);
        double span = t - st_since;
        FILE *f = stats_path ? fopen(stats_path, "a") : stderr;
        if (f) {
            fprintf(f,
                    "{\"seconds\": %.3f, \"busy_seconds\": %.3f, \"requests\": %llu, \"bytes\": %llu, \"mean_in_flight\": %.1f, "
                    "\"mean_bytes_in_flight\": %.0f, \"peak_in_flight\": %llu, \"peak_bytes_in_flight\": %llu, "
                    "\"sizes\": {\"4K\": %llu, \"16K\": %llu, \"64K\": %llu, \"128K\": %llu, \"256K\": %llu, "
                    "\"512K\": %llu, \"1M\": %llu, \"more\": %llu}}\n",
                    span, st_busy, (unsigned long long)st_requests, (unsigned long long)st_bytes,
                    st_busy > 0 ? st_req_seconds / st_busy : 0, st_busy > 0 ? st_byte_seconds / st_busy : 0,
                    (unsigned long long)st_peak, (unsigned long long)st_peak_bytes,
                    (unsigned long long)st_sizes[0], (unsigned long long)st_sizes[1],
                    (unsigned long long)st_sizes[2], (unsigned long long)st_sizes[3],
                    (unsigned long long)st_sizes[4], (unsigned long long)st_sizes[5],
                    (unsigned long long)st_sizes[6], (unsigned long long)st_sizes[7]);
            if (f != stderr) fclose(f);
        }
        if (trace_path && trace_len) {
            FILE *tf = fopen(trace_path, "a");
            if (tf) {
                for (size_t i = 0; i < trace_len; i++)
                    fprintf(tf, "%.6f %.6f %.6f %llu %llu %llu\n", trace[i].arrived - st_since,
                            trace[i].ready - st_since, trace[i].answered - st_since,
                            (unsigned long long)trace[i].ino, (unsigned long long)trace[i].off,
                            (unsigned long long)trace[i].size);
                fclose(tf);
            }
        }
        trace_len = 0;
        st_since = t, st_req_seconds = st_byte_seconds = st_busy = 0;
        st_requests = st_bytes = 0, st_peak = st_inflight, st_peak_bytes = st_inflight_bytes;
        memset(st_sizes, 0, sizeof st_sizes);
        pthread_mutex_unlock(&lock);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 3) die("usage: nfsemu BACKING MOUNTPOINT [--latency SPEC] [--rate B/s] [--max-read B] ...");
    backing = realpath(argv[1], NULL);
    if (!backing) die("BACKING: no such folder");
    const char *mountpoint = argv[2];
    parse_latency("fixed:0");
    for (int i = 3; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--latency")) lat_n = 0, parse_latency(argv[i + 1]);
        else if (!strcmp(argv[i], "--rate")) rate = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--max-read")) max_read = (unsigned)atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--max-background")) max_background = (unsigned)atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--seed")) rng_state ^= (uint64_t)atoll(argv[i + 1]) * 0x2545F4914F6CDD1Dull;
        else if (!strcmp(argv[i], "--stats")) stats_path = argv[i + 1];
        else if (!strcmp(argv[i], "--trace")) trace_path = argv[i + 1];
        else die("unknown option");
    }
    paths = NULL;
    ino_for(""); /* the root is inode 1 */

    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&changed, &ca);
    st_since = st_last = now();

    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGUSR1);
    pthread_sigmask(SIG_BLOCK, &set, NULL); /* every thread; the stats thread waits for it */
    pthread_t t;
    pthread_create(&t, NULL, stats_writer, &set);
    for (int i = 0; i < 4; i++) pthread_create(&t, NULL, replier, NULL);

    char opt[128];
    snprintf(opt, sizeof opt, "-oro,fsname=nfsemu,max_read=%u", max_read);
    char *fargv[] = {argv[0], opt, NULL};
    struct fuse_args args = FUSE_ARGS_INIT(2, fargv);
    struct fuse_session *se = fuse_session_new(&args, &ops, sizeof ops, NULL);
    if (!se) die("fuse_session_new failed");
    if (fuse_set_signal_handlers(se) != 0) die("signal handlers");
    if (fuse_session_mount(se, mountpoint) != 0) die("mount failed (is /dev/fuse there, and are we root?)");
    struct fuse_loop_config *cfg = fuse_loop_cfg_create();
    fuse_loop_cfg_set_max_threads(cfg, 64);
    fuse_loop_cfg_set_idle_threads(cfg, 16);
    int rc = fuse_session_loop_mt(se, cfg);
    fuse_session_unmount(se);
    fuse_remove_signal_handlers(se);
    fuse_session_destroy(se);
    return rc ? 1 : 0;
}
