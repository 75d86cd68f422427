/* data.h — tokens and the batch order contract.
 *
 * Tokens are a 1-D int32 array. Sources: a .npy file (1-D, uint16 or int32,
 * little-endian, C order, as numpy.save writes it) or any other file read as
 * text with the byte-level tokenizer (token = byte value, 0..255).
 *
 * Batch order (DESIGN.md): for step s, rank r of W, sample i of B, seq len T:
 *   start = ((s*W + r)*B + i) * T  mod  (n_tokens - T - 1)
 *   inputs = tokens[start : start+T], targets = tokens[start+1 : start+T+1]
 */
#ifndef HWFSDP_DATA_H
#define HWFSDP_DATA_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    int32_t *tokens;   /* [n] */
    size_t n;
    int32_t max_token; /* largest token id present */
    char *path;        /* the file it came from, for messages (owned; may be NULL) */
} TokenData;

/* Load; fatal with one clear line on a missing, empty, truncated or malformed
 * file, or a negative token. */
TokenData data_load(const char *path);
void data_free(TokenData *d);
/* Fatal unless n >= T + 2 and every token < vocab_size. */
void data_check(const TokenData *d, size_t T, int vocab_size);
/* Fill inputs[B*T] and targets[B*T] for (step, rank, world) per the contract. */
void data_batch(const TokenData *d, int step, int rank, int world, size_t B, size_t T, int32_t *inputs,
                int32_t *targets);
/* Write tokens as a 1-D int32 .npy (atomic). */
void data_save_npy(const char *path, const int32_t *tokens, size_t n);

#endif
