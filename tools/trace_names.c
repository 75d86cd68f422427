/* trace_names.c — prints grader/trace_names.py, the trace's words for the Python side, from the runtime's
 * own tables, so that the two cannot drift: make builds it (build/tools/trace_names) and rewrites
 * grader/trace_names.py when its output changed; tests/test_trace_names.py checks the committed file is
 * this program's output. Each vocabulary has one C home:
 *   collective kinds  CollKind (runtime/runtime.h), names in coll_common.c (coll_kind_name)
 *   categories        TRACE_CAT_* and TRACE_CATEGORIES (runtime/trace.h), with the tracks and wall-clock args
 *   copy directions   CopyDir (runtime/alloc.h), names in alloc.c (copy_direction_name)
 *   memory tags       MemTag (device.h), names in alloc.c (mem_tag_name)
 *   phases            Phase (runtime/phase.h), rows in phase.c: name, pass, hook
 * usage: trace_names   (writes the module to stdout) */
#include <ctype.h>
#include <stdio.h>
#include <string.h>

#include "runtime/alloc.h"
#include "runtime/coll.h"
#include "runtime/phase.h"
#include "runtime/runtime.h"
#include "runtime/trace.h"

static const char *const DOC =
    "\"\"\"The words of the runtime's traces that the Python side reads: the grader, the tools and the tests\n"
    "take them from here. Generated from the runtime's tables by tools/trace_names.c (make rewrites this file;\n"
    "do not edit it): the collective kinds (CollKind, coll_common.c), the categories and tracks\n"
    "(runtime/trace.h), the copy directions (CopyDir, alloc.c), the memory tags (MemTag, alloc.c) and the\n"
    "phases (runtime/phase.h); tests/test_trace_names.py checks it against the generator and a run.\n"
    "\n"
    "A trace event (\"ph\": \"X\") of a rank has \"cat\" one of CATEGORIES, \"tid\" its stream's index (the\n"
    "compute stream COMPUTE_TID, the host's own track HOST_TID), \"args.phase\" one of PHASES (the hook or pass\n"
    "that queued it) and, for a collective, the name \"<label>.<kind>\" (label: the module, or grad_norm); \"ts\"\n"
    "and \"dur\" are on the world's clock (the file's otherData.clock: \"model\" on the CPU backends, the same on\n"
    "every run), args.wall_ts_us / wall_dur_us the wall clock's (WALL_ARGS: never graded). A rubric stage's\n"
    "\"streams\" name the comm streams by the kind they carry (ALL_GATHER, REDUCE_SCATTER). A memory snapshot's\n"
    "allocations carry one of MEM_TAGS. The run's otherData (and run.json) repeat the vocabularies a run used.\n"
    "Standard library only.\n"
    "\"\"\"\n";

/* A Python constant's name for a word, into buf: upper case, '.' as '_'
 * ("recompute.pre_forward" -> RECOMPUTE_PRE_FORWARD). */
static void const_name(const char *prefix, const char *word, char *buf, size_t cap) {
    size_t n = (size_t)snprintf(buf, cap, "%s", prefix);
    for (const char *c = word; *c && n + 1 < cap; c++) buf[n++] = *c == '.' ? '_' : (char)toupper((unsigned char)*c);
    buf[n < cap ? n : cap - 1] = 0;
}

/* open item, item, ... close, wrapped before 118 columns under the first item. */
static void print_list(const char *open, const char *const *items, int n, const char *close) {
    int col = printf("%s", open), indent = col;
    for (int i = 0; i < n; i++) {
        col += printf("%s", items[i]);
        if (i + 1 == n) break;
        int next = (int)strlen(items[i + 1]) + (i + 2 < n ? 1 : (int)strlen(close)); /* its "," or the close */
        if (col + 2 + next > 118) col = printf(",\n%*s", indent, "") - 2;
        else col += printf(", ");
    }
    printf("%s\n", close);
}

/* NAME = "word" lines, then TUPLE = (NAME, ...) of them. */
static void print_words(const char *prefix, const char *tuple, const char *const *words, int n) {
    char names[32][48], open[48];
    const char *items[32];
    for (int i = 0; i < n && i < 32; i++) {
        const_name(prefix, words[i], names[i], sizeof names[i]);
        items[i] = names[i];
        printf("%s = \"%s\"\n", names[i], words[i]);
    }
    snprintf(open, sizeof open, "%s = (", tuple);
    print_list(open, items, n < 32 ? n : 32, n == 1 ? ",)" : ")");
}

/* NAME = frozenset({PHASE_..., ...}) of the phases `keep` accepts, after a comment line. */
static void print_phase_set(const char *name, int (*keep)(const PhaseInfo *), const char *comment) {
    char names[PHASE_COUNT][48], open[48];
    const char *items[PHASE_COUNT];
    int n = 0;
    for (int p = 0; p < PHASE_COUNT; p++) {
        const PhaseInfo *info = phase_info(p);
        if (!keep(info)) continue;
        const_name("PHASE_", info->name, names[n], sizeof names[n]);
        items[n] = names[n];
        n++;
    }
    printf("# %s\n", comment);
    snprintf(open, sizeof open, "%s = frozenset({", name);
    print_list(open, items, n, "})");
}

static int forward(const PhaseInfo *i) { return i->pass == PASS_FORWARD; }
static int backward(const PhaseInfo *i) { return i->pass == PASS_BACKWARD; }
static int in_pass_hook(const PhaseInfo *i) { return i->hook && i->pass != PASS_NONE; }
static int other(const PhaseInfo *i) { return i->pass == PASS_NONE; }

int main(void) {
    fputs(DOC, stdout);

    puts("\n# collective kinds, in the order of CollKind (common/runtime/runtime.h); P2P: a group of sends and receives\n"
         "# (dev_send / dev_recv), named by what moves where, args.p2p the items");
    const char *kinds[COLL_KIND_COUNT];
    for (int k = 0; k < COLL_KIND_COUNT; k++) kinds[k] = coll_kind_name(k);
    print_words("", "COLLECTIVE_KINDS", kinds, COLL_KIND_COUNT);

    puts("\n# categories (\"cat\") of the trace's slices (common/runtime/trace.h): a copy between host and device is\n"
         "# named \"<module>.h2d\" / \".d2h\"; WAIT: a stream stalled on an event (traced iff it stalled on the modelled\n"
         "# clock); HOST_SYNC: the host waited (\"sync:<what>\") on the host's track, every wait, 0 long if it did not\n"
         "# stall; MEMSET: the CUDA backend's memsets (the CPU files them under COPY)");
    const char *const cats[] = TRACE_CATEGORIES;
    print_words("", "CATEGORIES", cats, (int)(sizeof cats / sizeof *cats));

    puts("\n# args of a slice that hold wall-clock times (CPU backends): for performance work, never for grading");
    printf("WALL_ARGS = (\"%s\", \"%s\")\n", TRACE_ARG_WALL_TS, TRACE_ARG_WALL_DUR);

    puts("\n# args of a kernel's slice (CPU backends): its cost class (CostClass, common/runtime/runtime.h, in the enum's\n"
         "# order) and its math (\"f32\" / \"bf16\")");
    printf("KERNEL_ARGS = (\"%s\", \"%s\")\n", TRACE_ARG_CLASS, TRACE_ARG_MATH);
    const char *classes[COST_CLASS_COUNT];
    for (int c = 0; c < COST_CLASS_COUNT; c++) classes[c] = cost_class_name(c);
    print_words("COST_", "COST_CLASSES", classes, COST_CLASS_COUNT);

    puts("\n# copy directions (CopyDir, common/runtime/alloc.h): the last part of a copy's name");
    for (int d = 0; d < COPY_DIR_COUNT; d++) {
        if (d == COPY_SAME_SIDE) continue; /* a copy within one side is named "copy", no direction */
        char name[16];
        const_name("", copy_direction_name(d), name, sizeof name);
        printf("%s = \"%s\"\n", name, copy_direction_name(d));
    }

    printf("\nCOMPUTE_TID = %d    # each rank's first stream is its compute stream\n", TRACE_COMPUTE_TID);
    printf("HOST_TID = %d    # TRACE_HOST_TID: the host's own track\n", TRACE_HOST_TID);

    puts("\n# memory tags (MemTag, common/device.h), in the enum's order: a snapshot's allocations are grouped by them");
    const char *tags[MEM_TAG_COUNT];
    for (int t = 0; t < MEM_TAG_COUNT; t++) tags[t] = mem_tag_name(t);
    print_words("TAG_", "MEM_TAGS", tags, MEM_TAG_COUNT);

    puts("\n# args.phase: where the training loop was when the op was queued (Phase, common/runtime/phase.h), in the\n"
         "# order a step visits them");
    const char *phases[PHASE_COUNT];
    for (int p = 0; p < PHASE_COUNT; p++) phases[p] = phase_name(p);
    print_words("PHASE_", "PHASES", phases, PHASE_COUNT);
    print_phase_set("FORWARD_PHASES", forward, "the forward pass");
    print_phase_set("BACKWARD_PHASES", backward, "the backward pass, --ac's recompute included");
    print_phase_set("HOOK_PHASES", in_pass_hook, "inside a student's hook of a pass (the optimizer step's is none)");
    print_phase_set("OTHER_PHASES", other, "neither pass: fsdp_init, the batch, the optimizer step, --forward-only's "
                                            "discard, the end; with\n# --pp the schedule's sends and receives between "
                                            "pipe_forward / pipe_backward (module \"pipe\")");

    puts("\n\ndef label_and_kind(name):\n"
         "    \"\"\"('block0', 'all_gather') of a collective named 'block0.all_gather' (a copy's name splits the same way);\n"
         "    ('', name) for a name without a dot.\"\"\"\n"
         "    label, _, kind = name.rpartition(\".\")\n"
         "    return label, kind");
    return ferror(stdout) ? 1 : 0;
}
