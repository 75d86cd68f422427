/* pipe_split.h — the pipeline's split of the modules into P stages (hw_pipe.h states it for students): one
 * definition, read by the flag check (options.c: is every stage given a module?) and by the stage models
 * (pipeline.c). Pure arithmetic on L (blocks) and P (stages).
 *
 * modules[0] is the embedding, modules[1 .. L] the blocks, modules[L + 1] the head. Stage p holds the
 * contiguous run [first, last]: the embedding on stage 0, the head on stage P-1, and L / P blocks on each
 * stage, one more on the first L % P stages. With L < P the first L stages get a block each and the others
 * none: a middle stage (0 < p < P-1) with no block holds no module at all, so the split needs L >= P - 1. */
#ifndef HWFSDP_PIPE_SPLIT_H
#define HWFSDP_PIPE_SPLIT_H

/* The module range of stage p: sets *first and *last, returns 0 if the stage holds no module (last < first). */
static inline int pipe_split(int L, int P, int p, int *first, int *last) {
    int before = 0; /* blocks on the stages before p */
    for (int q = 0; q < p; q++) before += L / P + (q < L % P);
    const int blocks = L / P + (p < L % P);
    *first = p == 0 ? 0 : 1 + before;
    *last = p == P - 1 ? L + 1 : before + blocks;
    return *last >= *first;
}

/* The first stage that would hold no module, or -1 when every stage holds one. */
static inline int pipe_split_empty_stage(int L, int P) {
    for (int p = 0; p < P; p++) {
        int first, last;
        if (!pipe_split(L, P, p, &first, &last)) return p;
    }
    return -1;
}

#endif
