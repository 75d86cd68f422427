/* safetensors.h — read and write .safetensors files (F32 tensors only).
 *
 * Format: 8-byte little-endian header length N, N bytes of JSON
 * {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
 *  "__metadata__": {...}}, then the raw data (offsets relative to its start).
 * Writes are atomic (util.h write_file_atomic). */
#ifndef HWFSDP_SAFETENSORS_H
#define HWFSDP_SAFETENSORS_H

#include <stddef.h>

typedef struct {
    char *name;
    int ndim;
    size_t shape[4];
    size_t numel;
    float *data;      /* points into the file buffer (read) or caller memory (write) */
} StTensor;

typedef struct {
    StTensor *tensors;
    int n;
    void *buffer;     /* whole file (read) */
    int n_meta;       /* __metadata__ entries (string values) */
    char **meta_keys, **meta_values;
} StFile;

/* Read and validate; fatal with a clear line naming the file and what is wrong
 * (short file, bad header length, bad JSON, dtype other than F32, offsets out
 * of range or overlapping, shape/offset size mismatch). */
StFile st_read(const char *path);
/* The tensor called name, or fatal "tensor X missing from FILE". */
const StTensor *st_get(const StFile *f, const char *name, const char *path);
/* Fatal "tensor X in FILE has shape [a, b], expected [c, d]" on mismatch. */
void st_expect_shape(const StTensor *t, int ndim, const size_t *shape, const char *path);
/* The __metadata__ value for key, or NULL. */
const char *st_meta(const StFile *f, const char *key);
/* 1 if the file has a tensor called name. */
int st_has(const StFile *f, const char *name);
void st_free(StFile *f);
/* Write n tensors (data taken from t[i].data). metadata_json: body of the
 * __metadata__ object of string values, e.g. "\"format\":\"pt\"" (may be NULL). */
void st_write(const char *path, const StTensor *t, int n, const char *metadata_json);

#endif
