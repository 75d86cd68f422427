/* guard.c — the device-memory guard (guard.h): x86 memory protection keys
 * make the CPU backends' device storage unreachable from host threads, and a
 * SIGSEGV handler turns a host access into one line naming the buffer and the
 * code. The handler reads only host memory (the allocator's records, the
 * executable's symbol table, mapped at install): it runs with the kernel's
 * default PKRU, which denies the key. */
#include "runtime/dry.h"
#include "runtime/guard.h"
#include "runtime/internal.h"
#include "runtime/util.h"

#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <execinfo.h>
#include <fcntl.h>
#include <link.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <ucontext.h>
#include <unistd.h>

/* the handler reads x86-64's fault context (RIP, the page-fault error code) */
#if defined(__x86_64__) && defined(SEGV_PKUERR) && defined(PKEY_DISABLE_ACCESS) && !defined(GUARD_NO_PKEYS)
#define GUARD_X86_PKEYS 1
#else
#define GUARD_X86_PKEYS 0
#endif

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_tried;                  /* pkey_alloc was tried (once per process) */
static int g_pkey = -1;              /* the key device storage is tagged with; -1: none */
static World *volatile g_world;      /* whose allocators name the buffers */
static struct sigaction g_old_segv;  /* what a fault that is not the guard's goes to */

enum { ROLE_UNKNOWN = 0, ROLE_MAIN, ROLE_HOST, ROLE_WORKER };
static __thread int t_role;          /* set at the thread's start (initial-exec TLS: fine in a handler) */
static __thread Dev *t_dev;          /* a host thread's rank */

/* ------------------------------------------------- the executable's symbols */

/* Functions of the executable (the runtime, the driver and the hw_fsdp.c are
 * linked into it), from its .symtab: static functions too, which dladdr
 * cannot name. file: its source as the compiler was given it (the DWARF
 * compile unit whose .debug_aranges hold it: "common/driver/probes.c"), else
 * a static function's STT_FILE (the base name); NULL if unknown. */
typedef struct {
    uintptr_t lo, hi;
    const char *name, *file;
} GuardSym;
static GuardSym *g_syms;
static size_t g_nsyms;
static uintptr_t g_exe_base, g_exe_lo, g_exe_hi; /* load bias; the executable's mapped range */

static int sym_cmp(const void *a, const void *b) {
    const GuardSym *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

static int exe_range(struct dl_phdr_info *info, size_t size, void *arg) {
    (void)size, (void)arg;
    /* the first object is the executable */
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type != PT_LOAD) continue;
        uintptr_t lo = info->dlpi_addr + ph->p_vaddr, hi = lo + ph->p_memsz;
        if (!g_exe_lo || lo < g_exe_lo) g_exe_lo = lo;
        if (hi > g_exe_hi) g_exe_hi = hi;
    }
    g_exe_base = info->dlpi_addr;
    return 1;
}

/* ---- the compile unit of an address, from .debug_aranges and the unit's DW_AT_name */

typedef struct {
    const unsigned char *p, *end;
    int bad;
} Rd;
static uint64_t rd_n(Rd *r, int n) {
    if (r->bad || r->end - r->p < n) {
        r->bad = 1;
        return 0;
    }
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v |= (uint64_t)r->p[i] << (8 * i);
    r->p += n;
    return v;
}
static uint64_t rd_leb(Rd *r) {
    uint64_t v = 0;
    for (int shift = 0; !r->bad; shift += 7) {
        uint64_t b = rd_n(r, 1);
        if (shift < 64) v |= (b & 0x7f) << shift;
        if (!(b & 0x80)) break;
    }
    return v;
}

typedef struct {
    const unsigned char *info, *abbrev, *str, *line_str;
    size_t info_n, abbrev_n, str_n, line_str_n;
} Dwarf;

static const char *sec_string(const unsigned char *sec, size_t n, uint64_t off) {
    if (!sec || off >= n || !memchr(sec + off, 0, n - off)) return NULL;
    return (const char *)sec + off;
}

/* DW_AT_name of the unit at .debug_info offset `off` (DWARF 2 to 5, 32-bit); NULL if unreadable. */
static const char *cu_name(const Dwarf *dw, uint64_t off) {
    if (off >= dw->info_n) return NULL;
    Rd r = {dw->info + off, dw->info + dw->info_n, 0};
    uint64_t len = rd_n(&r, 4);
    if (len >= 0xfffffff0u || len > (uint64_t)(r.end - r.p)) return NULL;
    r.end = r.p + len;
    int version = (int)rd_n(&r, 2), addr_size;
    uint64_t abbrev_off;
    if (version >= 5) {
        if (rd_n(&r, 1) != 1 /* DW_UT_compile */) return NULL;
        addr_size = (int)rd_n(&r, 1);
        abbrev_off = rd_n(&r, 4);
    } else {
        abbrev_off = rd_n(&r, 4);
        addr_size = (int)rd_n(&r, 1);
    }
    uint64_t code = rd_leb(&r);
    if (r.bad || abbrev_off >= dw->abbrev_n) return NULL;
    Rd a = {dw->abbrev + abbrev_off, dw->abbrev + dw->abbrev_n, 0};
    for (;;) { /* the abbreviation of the unit's DIE */
        uint64_t c = rd_leb(&a);
        if (a.bad || !c) return NULL;
        rd_leb(&a); /* tag */
        rd_n(&a, 1); /* children */
        if (c == code) break;
        for (;;) {
            uint64_t at = rd_leb(&a), form = rd_leb(&a);
            if (form == 0x21) rd_leb(&a); /* DW_FORM_implicit_const */
            if (a.bad || (!at && !form)) break;
        }
        if (a.bad) return NULL;
    }
    for (;;) {
        uint64_t at = rd_leb(&a), form = rd_leb(&a);
        if (a.bad || (!at && !form)) return NULL;
        const char *text = NULL;
        switch (form) {
        case 0x08: /* string */
            text = (const char *)r.p;
            if (!memchr(r.p, 0, (size_t)(r.end - r.p))) return NULL;
            r.p += strlen(text) + 1;
            break;
        case 0x0e: text = sec_string(dw->str, dw->str_n, rd_n(&r, 4)); break;           /* strp */
        case 0x1f: text = sec_string(dw->line_str, dw->line_str_n, rd_n(&r, 4)); break; /* line_strp */
        case 0x01: rd_n(&r, addr_size); break;                                            /* addr */
        case 0x0b: case 0x0c: case 0x11: case 0x25: case 0x29: rd_n(&r, 1); break;
        case 0x05: case 0x12: case 0x26: case 0x2a: rd_n(&r, 2); break;
        case 0x27: case 0x2b: rd_n(&r, 3); break;
        case 0x06: case 0x10: case 0x13: case 0x17: case 0x28: case 0x2c: rd_n(&r, 4); break;
        case 0x07: case 0x14: case 0x20: rd_n(&r, 8); break;
        case 0x1e: rd_n(&r, 16); break;
        case 0x0d: case 0x0f: case 0x15: case 0x1a: case 0x1b: case 0x22: case 0x23: rd_leb(&r); break;
        case 0x19: case 0x21: break; /* flag_present, implicit_const */
        default: return NULL;        /* a form a compile unit's DIE does not hold here */
        }
        if (r.bad) return NULL;
        if (at == 0x03 /* DW_AT_name */) return form == 0x08 || form == 0x0e || form == 0x1f ? text : NULL;
    }
}

typedef struct {
    uintptr_t lo, hi;
    const char *name;
} CuRange;

static int range_cmp(const void *a, const void *b) {
    const CuRange *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* Every address range of .debug_aranges with its unit's name, sorted (*n of them). */
static CuRange *cu_ranges(const unsigned char *ar, size_t ar_n, const Dwarf *dw, uintptr_t bias, size_t *n) {
    size_t cap = 0;
    CuRange *out = NULL;
    *n = 0;
    Rd r = {ar, ar + ar_n, 0};
    while (!r.bad && r.p < r.end) {
        const unsigned char *set = r.p;
        uint64_t len = rd_n(&r, 4);
        if (r.bad || len >= 0xfffffff0u || len > (uint64_t)(r.end - r.p)) break;
        Rd s = {r.p, r.p + len, 0};
        r.p += len;
        rd_n(&s, 2); /* version */
        const char *name = cu_name(dw, rd_n(&s, 4));
        int asz = (int)rd_n(&s, 1), seg = (int)rd_n(&s, 1);
        if (s.bad || asz != 8 || seg) continue;
        size_t head = (size_t)(s.p - set), pad = (16 - head % 16) % 16; /* tuples aligned to twice the address size */
        rd_n(&s, (int)pad);
        for (;;) {
            uint64_t lo = rd_n(&s, 8), sz = rd_n(&s, 8);
            if (s.bad || (!lo && !sz)) break;
            if (!name || !sz) continue;
            out = xgrow(out, &cap, (*n + 1) * sizeof *out, 64 * sizeof *out);
            out[(*n)++] = (CuRange){bias + lo, bias + lo + sz, name};
        }
    }
    if (*n) qsort(out, *n, sizeof *out, range_cmp);
    return out;
}

static const char *range_name(const CuRange *rg, size_t n, uintptr_t pc) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (rg[mid].lo <= pc) lo = mid + 1;
        else hi = mid;
    }
    return lo && pc < rg[lo - 1].hi ? rg[lo - 1].name : NULL;
}

static void load_symbols(void) {
    dl_iterate_phdr(exe_range, NULL);
    int fd = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    struct stat st;
    void *map = MAP_FAILED;
    if (fstat(fd, &st) == 0 && st.st_size > (off_t)sizeof(Elf64_Ehdr))
        map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0); /* kept: the names point into it */
    close(fd);
    if (map == MAP_FAILED) return;
    size_t size = (size_t)st.st_size;
    const unsigned char *f = map;
    const Elf64_Ehdr *eh = map;
    if (memcmp(eh->e_ident, ELFMAG, SELFMAG) || eh->e_ident[EI_CLASS] != ELFCLASS64 ||
        eh->e_shentsize != sizeof(Elf64_Shdr) || eh->e_shoff > size ||
        (size - eh->e_shoff) / sizeof(Elf64_Shdr) < eh->e_shnum)
        return;
    const Elf64_Shdr *sh = (const Elf64_Shdr *)(f + eh->e_shoff);
    uintptr_t bias = eh->e_type == ET_DYN ? g_exe_base : 0;
    /* the DWARF sections, by name (.shstrtab) */
    Dwarf dw = {0};
    const unsigned char *aranges = NULL;
    size_t aranges_n = 0;
    const Elf64_Shdr *names_sh = eh->e_shstrndx < eh->e_shnum ? &sh[eh->e_shstrndx] : NULL;
    for (int i = 0; names_sh && i < eh->e_shnum; i++) {
        if (sh[i].sh_type == SHT_NOBITS || sh[i].sh_offset > size || sh[i].sh_size > size - sh[i].sh_offset) continue;
        const char *nm = sec_string(f + names_sh->sh_offset, names_sh->sh_offset <= size &&
                                    names_sh->sh_size <= size - names_sh->sh_offset ? names_sh->sh_size : 0,
                                    sh[i].sh_name);
        if (!nm) continue;
        const unsigned char *data = f + sh[i].sh_offset;
        size_t n = sh[i].sh_size;
        if (!strcmp(nm, ".debug_info")) dw.info = data, dw.info_n = n;
        else if (!strcmp(nm, ".debug_abbrev")) dw.abbrev = data, dw.abbrev_n = n;
        else if (!strcmp(nm, ".debug_str")) dw.str = data, dw.str_n = n;
        else if (!strcmp(nm, ".debug_line_str")) dw.line_str = data, dw.line_str_n = n;
        else if (!strcmp(nm, ".debug_aranges")) aranges = data, aranges_n = n;
    }
    size_t nranges = 0;
    CuRange *ranges = aranges && dw.info && dw.abbrev ? cu_ranges(aranges, aranges_n, &dw, bias, &nranges) : NULL;
    for (int i = 0; i < eh->e_shnum; i++) {
        if (sh[i].sh_type != SHT_SYMTAB || sh[i].sh_link >= eh->e_shnum) continue;
        const Elf64_Shdr *str = &sh[sh[i].sh_link];
        if (sh[i].sh_offset > size || sh[i].sh_size > size - sh[i].sh_offset || str->sh_offset > size ||
            str->sh_size > size - str->sh_offset || sh[i].sh_entsize != sizeof(Elf64_Sym))
            break;
        const Elf64_Sym *sym = (const Elf64_Sym *)(f + sh[i].sh_offset);
        const char *names = (const char *)f + str->sh_offset;
        size_t n = sh[i].sh_size / sizeof(Elf64_Sym), k = 0;
        g_syms = xcalloc(n, sizeof *g_syms);
        const char *file = NULL;
        for (size_t j = 0; j < n; j++) {
            if (sym[j].st_name >= str->sh_size) continue;
            const char *name = names + sym[j].st_name;
            if (ELF64_ST_TYPE(sym[j].st_info) == STT_FILE) {
                file = *name ? name : NULL;
                continue;
            }
            if (ELF64_ST_TYPE(sym[j].st_info) != STT_FUNC || !sym[j].st_size || sym[j].st_shndx == SHN_UNDEF) continue;
            uintptr_t lo = bias + sym[j].st_value;
            const char *src = range_name(ranges, nranges, lo);
            if (!src && ELF64_ST_BIND(sym[j].st_info) == STB_LOCAL) src = file;
            g_syms[k++] = (GuardSym){lo, lo + sym[j].st_size, name, src};
        }
        qsort(g_syms, k, sizeof *g_syms, sym_cmp);
        g_nsyms = k;
        break;
    }
    free(ranges); /* the names point into the mapped file */
}

static const GuardSym *sym_at(uintptr_t pc) {
    size_t lo = 0, hi = g_nsyms;
    while (lo < hi) { /* the last symbol starting at or below pc */
        size_t mid = lo + (hi - lo) / 2;
        if (g_syms[mid].lo <= pc) lo = mid + 1;
        else hi = mid;
    }
    if (!lo || pc >= g_syms[lo - 1].hi) return NULL;
    return &g_syms[lo - 1];
}

static int in_exe(uintptr_t pc) { return pc >= g_exe_lo && pc < g_exe_hi; }

/* "fn (file)" for the code at pc in the executable; 0 if no symbol holds it */
static int name_code(char *out, size_t n, uintptr_t pc) {
    const GuardSym *s = sym_at(pc);
    if (!s) return 0;
    int len = (int)strcspn(s->name, "."); /* foo.constprop.0, foo.cold: foo */
    if (s->file) snprintf(out, n, "%.*s (%s)", len, s->name, s->file);
    else snprintf(out, n, "%.*s", len, s->name);
    return 1;
}

static const char *base_name(const char *path) {
    const char *slash = path ? strrchr(path, '/') : NULL;
    return slash ? slash + 1 : path ? path : "?";
}

/* The code that touched the memory: the first frame in the executable from the
 * faulting instruction outwards (memcmp in libc is not the culprit, its
 * caller is), and the library the fault was in, if any. */
static void describe_code(char *out, size_t n, uintptr_t pc) {
    void *frames[64];
    /* through the signal frame (libgcc loaded at install) */
    int nf = backtrace(frames, (int)(sizeof frames / sizeof *frames));
    int at = -1;
    for (int i = 0; i < nf; i++)
        if ((uintptr_t)frames[i] == pc) {
            at = i;
            break;
        }
    char lib[256] = "";
    if (!in_exe(pc)) {
        Dl_info info;
        if (dladdr((void *)pc, &info) && info.dli_fname)
            snprintf(lib, sizeof lib, " through %s", base_name(info.dli_fname));
    }
    for (int i = at < 0 ? nf : at; i < nf; i++) {
        uintptr_t a = i == at ? pc : (uintptr_t)frames[i] - 1; /* a return address: the call is before it */
        if (!in_exe(a)) continue;
        char fn[512];
        if (name_code(fn, sizeof fn, a)) {
            snprintf(out, n, "%s%s", fn, lib);
            return;
        }
    }
    if (in_exe(pc)) snprintf(out, n, "the code at %#lx (executable offset %#lx)", (unsigned long)pc,
                             (unsigned long)(pc - g_exe_base));
    else snprintf(out, n, "the code at %#lx%s", (unsigned long)pc, lib);
}

/* -------------------------------------------------------- the fault handler */

/* Which buffer holds addr: the thread's own rank first, then every rank of the
 * world. *host: 1 if it is pinned host memory (dev_alloc_host), not device memory. */
static void describe_buffer(char *out, size_t n, uintptr_t addr, int *host) {
    World *w = g_world;
    Dev *devs[WORLD_MAX_RANKS + 1];
    int nd = 0;
    *host = 0;
    if (t_dev) devs[nd++] = t_dev;
    if (w)
        for (int i = 0; i < w->local_ranks && i < WORLD_MAX_RANKS; i++)
            if (w->devs[i] && w->devs[i] != t_dev) devs[nd++] = w->devs[i];
    for (int i = 0; i < nd; i++) {
        const Alloc *a = dev_live_alloc_containing(devs[i], addr);
        if (a) {
            *host = a->host;
            snprintf(out, n, "'%s' (%s, rank %d) at byte offset %lu", a->name, mem_tag_name(a->tag), devs[i]->rank,
                     (unsigned long)(addr - a->addr));
            return;
        }
    }
    for (int i = 0; i < nd; i++) {
        const Alloc *a = dev_dead_alloc_containing(devs[i], addr);
        if (a) {
            *host = a->host;
            snprintf(out, n, "'%s' (%s, rank %d, freed in %s%s%s) at byte offset %lu", a->name, mem_tag_name(a->tag),
                     devs[i]->rank, a->free_module, *a->free_module ? "." : "", a->free_phase,
                     (unsigned long)(addr - a->addr));
            return;
        }
        const float *clip = devs[i]->clip_slots;
        if (clip && addr >= (uintptr_t)clip && addr < (uintptr_t)(clip + CLIP_PROBE_SLOTS)) {
            snprintf(out, n, "the clip probe's slots (rank %d) at byte offset %lu", devs[i]->rank,
                     (unsigned long)(addr - (uintptr_t)clip));
            return;
        }
    }
    snprintf(out, n, "address %#lx (device storage no live allocation holds: past an allocation's end, "
             "or freed)", (unsigned long)addr);
}

static void describe_thread(char *out, size_t n) {
    switch (t_role) {
    case ROLE_HOST:
        if (t_dev) snprintf(out, n, "rank %d's host thread", t_dev->rank);
        else snprintf(out, n, "a rank's host thread");
        break;
    case ROLE_MAIN: snprintf(out, n, "the main thread"); break;
    case ROLE_WORKER: snprintf(out, n, "a stream worker"); break;
    default: snprintf(out, n, "a thread the runtime did not start"); break;
    }
}

/* Two kinds of fault are the handler's: a protection-key fault on the guard's
 * key (--guard-device-memory), and any access to a dry run's reservations
 * (dry.h: PROT_NONE, so SEGV_ACCERR). Anything else goes to the previous
 * disposition when the instruction runs again. */
static void guard_segv(int sig, siginfo_t *si, void *ucv) {
    (void)sig;
    uintptr_t addr = (uintptr_t)si->si_addr, pc = 0;
    const char *reserved = NULL;
    int wrote = 0;
    int dry = si->si_code == SEGV_ACCERR && dry_contains(addr, &reserved);
    int keyed = 0;
#if GUARD_X86_PKEYS
    keyed = si->si_code == SEGV_PKUERR && g_pkey >= 0 && si->si_pkey == (unsigned)g_pkey;
#endif
    if (!dry && !keyed) {
        sigaction(SIGSEGV, &g_old_segv, NULL);
        return;
    }
#if defined(__x86_64__)
    ucontext_t *uc = ucv;
    pc = (uintptr_t)uc->uc_mcontext.gregs[REG_RIP];
    wrote = (uc->uc_mcontext.gregs[REG_ERR] >> 1) & 1; /* the page-fault error code: bit 1 = write */
#else
    (void)ucv;
#endif
    report_lock(); /* one report per process (util.h); never released */
    char buffer[1024], code[1024], thread[128], line[3072];
    int host = 0;
    if (reserved) snprintf(buffer, sizeof buffer, "%s", reserved);
    else describe_buffer(buffer, sizeof buffer, addr, &host);
    describe_code(code, sizeof code, pc);
    describe_thread(thread, sizeof thread);
    const char *who = t_role == ROLE_WORKER ? "a stream worker" : "host code";
    int len;
    if (dry)
        len = snprintf(line, sizeof line,
                       "error: dry run: %s %s %s%s, touched by %s on %s: a dry run executes no op and puts no "
                       "memory behind its buffers, so no code may read or write them (%s)\n",
                       who, wrote ? "wrote" : "read", reserved ? "" : host ? "pinned host memory " : "device memory ",
                       buffer, code, thread,
                       host || reserved ? "a value it needs does not exist in a dry run"
                                        : "host code reads device memory only through a copy, as on a GPU, and "
                                          "a dry run has no values to copy");
    else
        len = snprintf(line, sizeof line,
                       "error: host code %s device memory: %s, touched by %s on %s: device memory is %s on the host "
                       "only through a copy (%s)\n",
                       wrote ? "wrote" : "read", buffer, code, thread, wrote ? "written" : "read",
                       wrote ? "dev_memcpy_async from host memory" : "dev_probe_read");
    if (len < 0) len = 0;
    if (len >= (int)sizeof line) len = (int)sizeof line - 1;
    if (ftrylockfile(stdout) == 0) { /* what was printed before comes first, unless stdout is mid-print */
        fflush_unlocked(stdout);
        funlockfile(stdout);
    }
    ssize_t unused = write(STDERR_FILENO, line, (size_t)len);
    (void)unused;
    _exit(EXIT_FATAL);
}

/* ------------------------------------------------------------------ setup */

static const char *why_unavailable(int err) {
    switch (err) {
    case ENOSYS: return "the kernel has no protection-key system calls";
    case EINVAL: return "the CPU or the kernel lacks x86 memory protection keys: no pku or ospke in /proc/cpuinfo";
    case ENOSPC: return "no protection key is free in this process";
    case ENOTSUP: return "this build's guard is x86-64's";
    default: return "";
    }
}

/* The SIGSEGV handler, once per process (g_mu held). */
static int g_handler;
static void install_handler(void) {
    if (g_handler) return;
    load_symbols();
    void *warm[4];
    backtrace(warm, 4); /* loads libgcc's unwinder now, not in the handler */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = guard_segv;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_old_segv);
    g_handler = 1;
}

int guard_install(World *w) {
    if (!w->cfg.guard_device && !w->cfg.dry_run) return 0;
    pthread_mutex_lock(&g_mu);
    if (w->cfg.dry_run) {
        /* a dry run's memory is out of everyone's reach already (dry.h): the handler names
         * the buffer; the key is not needed (and --guard-device-memory changes nothing) */
        install_handler();
        g_world = w;
        pthread_mutex_unlock(&g_mu);
        t_role = ROLE_MAIN;
        return 0;
    }
    int first = !g_tried;
    g_tried = 1;
    if (first && dev_is_cuda_build()) {
        fprintf(stderr, "note: --guard-device-memory is a mode of the CPU backends; on the GPU device memory is "
                        "out of the host's reach already: running unguarded\n");
    } else if (first) {
#if GUARD_X86_PKEYS
        g_pkey = pkey_alloc(0, PKEY_DISABLE_ACCESS);
        int err = errno;
#else
        int err = ENOTSUP; /* the handler is x86-64's */
#endif
        if (g_pkey < 0) {
            const char *why = why_unavailable(err);
            fprintf(stderr, "warning: --guard-device-memory is unavailable on this machine: pkey_alloc: %s%s%s%s; "
                            "running unguarded\n", strerror(err), *why ? " (" : "", why, *why ? ")" : "");
        } else {
            install_handler();
        }
    }
    int on = g_pkey >= 0;
    if (on) g_world = w;
    pthread_mutex_unlock(&g_mu);
    if (!on) return 0;
    t_role = ROLE_MAIN;
    pkey_set(g_pkey, PKEY_DISABLE_ACCESS);
    return 1;
}

void guard_world_gone(World *w) {
    pthread_mutex_lock(&g_mu);
    if (g_world == w) g_world = NULL;
    pthread_mutex_unlock(&g_mu);
}

int guard_active(const World *w) { return w->guarded; }

/* The thread's role is kept whenever the handler may report (a dry run has no key). */
void guard_thread_host(Dev *d) {
    if (!g_handler) return;
    t_role = ROLE_HOST;
    t_dev = d;
    if (g_pkey >= 0) pkey_set(g_pkey, PKEY_DISABLE_ACCESS);
}

void guard_thread_device(void) {
    if (!g_handler) return;
    t_role = ROLE_WORKER;
    if (g_pkey >= 0) pkey_set(g_pkey, 0);
}

unsigned guard_open(void) {
    if (g_pkey < 0) return 0;
    unsigned saved = (unsigned)pkey_get(g_pkey);
    pkey_set(g_pkey, 0);
    return saved;
}

void guard_close(unsigned saved) {
    if (g_pkey >= 0) pkey_set(g_pkey, saved);
}

static size_t page_round(size_t bytes) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return (bytes + page - 1) / page * page;
}

void *guard_storage_alloc(size_t bytes) {
    size_t len = page_round(bytes);
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    if (pkey_mprotect(p, len, PROT_READ | PROT_WRITE, g_pkey) != 0)
        fatal("--guard-device-memory: pkey_mprotect of %zu bytes failed: %s", len, strerror(errno));
    return p;
}

void guard_storage_free(void *p, size_t bytes) {
    if (p) munmap(p, page_round(bytes));
}
