/* fuzz_tokens.c — libFuzzer target for the token-file reader (common/model/data.c).
 *
 * Every input must end in exactly one of:
 *   - a clean fatal() (one line) from data_load or data_check: bad input, reported;
 *   - tokens that are consistent: a file without the .npy magic is read as
 *     bytes (token i = byte i); an .npy file reads back the same after
 *     data_save_npy; max_token is the maximum; data_batch follows the
 *     documented formula (DESIGN.md, computed here in 128-bit arithmetic).
 * A crash, a sanitizer report, a leak or a fatal() during the checks is a finding.
 *   make fuzz-build && build-fuzz/fuzz_tokens fuzz/corpus/tokens */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "model/data.h"
#define FUZZ_TARGET "fuzz_tokens"
#include "fuzz_support.h"

static uint64_t fnv1a(const uint8_t *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

static void check_tokens(const TokenData *d, const uint8_t *data, size_t size) {
    static const char magic[6] = {'\x93', 'N', 'U', 'M', 'P', 'Y'};
    CHECK(d->n > 0 && d->tokens, "no tokens but no error");
    int32_t mx = 0;
    for (size_t i = 0; i < d->n; i++) {
        CHECK(d->tokens[i] >= 0, "negative token %d at %zu", (int)d->tokens[i], i);
        if (d->tokens[i] > mx) mx = d->tokens[i];
    }
    CHECK(mx == d->max_token, "max_token %d, the maximum is %d", (int)d->max_token, (int)mx);
    if (size >= 6 && !memcmp(data, magic, 6)) {
        /* .npy: it round-trips through the writer */
        const char *path = fuzz_scratch("round_trip.npy");
        data_save_npy(path, d->tokens, d->n);
        TokenData e = data_load(path);
        CHECK(e.n == d->n && !memcmp(e.tokens, d->tokens, d->n * sizeof(int32_t)), "npy round trip differs");
        data_free(&e);
    } else {
        CHECK(d->n == size, "text: %zu tokens from %zu bytes", d->n, size);
        for (size_t i = 0; i < size; i++) CHECK(d->tokens[i] == data[i], "text: token %zu is not the byte", i);
    }
}

/* A few batches with parameters taken from the input's hash, against the formula. */
static void check_batches(const TokenData *d, uint64_t h, size_t T) {
    const size_t B = 1 + (size_t)(h >> 20 & 3);
    int32_t *in = xmalloc(B * T * sizeof(int32_t)), *tg = xmalloc(B * T * sizeof(int32_t));
    for (int k = 0; k < 4; k++) {
        uint64_t r = h * (2 * (uint64_t)k + 1) + (uint64_t)k;
        /* k = 3: the largest step and world data_batch accepts (products far beyond 64 bits) */
        int world = k == 3 ? 0x7fffffff : 1 + (int)(r >> 8 & 63);
        int rank = (int)((r >> 16) % (uint64_t)world);
        int step = k == 3 ? 0x7fffffff - (int)(r >> 40 & 0xff) : (int)(r >> 24 & 0xffffff);
        data_batch(d, step, rank, world, B, T, in, tg);
        unsigned __int128 span = d->n - T - 1;
        for (size_t i = 0; i < B; i++) {
            unsigned __int128 start =
                (((unsigned __int128)step * (unsigned)world + (unsigned)rank) * B + i) * T % span;
            for (size_t j = 0; j < T; j++) {
                CHECK(in[i * T + j] == d->tokens[(size_t)start + j] && tg[i * T + j] == d->tokens[(size_t)start + j + 1],
                      "data_batch(step %d, rank %d, world %d, B %zu, T %zu) sample %zu differs from the formula", step,
                      rank, world, B, T, i);
            }
        }
    }
    free(in);
    free(tg);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_input_file(data, size);
    const uint64_t h = fnv1a(data, size);
    volatile int clean = 0; /* read after a longjmp */
    if (FUZZ_TRY()) {
        TokenData d = data_load(path);
        fuzz_no_fatal_from_here();
        check_tokens(&d, data, size);
        /* data_check may reject (too short for T, a token outside the vocabulary) */
        fuzz_fatal_ok_from_here();
        size_t T = 1 + (size_t)(h % 16);
        int vocab = (h >> 8 & 1) && d.max_token < 0x7fffffff ? d.max_token + 1 : 1 + (int)(h >> 9 & 0x1ffff);
        data_check(&d, T, vocab);
        fuzz_no_fatal_from_here();
        check_batches(&d, h, T);
        data_free(&d);
        clean = 1;
    }
    fuzz_end(clean, "data_load");
    return 0;
}
