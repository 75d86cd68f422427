/* coll.h — collectives inside the runtime: the kinds (CollKindInfo), what a
 * rank asks for (CollDesc), the thread rendezvous of the local backends, the
 * agreement check, the flight recorder, the watchdog and coll_enqueue
 * (coll_common.c, shared by every backend); each backend queues and runs them
 * (backend.h: coll_enqueue; cpu/coll_cpu.c, cpu/backend_mpi.c, cuda/coll_cuda.c). */
#ifndef HWFSDP_COLL_H
#define HWFSDP_COLL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "runtime/runtime.h"

typedef struct Op Op;

/* The collective kinds (CollKind): runtime.h, where the driver reads them too. */

/* How many elements one buffer of a collective holds. */
typedef enum {
    COLL_BUF_NONE = 0, /* it takes no such buffer */
    COLL_BUF_COUNT,    /* count */
    COLL_BUF_PER_RANK, /* a block of count per group rank: count * group size */
} CollBufSize;

/* NCCL's in-place form: where send may overlap recv (any other overlap races
 * with the peers' copies and is refused). */
typedef enum {
    COLL_INPLACE_NONE = 0, /* nowhere: the two buffers are disjoint */
    COLL_INPLACE_SAME,     /* send == recv */
    COLL_INPLACE_OWN_BLOCK /* the count-sized buffer is this rank's block of the per-rank one (at group rank * count) */
} CollInPlace;

/* The link model's payload per ring pass: what share of the collective's bytes crosses each link. */
typedef enum {
    COLL_LINK_LATENCY_ONLY = 0, /* none: the hops' latency alone */
    COLL_LINK_RING,             /* (n-1)/n of them: every rank's block but its own (ring all-gather) */
    COLL_LINK_WHOLE             /* all of them: every rank receives the whole buffer (pipelined broadcast) */
} CollLinkShare;

/* Everything about a kind except how a backend executes it. */
typedef struct {
    const char *name;          /* messages, the trace, the flight recorder, dev_watch_collectives */
    CollBufSize send, recv;    /* the race detector reads send and writes recv; a NONE buffer is never checked */
    int reduces;               /* takes a RedOp (sum / avg) */
    int rooted;                /* takes a root (a group rank) */
    CollInPlace in_place;
    CollLinkShare link_share;
    int link_passes;           /* ring passes (all-reduce: a reduce-scatter and an all-gather) */
    int p2p;                   /* point to point: its buffers, peers and costs are its items' (P2PBatch), not the row's */
} CollKindInfo;

/* The link model: how long a collective of kind k moving `bytes` (coll_bytes)
 * takes on the links of group g (cfg's intra- and inter-node links), in us. */
double coll_link_time_us(const WorldConfig *cfg, const CollKindInfo *k, size_t bytes, const ProcessGroup *g);

/* The row of a kind; NULL for a number that is not a kind. */
const CollKindInfo *coll_kind(int kind);
/* The elements of a buffer of size b for count and a group of group_size ranks. */
size_t coll_buf_elems(CollBufSize b, size_t count, int group_size);

/* What one rank asked for; ranks must agree on kind, count, op, root, dtype and group. */
typedef struct {
    int32_t kind, op, root, dtype; /* dtype: DType (device.h); root: a group rank */
    int32_t group;       /* the process group's id (0 = the world) */
    uint64_t count;      /* all_gather: send count; reduce_scatter: recv count; else buffer count */
    char label[48];      /* for messages only (not compared) */
    char group_name[PG_NAME_MAX]; /* for messages only */
} CollDesc;

typedef struct {
    CollDesc desc;
    uint64_t seq;        /* the poster's per-stream collective number (watchdog messages) */
    const void *send;
    void *recv;
    float *scratch;      /* all_reduce: this rank's reduced chunk, read by peers */
    double ready_us;     /* when the poster's stream could start it, on the modelled clock */
} CollPost;

/* Where the ranks of a group that are threads of this process meet, one per
 * (stream index, group): the heart of the CPU local backend's channels
 * (cpu/cpu_internal.h: CollChannel) and of the CUDA build's (cuda/: CudaChan).
 * here[] is indexed by the group's executed members (ProcessGroup.live: the
 * group rank, unless representative ranks stand in for the others). */
typedef struct {
    pthread_mutex_t mu;            /* guards this and the channel's posts */
    pthread_cond_t cv;             /* monotonic (chan_registry_get) */
    int arrived;                   /* ranks in the current round so far */
    uint8_t here[WORLD_MAX_RANKS]; /* ranks waiting in the current round (watchdog) */
    uint64_t generation;           /* bumped each time all ranks arrived */
} CollRendezvous;

/* With r->mu held: op's group rank arrives, and the call returns (mu held;
 * released while it waits) once every executed rank of op's group has. With the
 * watchdog on (collective_timeout_s > 0), a rank that waits longer reports the
 * call of the lowest group rank waiting (deterministic whichever timer fires
 * first) and the ranks missing, and the process exits. The channel's posts of
 * this round, by executed member (ProcessGroup.live), are CollPosts `stride`
 * bytes apart from posts (read for that report only). */
void coll_rendezvous(CollRendezvous *r, Stream *s, const Op *op, const CollPost *posts, size_t stride);

#define FLIGHT_DEPTH 16
typedef enum { FLIGHT_ISSUED = 1, FLIGHT_STARTED, FLIGHT_COMPLETED } FlightState;
typedef struct {
    uint64_t seq, count;
    int kind, state;             /* state 0 = slot unused */
    const char *label;           /* interned */
    const char *group;           /* the group's name; NULL for the world */
} FlightEntry;
typedef struct {
    const char *stream;          /* the stream's name (lives as long as the Dev) */
    FlightEntry e[FLIGHT_DEPTH]; /* slot seq % FLIGHT_DEPTH */
} FlightRing;

/* The rank's flight recorder (Dev.flight): the host issues, workers update,
 * the watchdog reads. */
typedef struct {
    pthread_mutex_t mu;
    FlightRing *rings;                  /* [n] per stream index */
    int n;
} FlightRecorder;

/* ------------------------------------------------------ point to point */

/* One send or receive of a group (p2p.c; device.h: dev_send / dev_recv).
 * Sends from a to b pair with b's receives from a in the order each side
 * issued them, whatever their streams: seq is this rank's count of earlier
 * sends to (receives from) that peer. */
typedef struct {
    int send;            /* 1: send buf to peer; 0: receive buf from peer */
    int peer;            /* world rank */
    int microbatch;      /* what it carries; both sides must say the same */
    void *buf;           /* [count] floats (a send only reads it) */
    size_t count;
    uint64_t seq;
    const char *label;   /* interned, e.g. "act" */
    double cost_us;      /* the link model's time for it (p2p_link_time_us) */
} P2PItem;

/* The sends and receives of one group (dev_group_start .. dev_group_end), on
 * one stream: one queued op (Op.p2p), freed once it ran. A backend's arrays
 * of one entry per item sit on its stack up to P2P_STACK_ITEMS items. */
#define P2P_STACK_ITEMS 64
typedef struct P2PBatch {
    int n, cap;
    P2PItem *items;
    Stream *stream;
} P2PBatch;

/* The link model of one transfer of `bytes` between two world ranks: one hop
 * on the intra-node link, or the inter-node one when --ranks-per-node puts
 * them on different nodes. */
double p2p_link_time_us(const WorldConfig *cfg, int a, int b, size_t bytes);
/* The mailboxes of ranks that are threads (World.p2p; p2p.c), for the CPU's
 * local backend and the CUDA build's: the k-th send from a to b is slot k of
 * mailbox (a, b). A slot holds the sender's buffer and modelled readiness and
 * two tokens a backend may pass along (CUDA: the events that order the two
 * streams; NULL on the CPU). */
typedef struct {
    const void *buf;
    size_t count;
    int microbatch;
    const char *label;
    double ready_us;      /* the sender's stream was ready (modelled clock) */
    double peer_ready_us; /* the receiver's, when it took the data */
    void *sent, *done;    /* the sender's token, the receiver's */
    int posted, received;
} P2PSlot;
typedef struct P2PChan P2PChan;
P2PChan *p2p_mailbox(World *w, int src, int dst);
/* The sender posts its item (no wait): a receive may wait for a peer that waits for one of these. */
void p2p_post(P2PChan *c, const P2PItem *it, double ready_us, void *sent);
/* The receiver: wait until the matching send is posted (p2p_timeout past the
 * deadline, NULL: none), check it matches (p2p_mismatch); a copy of its slot.
 * The buffer stays put until p2p_mark_received. */
P2PSlot p2p_await_send(Stream *s, const Op *op, P2PChan *c, const P2PItem *it, const struct timespec *deadline);
void p2p_mark_received(P2PChan *c, const P2PItem *it, double ready_us, void *done);
/* The sender: wait until its item was received; a copy of the slot, whose
 * tokens are the sender's from now on (the slot forgets them). */
P2PSlot p2p_await_received(Stream *s, const Op *op, P2PChan *c, const P2PItem *it, const struct timespec *deadline);
/* Every token still in a slot (a send never received), for a backend's
 * teardown before p2p_world_fini. */
void p2p_drop_tokens(World *w, void (*drop)(void *token));
/* A p2p item's partner that never came, or one that disagrees: one report
 * (flight recorder included) and exit (p2p.c; the mpi backend's too). */
void p2p_timeout(Stream *s, const Op *op, const P2PItem *it, double waited_s) __attribute__((noreturn));
void p2p_mismatch(Stream *s, const P2PItem *it, int sender_microbatch, size_t sender_count, const char *sender_label)
    __attribute__((noreturn));
/* World.p2p: the mailboxes (world.c creates and frees them). */
void p2p_world_init(World *w);
void p2p_world_fini(World *w);

const char *coll_kind_name(int kind);
const char *coll_dtype_name(int dtype);   /* "f32", "bf16" */
const char *coll_op_name(int kind, int op); /* a reducing kind's "sum" / "avg"; NULL for the others */
size_t coll_dtype_size(int dtype);        /* bytes per element */
int coll_same_call(const CollDesc *a, const CollDesc *b);
/* Fatal naming every rank's call if they differ (descs in group-rank order;
 * members[i]: the world rank of group rank i). */
void coll_check_agreement(Stream *s, uint64_t seq, const CollDesc *descs, int n, const int *members);
/* Fatal on a bad argument (other rank's stream, NULL buffer, unknown op, send and
 * receive buffers that overlap other than in NCCL's in-place forms). */
void coll_validate(ProcessGroup *g, Stream *s, int kind, const void *send, const void *recv, size_t count, int op,
                   int root, int dtype, const char *label);
/* Fill o's collective fields (label, desc, bytes, cost_us), give it s's next
 * sequence number and mark it issued in the flight recorder (both backends'
 * coll_enqueue). The bytes it moves (for the trace and the link model) follow
 * from kind, count and dtype; its cost on the modelled clock is the link
 * model's time for them (coll_link_time_us). */
void coll_op_describe(Dev *d, Stream *s, Op *o, ProcessGroup *g, CollKind kind, RedOp op, int root, size_t count,
                      DType dtype, const char *label);
/* Enqueue one collective on s (coll_common.c): checked and described, then the
 * world's backend queues it (backend.h: coll_enqueue). The coll_* calls of
 * device.h lead here. */
void coll_enqueue(ProcessGroup *g, Stream *s, CollKind kind, const void *send, void *recv, size_t count, RedOp op,
                  int root, DType dtype, const char *label);
/* The deadline of a wait that starts now and may last timeout_s seconds, on
 * CLOCK_MONOTONIC (the clock the registries' condition variables use), in
 * *dl; NULL when timeout_s <= 0 (no deadline). */
const struct timespec *coll_deadline(double timeout_s, struct timespec *dl);
void flight_stream_created(Dev *d, Stream *s);
void flight_set(Stream *s, const Op *op, int state); /* FlightState */
/* lowest: the post of the lowest executed member waiting (NULL: op's own),
 * lowest_grank its index among the group's executed members (ProcessGroup.live),
 * here[i]: executed member i arrived (NULL: unknown); ranks are reported as
 * world ranks. */
void watchdog_timeout(Stream *s, const Op *op, const CollPost *lowest, int lowest_grank, const uint8_t *here)
    __attribute__((noreturn));
/* The watchdog's way out, for any report: once per world, `line` (no
 * newline), the flight recorder of every rank this process has, exit(2). */
void watchdog_report(Stream *s, const char *line) __attribute__((noreturn));

#endif
