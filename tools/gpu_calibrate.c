/* gpu_calibrate.c — `make gpu-calibrate`: the CUDA backend's own kernels timed on
 * a GPU at the shapes a dry run of Llama 3 8B / 70B prices (local batch 1 x
 * sequence 8192, bf16 activations as under --param-dtype bf16), each against
 * the time the modelled clock gives it on a device profile (issue 48, point 7).
 *
 * STATUS: COMPILED ONLY. The CUDA build of this file has never run on a GPU;
 * its first run on one is its test. What runs here (tests/test_gpu_calibrate.py)
 * is the CPU build: the argument handling, the op list with its modelled times,
 * the summary from given timings (--fake-times), the modelled times held to
 * the modelled clock's own (--self-test), and the CUDA build's one line when no
 * GPU is visible.
 *
 * The ops (CalOp below): the bf16 GEMMs of both flavours (matmul_forward and
 * matmul_backward with N = 8192 tokens: every projection's C x OC), flash
 * attention forward and backward (B 1, T 8192, hd 128; 8B's 32 heads over 8
 * kv heads and 70B's 64 over 8), the element-wise kernels of an 8B block
 * (rmsnorm, swiglu, the residual add, AdamW on the block's 218,112,000
 * params) and a 1 GiB device-to-device copy.
 *
 * Measured (CUDA build): each kernel through the runtime's own launch path —
 * a world of one rank (local backend), buffers from dev_alloc, the kernel
 * function of the stream's KernelTable (KERNEL(s, name): kernels_cuda.cu's
 * kcuda_*) handed to dev_launch on the compute stream, the copy by
 * dev_memcpy_async — after --warmup runs, --repeats runs each bracketed by two
 * CUDA events recorded on that stream (through dev_launch too, so on the very
 * stream the kernel enqueued on); the median of their elapsed times. Inputs
 * are random (bf16 in (-1, 1), float32 in (0, 1)); a backward first runs its
 * forward for the out, lse and rstd it reads.
 * Modelled: kernel_time_us (runtime/profile.h) of the KernelCost the model
 * declares for the kernel (kernels.h kcost_matmul_*, kcost_attention_*;
 * model/costs.h for the element-wise ones); the copy as the clock prices a
 * device-to-device copy (cpu/modelled_clock.c clock_copy_cost: its bytes read
 * and written at the HBM roofline, plus a kernel's fixed time). --self-test
 * checks both against the CPU clock's own functions.
 *
 * Output: a line per op (measured and modelled us, their ratio, and what the
 * kernel achieved: FLOP/s over the profile's dense BF16 peak for a matmul or
 * attention, bytes/s over its HBM bandwidth otherwise), then one line per op
 * class (the cost classes of runtime.h, and "copy"):
 *     gpu-calibrate: <class> measured/modelled = X.XX (n ops)
 * with X = sum of measured / sum of modelled over the class's ops (weighted by
 * time, as the classes' shares of a step are), and a final line over all
 * ops. Everything printed is written to logs/calibrate/<gpu>-<date>.txt (the
 * GPU's name from cudaGetDeviceProperties, each run of characters outside
 * [A-Za-z0-9.] made one '-'; the date UTC), or to --out.
 *
 * Two builds of this one file:
 *   build-cuda/tools/gpu_calibrate   make cuda (compiled only); make gpu-calibrate runs it
 *   build/tools/gpu_calibrate        make, -DGPU_CALIBRATE_CPU: no CUDA; it times nothing */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "model/costs.h"
#include "model/kernels.h"
#include "model/optim.h"
#include "runtime/bf16.h"
#include "runtime/profile.h"
#include "runtime/runtime.h"
#include "runtime/util.h"
#ifdef GPU_CALIBRATE_CPU
#include "cpu/cpu_internal.h" /* clock_kernel_cost, clock_copy_cost: what --self-test holds the modelled times to */
#else
#include <cuda_runtime.h>

#include "cuda/cuda_check.h" /* CUDA_CHECK, cuda_current_stream */
#endif

#define PROG "gpu_calibrate"
#define DEFAULT_PROFILE "h100-sxm"

/* ------------------------------------------------------------------ the ops */

typedef enum {
    K_MATMUL_FWD, K_MATMUL_BWD, K_ATTENTION_FWD, K_ATTENTION_BWD, K_RMSNORM_FWD, K_RMSNORM_BWD,
    K_SWIGLU_FWD, K_SWIGLU_BWD, K_ADD, K_ADAMW, K_COPY, K_COUNT
} Kind;

/* each kind by the KernelTable field it times (the copy is dev_memcpy_async's) */
static const char *const KIND_NAMES[K_COUNT] = {
    "matmul_forward", "matmul_backward", "attention_forward", "attention_backward", "rmsnorm_forward",
    "rmsnorm_backward", "swiglu_forward", "swiglu_backward", "add", "adamw", "copy_d2d"};

typedef struct {
    Kind kind;
    const char *where; /* where a dry run runs it */
    /* the shape: matmul N, C, OC (out[N,OC] = in[N,C] @ w[OC,C]^T); attention B, T, H, KV, hd; rmsnorm N, D;
     * swiglu, add, adamw: n elements; copy: n bytes */
    size_t s[5];
} CalOp;

#define TOKENS 8192 /* the dry run's local batch 1 x sequence 8192: the rows of every activation */
#define GEMMS(C, OC, where) {K_MATMUL_FWD, where, {TOKENS, C, OC}}, {K_MATMUL_BWD, where, {TOKENS, C, OC}}
#define ATTENTION(H, KV, where) {K_ATTENTION_FWD, where, {1, TOKENS, H, KV, 128}}, \
                                {K_ATTENTION_BWD, where, {1, TOKENS, H, KV, 128}}

/* Llama 3 8B: dim 4096, FFN 14336, 32 heads over 8 kv heads of 128 (wk, wv: 1024 outputs), vocab 128256;
 * 70B: dim 8192, FFN 28672, 64 heads over 8 kv heads (common/model: the flavours) */
static const CalOp OPS[] = {
    GEMMS(4096, 4096, "8B wq, wo"),        GEMMS(4096, 1024, "8B wk, wv"),
    GEMMS(4096, 14336, "8B w1, w3"),       GEMMS(14336, 4096, "8B w2"),
    GEMMS(4096, 128256, "8B output"),      GEMMS(8192, 8192, "70B wq, wo"),
    GEMMS(8192, 1024, "70B wk, wv"),       GEMMS(8192, 28672, "70B w1, w3"),
    GEMMS(28672, 8192, "70B w2"),          GEMMS(8192, 128256, "70B output"),
    ATTENTION(32, 8, "8B"),                ATTENTION(64, 8, "70B"),
    {K_RMSNORM_FWD, "8B norms", {TOKENS, 4096}},
    {K_RMSNORM_BWD, "8B norms", {TOKENS, 4096}},
    {K_SWIGLU_FWD, "8B FFN", {(size_t)TOKENS * 14336}},
    {K_SWIGLU_BWD, "8B FFN", {(size_t)TOKENS * 14336}},
    {K_ADD, "8B residual", {(size_t)TOKENS * 4096}},
    /* an 8B block's params: wq, wo 4096^2 each, wk, wv 4096 x 1024, w1, w2, w3 4096 x 14336, two norms of 4096 */
    {K_ADAMW, "8B block's params", {218112000}},
    {K_COPY, "1 GiB", {(size_t)1 << 30}},
};
#define N_OPS (sizeof OPS / sizeof OPS[0])

/* The op classes, in the summary's order: the cost classes of the kernels (runtime.h), and the copies. */
static const char *const CLASSES[] = {"matmul", "attention", "elementwise", "copy"};
#define N_CLASSES (sizeof CLASSES / sizeof CLASSES[0])

/* "matmul_forward:N8192_C4096_OC4096": the op's id (--fake-times names ops by it) */
static void op_id(const CalOp *o, char *buf, size_t n) {
    const size_t *s = o->s;
    switch (o->kind) {
    case K_MATMUL_FWD:
    case K_MATMUL_BWD:
        snprintf(buf, n, "%s:N%zu_C%zu_OC%zu", KIND_NAMES[o->kind], s[0], s[1], s[2]);
        break;
    case K_ATTENTION_FWD:
    case K_ATTENTION_BWD:
        snprintf(buf, n, "%s:B%zu_T%zu_H%zu_KV%zu_hd%zu", KIND_NAMES[o->kind], s[0], s[1], s[2], s[3], s[4]);
        break;
    case K_RMSNORM_FWD:
    case K_RMSNORM_BWD:
        snprintf(buf, n, "%s:N%zu_D%zu", KIND_NAMES[o->kind], s[0], s[1]);
        break;
    case K_COPY:
        snprintf(buf, n, "%s:bytes%zu", KIND_NAMES[o->kind], s[0]);
        break;
    default:
        snprintf(buf, n, "%s:n%zu", KIND_NAMES[o->kind], s[0]);
    }
}

/* The cost the model declares for the kernel (the copy has none: 0) */
static int op_cost(const CalOp *o, KernelCost *c) {
    const size_t *s = o->s;
    const DType dt = DTYPE_BF16; /* the [a] tensors: bf16, as under --param-dtype bf16 */
    switch (o->kind) {
    case K_MATMUL_FWD: *c = kcost_matmul_forward(s[0], s[1], s[2], dt); return 1;
    case K_MATMUL_BWD: *c = kcost_matmul_backward(s[0], s[1], s[2], dt); return 1;
    case K_ATTENTION_FWD: *c = kcost_attention_forward(s[0], s[1], s[2], s[3], s[4], dt); return 1;
    case K_ATTENTION_BWD: *c = kcost_attention_backward(s[0], s[1], s[2], s[3], s[4], dt); return 1;
    case K_RMSNORM_FWD: *c = kcost_rmsnorm_forward(s[0], s[1], dt); return 1;
    case K_RMSNORM_BWD: *c = kcost_rmsnorm_backward(s[0], s[1], dt); return 1;
    case K_SWIGLU_FWD: *c = kcost_swiglu_forward(s[0], dt); return 1;
    case K_SWIGLU_BWD: *c = kcost_swiglu_backward(s[0], dt); return 1;
    case K_ADD: *c = kcost_add(s[0], dt); return 1;
    case K_ADAMW: *c = kcost_adamw(s[0]); return 1;
    default: return 0;
    }
}

static const char *op_class(const CalOp *o) {
    KernelCost c;
    return op_cost(o, &c) ? cost_class_name(c.cls) : "copy";
}

/* The modelled clock's time for the op on profile p, us: a kernel's declared cost at the profile's roofline
 * (float32 matmuls without TF32: these are bf16 anyway); the copy's bytes read and written at the HBM roofline
 * plus a kernel's fixed time, the expression of modelled_clock.c's clock_copy_cost (--self-test: equal) */
static double modelled_us(const DeviceProfile *p, const CalOp *o) {
    KernelCost c;
    if (op_cost(o, &c)) return kernel_time_us(p, &c, 0, PRICE_FUSED);
    return p->kernel_latency_us + 2.0 * (double)o->s[0] / (p->hbm_bytes_s * p->eff_memory) * 1e6;
}

/* ------------------------------------------------------------------ arguments */

typedef struct {
    const DeviceProfile *profile;
    int repeats, warmup;
    const char *only;      /* one class, or NULL: every op */
    const char *out;       /* the report's file; NULL: logs/calibrate/<gpu>-<date>.txt (timing), none (--fake-times) */
    const char *fake;      /* --fake-times FILE */
    int list, self_test;
} Args;

static void usage(FILE *f) {
    fprintf(f,
            "usage: " PROG " [--profile NAME] [--repeats N] [--warmup N] [--only CLASS] [--out FILE]\n"
            "       " PROG " --list | --fake-times FILE | --self-test | --help\n"
            "Times the CUDA backend's own kernels (kernels_cuda.cu, through dev_launch) on a GPU at a dry run's\n"
            "shapes (bf16 GEMMs of Llama 3 8B and 70B at 8192 tokens, flash attention at T 8192, an 8B block's\n"
            "element-wise kernels, a 1 GiB device copy) against the modelled clock's time for each on a device\n"
            "profile; prints a line per op, `gpu-calibrate: <class> measured/modelled = X.XX (n ops)` per class\n"
            "(sum of measured / sum of modelled) and a final line, and writes it all to\n"
            "logs/calibrate/<gpu>-<date>.txt. COMPILED ONLY: the CUDA build has not run on a GPU yet.\n"
            "  --profile NAME     the device profile the modelled times are on (default " DEFAULT_PROFILE "; %s)\n"
            "  --repeats N        timed runs per op, the median reported (default 20, 1..1000)\n"
            "  --warmup N         untimed runs first (default 3, 0..100)\n"
            "  --only CLASS       the ops of one class: matmul, attention, elementwise or copy\n"
            "  --out FILE         write the report there instead of logs/calibrate/<gpu>-<date>.txt\n"
            "  --list             the ops, their class and modelled time; no GPU touched\n"
            "  --fake-times FILE  no GPU touched: the measured times are read from FILE, one \"<op id> <us>\" a\n"
            "                     line (# comments; ops left out are not measured), to test the summary;\n"
            "                     the report goes to --out only\n"
            "  --self-test        the CPU build (make: build/tools/" PROG "): each op's modelled time against the\n"
            "                     CPU modelled clock's own (clock_kernel_cost, clock_copy_cost)\n",
            device_profile_names());
}

static int parse_int(const char *flag, const char *v, int lo, int hi) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi)
        fatal(PROG ": %s takes a whole number in [%d, %d], got '%s'", flag, lo, hi, v);
    return (int)x;
}

static int known_class(const char *c) {
    for (size_t i = 0; i < N_CLASSES; i++)
        if (!strcmp(c, CLASSES[i])) return 1;
    return 0;
}

static Args parse_args(int argc, char **argv) {
    Args a = {.profile = device_profile_find(DEFAULT_PROFILE), .repeats = 20, .warmup = 3};
    for (int i = 1; i < argc; i++) {
        const char *f = argv[i];
        int takes = !strcmp(f, "--profile") || !strcmp(f, "--repeats") || !strcmp(f, "--warmup") ||
                    !strcmp(f, "--only") || !strcmp(f, "--out") || !strcmp(f, "--fake-times");
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) {
            usage(stdout);
            exit(0);
        } else if (!strcmp(f, "--list")) {
            a.list = 1;
        } else if (!strcmp(f, "--self-test")) {
            a.self_test = 1;
        } else if (!takes) {
            fatal(PROG ": unknown argument '%s' (" PROG " --help lists them)", f);
        } else if (i + 1 >= argc) {
            fatal(PROG ": %s needs a value (" PROG " --help)", f);
        } else {
            const char *v = argv[++i];
            if (!strcmp(f, "--profile")) {
                a.profile = device_profile_find(v);
                if (!a.profile) fatal(PROG ": no device profile '%s' (profiles: %s)", v, device_profile_names());
            } else if (!strcmp(f, "--repeats")) {
                a.repeats = parse_int(f, v, 1, 1000);
            } else if (!strcmp(f, "--warmup")) {
                a.warmup = parse_int(f, v, 0, 100);
            } else if (!strcmp(f, "--only")) {
                if (!known_class(v)) fatal(PROG ": --only takes matmul, attention, elementwise or copy, got '%s'", v);
                a.only = v;
            } else if (!strcmp(f, "--out")) {
                a.out = v;
            } else {
                a.fake = v;
            }
        }
    }
    if (a.list + a.self_test + (a.fake != NULL) > 1)
        fatal(PROG ": --list, --fake-times and --self-test are three ways to run without a GPU: give one");
    return a;
}

static int selected(const Args *a, const CalOp *o) { return !a->only || !strcmp(a->only, op_class(o)); }

/* ------------------------------------------------------------------ the report */

/* What is printed, kept to be written to the report's file too. */
typedef struct {
    char *text;
    size_t len;
    FILE *mem;
} Report;

static void report_open(Report *r) {
    r->text = NULL;
    r->len = 0;
    r->mem = open_memstream(&r->text, &r->len);
    if (!r->mem) fatal(PROG ": cannot open a memory stream for the report");
}

static void say(Report *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void say(Report *r, const char *fmt, ...) {
    va_list ap, again;
    va_start(ap, fmt);
    va_copy(again, ap);
    vprintf(fmt, ap);
    vfprintf(r->mem, fmt, again);
    va_end(again);
    va_end(ap);
    fflush(stdout);
}

/* The report's text to path (NULL: nowhere); fatal in one line when it cannot be written. */
static void report_close(Report *r, const char *path) {
    fclose(r->mem);
    if (path) {
        FILE *f = fopen(path, "w");
        if (!f || fwrite(r->text, 1, r->len, f) != r->len || fclose(f) != 0)
            fatal(PROG ": cannot write the report %s: %s", path, strerror(errno));
    }
    free(r->text);
}

/* What the op achieved in `us`, said by what it divides by: FLOP/s over the profile's dense BF16 peak (a
 * matmul or attention), else bytes/s over its HBM bandwidth. */
static void achieved(const DeviceProfile *p, const CalOp *o, double us, char *buf, size_t n) {
    KernelCost c;
    int kernel = op_cost(o, &c);
    if (kernel && (c.cls == COST_MATMUL || c.cls == COST_ATTENTION)) {
        double flops_s = c.flops / (us * 1e-6);
        snprintf(buf, n, "%.0f TFLOP/s = %.1f%% of %s's dense BF16 peak", flops_s / 1e12, 100 * flops_s / p->peak_bf16,
                 p->name);
    } else {
        double bytes = kernel ? c.bytes : 2.0 * (double)o->s[0]; /* a copy reads and writes its bytes */
        double bytes_s = bytes / (us * 1e-6);
        snprintf(buf, n, "%.0f GB/s = %.1f%% of %s's HBM bandwidth", bytes_s / 1e9, 100 * bytes_s / p->hbm_bytes_s,
                 p->name);
    }
}

/* The per-op lines, the per-class summary and the final line; measured[i] < 0: op i was not measured. */
static void summarize(Report *r, const Args *a, const double *measured, const char *gpu, const char *written) {
    double sum_meas[N_CLASSES] = {0}, sum_model[N_CLASSES] = {0};
    int count[N_CLASSES] = {0}, total = 0;
    double all_meas = 0, all_model = 0;
    say(r, "%-48s %-11s %12s %12s %9s  %s\n", "op (its id)", "class", "measured us", "modelled us", "meas/mod",
        "achieved | where a dry run runs it");
    for (size_t i = 0; i < N_OPS; i++) {
        const CalOp *o = &OPS[i];
        if (!selected(a, o) || measured[i] < 0) continue;
        char id[96], ach[128];
        op_id(o, id, sizeof id);
        double model = modelled_us(a->profile, o);
        achieved(a->profile, o, measured[i], ach, sizeof ach);
        say(r, "op %-45s %-11s %12.1f %12.1f %9.2f  %s | %s\n", id, op_class(o), measured[i], model,
            measured[i] / model, ach, o->where);
        for (size_t k = 0; k < N_CLASSES; k++)
            if (!strcmp(CLASSES[k], op_class(o))) {
                sum_meas[k] += measured[i];
                sum_model[k] += model;
                count[k]++;
            }
        all_meas += measured[i];
        all_model += model;
        total++;
    }
    if (!total) fatal(PROG ": no op was measured (--only and --fake-times leave none)");
    for (size_t k = 0; k < N_CLASSES; k++)
        if (count[k])
            say(r, "gpu-calibrate: %s measured/modelled = %.2f (%d op%s)\n", CLASSES[k], sum_meas[k] / sum_model[k],
                count[k], count[k] == 1 ? "" : "s");
    say(r, "gpu-calibrate: %d ops on %s against profile %s: measured/modelled = %.2f over all%s%s\n", total, gpu,
        a->profile->name, all_meas / all_model, written ? "; written to " : "", written ? written : "");
}

static void list_ops(const Args *a) {
    printf("# %s: the ops, their class and their modelled time on profile %s (%s)\n", PROG, a->profile->name,
           a->profile->about);
    for (size_t i = 0; i < N_OPS; i++) {
        if (!selected(a, &OPS[i])) continue;
        char id[96];
        op_id(&OPS[i], id, sizeof id);
        printf("op %s %s %.9g %s\n", id, op_class(&OPS[i]), modelled_us(a->profile, &OPS[i]), OPS[i].where);
    }
}

/* --fake-times FILE: measured[i] from FILE's "<op id> <us>" lines; -1 for an op it leaves out. */
static void read_fake_times(const char *path, double *measured) {
    FILE *f = fopen(path, "r");
    if (!f) fatal(PROG ": cannot read --fake-times %s: %s", path, strerror(errno));
    for (size_t i = 0; i < N_OPS; i++) measured[i] = -1;
    char line[512];
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        n++;
        char id[256], extra[8];
        double us;
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        int got = sscanf(line, "%255s %lf %7s", id, &us, extra);
        if (got <= 0) continue; /* blank */
        if (got != 2 || !(us > 0) || !isfinite(us))
            fatal(PROG ": %s line %d: want \"<op id> <microseconds > 0>\"", path, n);
        size_t i = 0;
        for (; i < N_OPS; i++) {
            char want[96];
            op_id(&OPS[i], want, sizeof want);
            if (!strcmp(id, want)) break;
        }
        if (i == N_OPS) fatal(PROG ": %s line %d: no op '%s' (" PROG " --list gives the ids)", path, n, id);
        if (measured[i] >= 0) fatal(PROG ": %s line %d: op '%s' given twice", path, n, id);
        measured[i] = us;
    }
    fclose(f);
}

/* ------------------------------------------------------------------ the CPU build: --self-test */

#ifdef GPU_CALIBRATE_CPU
typedef struct {
    const Args *a;
    int failed;
} SelfTest;

/* Each op's modelled time against the CPU modelled clock's own price of it on the same profile (its kernel, or
 * a device-to-device copy): bit for bit. */
static void self_test_rank(Dev *dev, void *arg) {
    SelfTest *t = arg;
    for (size_t i = 0; i < N_OPS; i++) {
        const CalOp *o = &OPS[i];
        KernelCost c;
        double clock = op_cost(o, &c) ? clock_kernel_cost(dev, &c) : clock_copy_cost(dev, o->s[0], 0);
        double mine = modelled_us(t->a->profile, o);
        if (clock != mine) {
            char id[96];
            op_id(o, id, sizeof id);
            printf("%s: self-test: %s modelled %.17g us, the clock prices it %.17g us\n", PROG, id, mine, clock);
            t->failed++;
        }
    }
}

static int self_test(const Args *a) {
    WorldConfig cfg = {0};
    cfg.world_size = 1;
    cfg.backend = BACKEND_LOCAL;
    cfg.profile = a->profile;
    cfg.dry_run = 1; /* nothing is allocated or run: only the clock's prices are read */
    SelfTest t = {a, 0};
    World *w = world_create(&cfg);
    world_run(w, self_test_rank, &t);
    world_destroy(w);
    if (t.failed) {
        printf("%s: self-test: %d of %zu modelled times differ from the modelled clock's\n", PROG, t.failed, N_OPS);
        return 1;
    }
    printf("%s: self-test: the %zu ops' modelled times on %s equal the modelled clock's (clock_kernel_cost, "
           "clock_copy_cost)\n", PROG, N_OPS, a->profile->name);
    return 0;
}

static int measure(const Args *a) {
    (void)a;
    fatal(PROG ": this is the CPU build (no CUDA): it times nothing; make cuda builds build-cuda/tools/" PROG
          ", which make gpu-calibrate runs on a machine with an NVIDIA GPU (here: --list, --fake-times, --self-test)");
}

/* ------------------------------------------------------------------ the CUDA build: timing */
#else

#define PATTERN_BYTES ((size_t)64 << 20) /* the random bytes every buffer is filled from, chunk by chunk */

typedef struct {
    const Args *a;
    double measured[N_OPS];
    char gpu[256];        /* cudaDeviceProp.name */
    char about_gpu[512];  /* the GPU, the CUDA versions, the settings: the report's head */
    Dev *dev;
    Stream *s;
    uint16_t *pattern16;  /* bf16 words in (-1, 1) */
    float *pattern32;     /* floats in (0, 1) */
} Gpu;

/* A buffer of `bytes` from the runtime's allocator, filled with random bf16 words or floats. */
static void *buffer(Gpu *g, size_t bytes, int bf16, const char *name) {
    void *p = dev_alloc(g->dev, bytes, MEM_TEMP, name);
    const void *src = bf16 ? (const void *)g->pattern16 : (const void *)g->pattern32;
    for (size_t off = 0; off < bytes; off += PATTERN_BYTES)
        dev_memcpy_async(g->s, (char *)p + off, src, bytes - off < PATTERN_BYTES ? bytes - off : PATTERN_BYTES);
    return p;
}
#define A(n) buffer(g, (n) * sizeof(uint16_t), 1, "calibrate.a") /* an [a] tensor of n elements: bf16 */
#define F(n) buffer(g, (n) * sizeof(float), 0, "calibrate.f32") /* n floats */

/* A CUDA event recorded on the stream a dev_launch runs on (cuda_current_stream): the timing marks. */
typedef struct {
    cudaEvent_t e;
} MarkArgs;
static void record_mark(void *args) { CUDA_CHECK(cudaEventRecord(((MarkArgs *)args)->e, cuda_current_stream())); }
static void mark(Stream *s, cudaEvent_t e) {
    MarkArgs m = {e};
    KernelCost none = {.cls = COST_FREE};
    dev_launch(s, "calibrate_mark", &none, record_mark, &m, sizeof m);
}

/* One op ready to run: a kernel of the stream's table with its arguments, or the copy; its buffers. */
typedef struct {
    void (*fn)(void *args);
    union {
        max_align_t align_;
        unsigned char b[DEV_ARGS_MAX];
    } args;
    size_t args_size;
    KernelCost cost;
    void *dst, *src;       /* the copy's */
    size_t copy_bytes;
    void *bufs[16];
    int nb;
} Ready;

static void keep(Ready *r, void *p) {
    if (r->nb == (int)(sizeof r->bufs / sizeof r->bufs[0])) fatal(PROG ": too many buffers for one op");
    r->bufs[r->nb++] = p;
}
#define SET_ARGS(r, x) (memcpy((r)->args.b, &(x), sizeof(x)), (r)->args_size = sizeof(x))

static void run_once(Gpu *g, const Ready *r, const char *name) {
    if (!r->fn) dev_memcpy_async(g->s, r->dst, r->src, r->copy_bytes);
    else dev_launch(g->s, name, &r->cost, r->fn, r->args.b, r->args_size);
}

/* The buffers and arguments of op o, as the model hands them to the kernel (kernels.h): [a] tensors bf16,
 * rstd, lse, dw, the scratch and the optimizer's tensors float32. A backward's forward runs once first. */
static void prepare(Gpu *g, const CalOp *o, Ready *r) {
    const KernelTable *kt = stream_kernels(g->s);
    const size_t *s = o->s;
    memset(r, 0, sizeof *r);
    if (!op_cost(o, &r->cost)) { /* the copy */
        r->copy_bytes = s[0];
        keep(r, r->src = buffer(g, s[0], 0, "calibrate.src"));
        keep(r, r->dst = buffer(g, s[0], 0, "calibrate.dst"));
        return;
    }
    switch (o->kind) {
    case K_MATMUL_FWD: { /* out[N,OC] = in[N,C] @ w[OC,C]^T */
        void *in = A(s[0] * s[1]), *w = A(s[2] * s[1]), *out = A(s[0] * s[2]);
        keep(r, in), keep(r, w), keep(r, out);
        MmArgs x = {out, in, w, s[0], s[1], s[2], 1};
        SET_ARGS(r, x);
        r->fn = kt->matmul_forward;
        break;
    }
    case K_MATMUL_BWD: { /* dinp[N,C] += dout[N,OC] @ w; dw[OC,C] (float32) += dout^T @ in */
        void *dout = A(s[0] * s[2]), *in = A(s[0] * s[1]), *w = A(s[2] * s[1]), *dinp = A(s[0] * s[1]);
        float *dw = F(s[2] * s[1]);
        keep(r, dout), keep(r, in), keep(r, w), keep(r, dinp), keep(r, dw);
        MmBwdArgs x = {dinp, dw, dout, in, w, s[0], s[1], s[2], 1};
        SET_ARGS(r, x);
        r->fn = kt->matmul_backward;
        break;
    }
    case K_ATTENTION_FWD:
    case K_ATTENTION_BWD: { /* q, out [B,T,H,hd]; k, v [B,T,KV,hd]; lse [B,H,T] float32 */
        size_t B = s[0], T = s[1], H = s[2], KV = s[3], hd = s[4];
        size_t nq = B * T * H * hd, nk = B * T * KV * hd;
        void *q = A(nq), *k = A(nk), *v = A(nk), *out = A(nq);
        float *lse = F(B * H * T);
        keep(r, q), keep(r, k), keep(r, v), keep(r, out), keep(r, lse);
        AttArgs f = {out, lse, q, k, v, B, T, H, KV, hd, 1};
        if (o->kind == K_ATTENTION_FWD) {
            SET_ARGS(r, f);
            r->fn = kt->attention_forward;
            break;
        }
        KernelCost fc = kcost_attention_forward(B, T, H, KV, hd, DTYPE_BF16);
        dev_launch(g->s, "attention_forward", &fc, kt->attention_forward, &f, sizeof f); /* the out and lse read */
        void *dout = A(nq), *dq = A(nq), *dk = A(nk), *dv = A(nk);
        float *scratch = F(kt->attention_scratch_floats(B, T, H));
        keep(r, dout), keep(r, dq), keep(r, dk), keep(r, dv), keep(r, scratch);
        AttBwdArgs x = {dq, dk, dv, scratch, dout, q, k, v, out, lse, B, T, H, KV, hd, 1};
        SET_ARGS(r, x);
        r->fn = kt->attention_backward;
        break;
    }
    case K_RMSNORM_FWD:
    case K_RMSNORM_BWD: { /* out[N,D], rstd[N] (float32) = RMSNorm(in[N,D]) * w[D] */
        size_t N = s[0], D = s[1];
        void *in = A(N * D), *w = A(D), *out = A(N * D);
        float *rstd = F(N);
        keep(r, in), keep(r, w), keep(r, out), keep(r, rstd);
        NormArgs f = {out, rstd, in, w, N, D, 1e-5f, 1};
        if (o->kind == K_RMSNORM_FWD) {
            SET_ARGS(r, f);
            r->fn = kt->rmsnorm_forward;
            break;
        }
        KernelCost fc = kcost_rmsnorm_forward(N, D, DTYPE_BF16);
        dev_launch(g->s, "rmsnorm_forward", &fc, kt->rmsnorm_forward, &f, sizeof f); /* the rstd read */
        void *dout = A(N * D), *dinp = A(N * D);
        float *dw = F(D);
        keep(r, dout), keep(r, dinp), keep(r, dw);
        NormBwdArgs x = {dinp, dw, dout, in, w, rstd, N, D, 1};
        SET_ARGS(r, x);
        r->fn = kt->rmsnorm_backward;
        break;
    }
    case K_SWIGLU_FWD: { /* out[n] = silu(a[n]) * b[n] */
        void *a = A(s[0]), *b = A(s[0]), *out = A(s[0]);
        keep(r, a), keep(r, b), keep(r, out);
        SwiArgs x = {out, a, b, s[0], 1};
        SET_ARGS(r, x);
        r->fn = kt->swiglu_forward;
        break;
    }
    case K_SWIGLU_BWD: { /* da, db [n] += ... from dout, a, b */
        void *a = A(s[0]), *b = A(s[0]), *dout = A(s[0]), *da = A(s[0]), *db = A(s[0]);
        keep(r, a), keep(r, b), keep(r, dout), keep(r, da), keep(r, db);
        SwiBwdArgs x = {da, db, dout, a, b, s[0], 1};
        SET_ARGS(r, x);
        r->fn = kt->swiglu_backward;
        break;
    }
    case K_ADD: { /* out[n] = a[n] + b[n] */
        void *a = A(s[0]), *b = A(s[0]), *out = A(s[0]);
        keep(r, a), keep(r, b), keep(r, out);
        AddArgs x = {out, a, b, s[0], 1};
        SET_ARGS(r, x);
        r->fn = kt->add;
        break;
    }
    case K_ADAMW: { /* param, exp_avg, exp_avg_sq [n] updated from grad [n]; the clip from sqrt(*total_sumsq) */
        float *param = F(s[0]), *grad = F(s[0]), *m = F(s[0]), *v = F(s[0]), *total = F(1);
        keep(r, param), keep(r, grad), keep(r, m), keep(r, v), keep(r, total);
        AdamArgs x = {param, grad, m, v, s[0], adamw_default_config(), 1e-4f, 1, total, NULL};
        SET_ARGS(r, x);
        r->fn = kt->adamw;
        break;
    }
    default:
        fatal(PROG ": no kernel for op kind %d", (int)o->kind);
    }
}

static int by_value(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return a < b ? -1 : a > b;
}

/* The median over --repeats runs of op o, us, after --warmup untimed ones. */
static double time_op(Gpu *g, const CalOp *o) {
    const int R = g->a->repeats;
    Ready r;
    prepare(g, o, &r);
    cudaEvent_t *ev = xmalloc(2 * (size_t)R * sizeof *ev);
    for (int i = 0; i < 2 * R; i++) CUDA_CHECK(cudaEventCreate(&ev[i]));
    for (int i = 0; i < g->a->warmup; i++) run_once(g, &r, KIND_NAMES[o->kind]);
    for (int i = 0; i < R; i++) {
        mark(g->s, ev[2 * i]);
        run_once(g, &r, KIND_NAMES[o->kind]);
        mark(g->s, ev[2 * i + 1]);
    }
    dev_stream_synchronize(g->s);
    double *us = xmalloc((size_t)R * sizeof *us);
    for (int i = 0; i < R; i++) {
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
        us[i] = 1e3 * (double)ms;
    }
    qsort(us, (size_t)R, sizeof *us, by_value);
    double median = R % 2 ? us[R / 2] : 0.5 * (us[R / 2 - 1] + us[R / 2]);
    for (int i = 0; i < 2 * R; i++) CUDA_CHECK(cudaEventDestroy(ev[i]));
    for (int i = 0; i < r.nb; i++) dev_free(g->dev, r.bufs[i]);
    free(ev);
    free(us);
    return median;
}

static void measure_rank(Dev *dev, void *arg) {
    Gpu *g = arg;
    g->dev = dev;
    g->s = dev_compute_stream(dev);
    int index = 0, runtime = 0, driver = 0;
    struct cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDevice(&index));
    CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
    CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
    CUDA_CHECK(cudaDriverGetVersion(&driver));
    snprintf(g->gpu, sizeof g->gpu, "%s", prop.name);
    snprintf(g->about_gpu, sizeof g->about_gpu,
             "GPU %d: %s (sm_%d%d, %d SMs, %.1f GiB); CUDA runtime %d.%d, driver %d.%d; median of %d runs after %d "
             "warm-up runs each", index, prop.name, prop.major, prop.minor, prop.multiProcessorCount,
             (double)prop.totalGlobalMem / (double)(1u << 30), runtime / 1000, runtime % 1000 / 10, driver / 1000,
             driver % 1000 / 10, g->a->repeats, g->a->warmup);
    Rng rng;
    rng_seed(&rng, 20260507);
    g->pattern16 = xmalloc(PATTERN_BYTES);
    g->pattern32 = xmalloc(PATTERN_BYTES);
    for (size_t i = 0; i < PATTERN_BYTES / sizeof(uint16_t); i++)
        g->pattern16[i] = bf16_from_f32(rng_uniform(&rng) * 2.0f - 1.0f);
    for (size_t i = 0; i < PATTERN_BYTES / sizeof(float); i++) g->pattern32[i] = rng_uniform(&rng);
    for (size_t i = 0; i < N_OPS; i++) {
        g->measured[i] = -1;
        if (!selected(g->a, &OPS[i])) continue;
        char id[96];
        op_id(&OPS[i], id, sizeof id);
        fprintf(stderr, "%s: timing %s ...\n", PROG, id);
        g->measured[i] = time_op(g, &OPS[i]);
    }
    free(g->pattern16);
    free(g->pattern32);
}

/* logs/calibrate/<gpu>-<date>.txt: the GPU's name with each run of characters outside [A-Za-z0-9.] made one
 * '-', the UTC date; the folders made. */
static void default_out(const char *gpu, char *path, size_t n) {
    char name[256];
    size_t k = 0;
    for (const char *c = gpu; *c && k + 1 < sizeof name; c++) {
        int keep_c = (*c >= 'A' && *c <= 'Z') || (*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') || *c == '.';
        if (keep_c) name[k++] = *c;
        else if (k && name[k - 1] != '-') name[k++] = '-';
    }
    while (k && name[k - 1] == '-') k--;
    name[k] = 0;
    char date[16];
    time_t now = time(NULL);
    struct tm utc;
    gmtime_r(&now, &utc);
    strftime(date, sizeof date, "%Y-%m-%d", &utc);
    static const char *const dirs[] = {"logs", "logs/calibrate"};
    for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++)
        if (mkdir(dirs[i], 0777) != 0 && errno != EEXIST) fatal(PROG ": cannot make %s: %s", dirs[i], strerror(errno));
    snprintf(path, n, "logs/calibrate/%s-%s.txt", k ? name : "gpu", date);
}

static int measure(const Args *a) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n < 1)
        fatal("no CUDA device: %s; " PROG " times the CUDA kernels on a GPU (make gpu-calibrate on a machine "
              "where nvidia-smi lists one; here --list, --fake-times and the CPU build's --self-test run)",
              e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found 0 devices");
    static Gpu g; /* the measured times of every op: one run of the program */
    g.a = a;
    WorldConfig cfg = {0};
    cfg.world_size = 1;
    cfg.backend = BACKEND_LOCAL;
    cfg.no_race_check = 1;
    World *w = world_create(&cfg);
    world_run(w, measure_rank, &g);
    world_destroy(w);
    char path[512];
    if (a->out) snprintf(path, sizeof path, "%s", a->out);
    else default_out(g.gpu, path, sizeof path);
    Report r;
    report_open(&r);
    say(&r, "# gpu-calibrate: the CUDA backend's kernels timed against the modelled clock's time on profile %s "
            "(%s)\n# %s\n", a->profile->name, a->profile->about, g.about_gpu);
    summarize(&r, a, g.measured, g.gpu, path);
    report_close(&r, path);
    return 0;
}
#endif

/* ------------------------------------------------------------------ main */

int main(int argc, char **argv) {
    Args a = parse_args(argc, argv);
    if (a.list) {
        list_ops(&a);
        return 0;
    }
    if (a.self_test) {
#ifdef GPU_CALIBRATE_CPU
        return self_test(&a);
#else
        fatal(PROG ": --self-test is the CPU build's (build/tools/" PROG " --self-test, after make): it holds the "
              "modelled times to the CPU modelled clock's");
#endif
    }
    if (a.fake) {
        double measured[N_OPS];
        read_fake_times(a.fake, measured);
        char gpu[600];
        snprintf(gpu, sizeof gpu, "fake timings (%s)", a.fake);
        Report r;
        report_open(&r);
        say(&r, "# gpu-calibrate: the measured times read from %s (no GPU touched), against profile %s\n", a.fake,
            a.profile->name);
        summarize(&r, &a, measured, gpu, a.out);
        report_close(&r, a.out);
        return 0;
    }
    return measure(&a);
}
