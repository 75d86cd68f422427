/* test_io.c — unit tests for optim.c, data.c, safetensors.c and json.c (runtime).
 *
 *   test_io [TEST_NAME]          run the unit tests (or one of them)
 *   test_io --load-npy FILE      probe modes used by tests/test_io_errors.py:
 *   test_io --check FILE T VOCAB   they print what they loaded on stdout, and
 *   test_io --batch FILE S R W B T bad input ends in the runtime's one-line
 *   test_io --save-npy FILE N      "error: ..." and exit status 2
 *   test_io --load-st FILE
 *   test_io --write-st FILE
 */
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "check.h"
#include "model/data.h"
#include "model/optim.h"
#include "model/safetensors.h"
#include "runtime/json.h"
#include "runtime/util.h"

static void tmp_path(char *buf, size_t cap, const char *name) {
    const char *dir = getenv("TMPDIR");
    snprintf(buf, cap, "%s/test_io_%d_%s", dir && dir[0] ? dir : "/tmp", (int)getpid(), name);
}

/* ----------------------------------------------------------------- optim */

TEST(adamw_matches_reference) {
    AdamWConfig c = adamw_default_config();
    c.lr = 1e-2f;
    c.weight_decay = 0.1f;
    enum { N = 5, STEPS = 3 };
    float p[N] = {0.5f, -1.25f, 2.0f, 0.0f, -0.03f};
    float m[N] = {0}, v[N] = {0};
    double pr[N], mr[N] = {0}, vr[N] = {0};
    for (int i = 0; i < N; i++) pr[i] = p[i];
    const float grads[STEPS][N] = {
        {0.1f, -0.2f, 0.3f, 1e-4f, -5.0f}, {-0.4f, 0.05f, 0.3f, 0.0f, 2.0f}, {0.25f, 0.25f, -1.0f, 3.0f, 0.5f}};
    const float scale[STEPS] = {1.0f, 0.5f, 0.9f};
    for (int s = 0; s < STEPS; s++) {
        int t = s + 1;
        double lr = 1e-2, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
        adamw_update(p, grads[s], m, v, N, &c, c.lr, t, scale[s]);
        for (int i = 0; i < N; i++) {
            double g = (double)grads[s][i] * scale[s];
            pr[i] *= 1 - lr * wd;
            mr[i] = b1 * mr[i] + (1 - b1) * g;
            vr[i] = b2 * vr[i] + (1 - b2) * g * g;
            double mhat = mr[i] / (1 - pow(b1, t)), vhat = vr[i] / (1 - pow(b2, t));
            pr[i] -= lr * mhat / (sqrt(vhat) + eps);
        }
        for (int i = 0; i < N; i++) {
            CHECK_CLOSE(p[i], pr[i], 1e-5, 1e-7, "param");
            CHECK_CLOSE(m[i], mr[i], 1e-5, 1e-9, "exp_avg");
            CHECK_CLOSE(v[i], vr[i], 1e-5, 1e-12, "exp_avg_sq");
        }
    }
    /* first step without decay moves every nonzero-grad param by ~lr */
    float q[2] = {1.0f, 1.0f}, gq[2] = {3.0f, -1e-3f}, mq[2] = {0}, vq[2] = {0};
    c.weight_decay = 0;
    adamw_update(q, gq, mq, vq, 2, &c, 1e-2f, 1, 1.0f);
    CHECK_CLOSE(q[0], 0.99, 0, 1e-6, "step 1 moves by -lr");
    CHECK_CLOSE(q[1], 1.01, 0, 1e-5, "step 1 moves by +lr");
}

TEST(warmup) {
    AdamWConfig c = adamw_default_config();
    CHECK_CLOSE(c.lr, 8e-4, 1e-7, 0, "default lr");
    CHECK(c.beta1 == 0.9f && c.beta2 == 0.95f && c.eps == 1e-8f && c.weight_decay == 0.1f, "defaults");
    c.lr = 1.0f;
    c.warmup_steps = 3;
    CHECK_CLOSE(lr_at_step(&c, 0), 0.25, 1e-7, 0, "step 0");
    CHECK_CLOSE(lr_at_step(&c, 1), 0.5, 1e-7, 0, "step 1");
    CHECK_CLOSE(lr_at_step(&c, 2), 0.75, 1e-7, 0, "step 2");
    CHECK_CLOSE(lr_at_step(&c, 3), 1.0, 1e-7, 0, "step 3");
    CHECK_CLOSE(lr_at_step(&c, 1000), 1.0, 1e-7, 0, "step 1000");
    c.lr = 8e-4f;
    c.warmup_steps = 2;
    CHECK_CLOSE(lr_at_step(&c, 0), 8e-4 / 3, 1e-6, 0, "torchtitan debugmodel step 0");
    CHECK_CLOSE(lr_at_step(&c, 1), 8e-4 * 2 / 3, 1e-6, 0, "torchtitan debugmodel step 1");
    c.warmup_steps = 0;
    CHECK_CLOSE(lr_at_step(&c, 0), 8e-4, 1e-7, 0, "no warmup");
}

TEST(clip_coefficient) {
    AdamWConfig c = adamw_default_config();
    c.max_norm = 1.0f;
    CHECK_CLOSE(clip_coefficient(&c, 4.0f), 1.0 / (4.0 + 1e-6), 1e-6, 0, "norm 4");
    CHECK(clip_coefficient(&c, 0.5f) == 1.0f, "below max_norm: no clipping");
    CHECK(clip_coefficient(&c, 0.0f) == 1.0f, "zero norm");
    CHECK_CLOSE(clip_coefficient(&c, 1.0f), 1.0 / (1.0 + 1e-6), 1e-7, 0, "at max_norm");
    c.max_norm = 0.25f;
    CHECK_CLOSE(clip_coefficient(&c, 10.0f), 0.025, 1e-6, 0, "max_norm 0.25");
    c.max_norm = 0.0f;
    CHECK(clip_coefficient(&c, 1e6f) == 1.0f, "off");
}

/* ------------------------------------------------------------------ data */

static TokenData iota_tokens(size_t n) {
    TokenData d;
    memset(&d, 0, sizeof d);
    d.tokens = xmalloc(n * sizeof(int32_t));
    d.n = n;
    for (size_t i = 0; i < n; i++) d.tokens[i] = (int32_t)i;
    d.max_token = (int32_t)(n - 1);
    return d;
}

TEST(batch_formula) {
    TokenData d = iota_tokens(1000);
    const struct { int s, r, w; size_t B, T; } cases[] = {
        {0, 0, 1, 1, 8}, {0, 0, 1, 4, 16}, {3, 1, 2, 2, 32}, {7, 3, 4, 3, 64},
        {100, 2, 3, 5, 100}, /* wraps the modulo many times */
        {12345, 7, 8, 2, 997}, /* T = n - 3: span 2 */
        {0, 0, 1, 2, 998},    /* n = T + 2: span 1, every start is 0 */
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        size_t B = cases[k].B, T = cases[k].T;
        int32_t *in = xmalloc(B * T * sizeof(int32_t)), *tg = xmalloc(B * T * sizeof(int32_t));
        data_batch(&d, cases[k].s, cases[k].r, cases[k].w, B, T, in, tg);
        int bad = 0;
        for (size_t i = 0; i < B; i++) {
            unsigned long long g = ((unsigned long long)cases[k].s * (unsigned long long)cases[k].w +
                                    (unsigned long long)cases[k].r) * B + i;
            unsigned long long start = (g * T) % (unsigned long long)(d.n - T - 1);
            for (size_t j = 0; j < T; j++) {
                if (in[i * T + j] != (int32_t)(start + j)) bad++;
                if (tg[i * T + j] != (int32_t)(start + j + 1)) bad++;
            }
        }
        CHECK(bad == 0, "case %zu: %d tokens differ from the formula", k, bad);
        free(in);
        free(tg);
    }
    /* wrap-around explicitly: n = 110, T = 10 -> span 99; sample 10 starts at 100 % 99 = 1 */
    TokenData e = iota_tokens(110);
    int32_t in[10], tg[10];
    data_batch(&e, 10, 0, 1, 1, 10, in, tg);
    CHECK(in[0] == 1 && tg[0] == 2 && in[9] == 10 && tg[9] == 11, "wrap: in[0]=%d tg[9]=%d", (int)in[0], (int)tg[9]);
    data_batch(&e, 9, 0, 1, 1, 10, in, tg);
    CHECK(in[0] == 90 && tg[9] == 100, "last before wrap: in[0]=%d", (int)in[0]);
    data_free(&d);
    data_free(&e);
}

TEST(batch_global_equivalence) {
    /* world 1 with batch W*B sees the same sequences, in rank order, as W
     * ranks with batch B each: FSDP does not change the data */
    TokenData d = iota_tokens(5003);
    const int worlds[] = {2, 3, 4, 8};
    const size_t T = 37, B = 3;
    for (size_t wi = 0; wi < sizeof worlds / sizeof worlds[0]; wi++) {
        int W = worlds[wi];
        size_t G = (size_t)W * B;
        int32_t *gin = xmalloc(G * T * 4), *gtg = xmalloc(G * T * 4), *rin = xmalloc(B * T * 4),
                *rtg = xmalloc(B * T * 4);
        int bad = 0;
        for (int s = 0; s < 50; s++) {
            data_batch(&d, s, 0, 1, G, T, gin, gtg);
            for (int r = 0; r < W; r++) {
                data_batch(&d, s, r, W, B, T, rin, rtg);
                if (memcmp(rin, gin + (size_t)r * B * T, B * T * 4) || memcmp(rtg, gtg + (size_t)r * B * T, B * T * 4))
                    bad++;
            }
        }
        CHECK(bad == 0, "world %d: %d (step, rank) batches differ from the global batch", W, bad);
        free(gin);
        free(gtg);
        free(rin);
        free(rtg);
    }
    data_free(&d);
}

TEST(npy_round_trip) {
    char path[512];
    tmp_path(path, sizeof path, "tokens.npy");
    const size_t n = 1234;
    int32_t *t = xmalloc(n * sizeof(int32_t));
    for (size_t i = 0; i < n; i++) t[i] = (int32_t)((i * 7919) % 50000);
    data_save_npy(path, t, n);
    size_t bytes = 0;
    unsigned char *raw = read_file_all(path, &bytes);
    CHECK(bytes == 128 + 4 * n, "file size %zu (header padded to 64 bytes)", bytes);
    CHECK(raw[8] + 256 * raw[9] + 10 == 128, "header length");
    free(raw);
    TokenData d = data_load(path);
    CHECK(d.n == n, "n %zu", d.n);
    CHECK(d.n == n && !memcmp(d.tokens, t, n * sizeof(int32_t)), "tokens differ");
    int32_t mx = 0;
    for (size_t i = 0; i < n; i++) mx = t[i] > mx ? t[i] : mx;
    CHECK(d.max_token == mx, "max_token %d vs %d", (int)d.max_token, (int)mx);
    data_check(&d, 16, 50000);
    data_free(&d);
    unlink(path);
    free(t);
}

TEST(text_is_bytes) {
    char path[512];
    tmp_path(path, sizeof path, "text.txt");
    const char *s = "hello, world\n\xff";
    write_file_atomic(path, s, strlen(s));
    TokenData d = data_load(path);
    CHECK(d.n == strlen(s), "n %zu", d.n);
    CHECK(d.tokens[0] == 'h' && d.tokens[12] == '\n' && d.tokens[13] == 255, "bytes");
    CHECK(d.max_token == 255, "max %d", (int)d.max_token);
    data_free(&d);
    unlink(path);
}

/* ----------------------------------------------------------- safetensors */

TEST(safetensors_round_trip) {
    char path[512];
    tmp_path(path, sizeof path, "w.safetensors");
    float a[6] = {1, 2, 3, 4, 5, 6}, b[5] = {-1.5f, 0.25f, 1e-30f, 3e30f, -0.0f}, c[24], s0[1] = {42};
    for (int i = 0; i < 24; i++) c[i] = (float)i * 0.5f - 3;
    StTensor in[5];
    memset(in, 0, sizeof in);
    in[0] = (StTensor){.name = "layers.0.attention.wq.weight", .ndim = 2, .shape = {2, 3}, .numel = 6, .data = a};
    in[1] = (StTensor){.name = "norm.weight", .ndim = 1, .shape = {5}, .numel = 5, .data = b};
    in[2] = (StTensor){.name = "odd \"name\"\\x", .ndim = 3, .shape = {2, 3, 4}, .numel = 24, .data = c};
    in[3] = (StTensor){.name = "scalar", .ndim = 0, .numel = 1, .data = s0};
    in[4] = (StTensor){.name = "empty", .ndim = 2, .shape = {0, 7}, .numel = 0, .data = NULL};
    st_write(path, in, 5, "\"format\":\"pt\",\"step\":\"3\"");
    size_t bytes = 0;
    unsigned char *raw = read_file_all(path, &bytes);
    unsigned long long hl = 0;
    for (int i = 7; i >= 0; i--) hl = hl << 8 | raw[i];
    CHECK(hl % 8 == 0, "header length %llu not a multiple of 8", hl);
    CHECK(bytes == 8 + hl + 4 * (6 + 5 + 24 + 1), "file size %zu", bytes);
    free(raw);

    StFile f = st_read(path);
    CHECK(f.n == 5, "n %d", f.n);
    for (int i = 0; i < 5 && i < f.n; i++) {
        const StTensor *t = st_get(&f, in[i].name, path);
        CHECK(t->ndim == in[i].ndim && t->numel == in[i].numel, "%s: ndim/numel", in[i].name);
        for (int k = 0; k < in[i].ndim; k++) CHECK(t->shape[k] == in[i].shape[k], "%s: dim %d", in[i].name, k);
        CHECK(t->numel == 0 || !memcmp(t->data, in[i].data, t->numel * 4), "%s: data", in[i].name);
        CHECK(((uintptr_t)t->data & 3) == 0, "%s: data not aligned", in[i].name);
    }
    const size_t want[3] = {2, 3, 4};
    st_expect_shape(st_get(&f, "odd \"name\"\\x", path), 3, want, path);
    st_free(&f);
    unlink(path);
}

TEST(safetensors_unaligned_header) {
    /* a header whose length is not a multiple of 4 (allowed by the format) */
    char path[512];
    tmp_path(path, sizeof path, "u.safetensors");
    const char *hdr = "{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"n\\u00e9\":{\"dtype\":\"F32\","
                      "\"shape\":[1],\"data_offsets\":[8,12]}}";
    size_t hl = strlen(hdr);
    if (hl % 4 == 0) hl++; /* make sure it is unaligned */
    unsigned char buf[512];
    memset(buf, ' ', sizeof buf);
    for (int i = 0; i < 8; i++) buf[i] = (unsigned char)((unsigned long long)hl >> (8 * i));
    memcpy(buf + 8, hdr, strlen(hdr));
    float vals[3] = {1.5f, -2.5f, 7.0f};
    memcpy(buf + 8 + hl, vals, sizeof vals);
    write_file_atomic(path, buf, 8 + hl + sizeof vals);
    StFile f = st_read(path);
    const StTensor *w = st_get(&f, "w", path), *e = st_get(&f, "n\xc3\xa9", path);
    CHECK(((uintptr_t)w->data & 3) == 0, "aligned");
    CHECK(w->data[0] == 1.5f && w->data[1] == -2.5f && e->data[0] == 7.0f, "values");
    st_free(&f);
    unlink(path);
}

/* ------------------------------------------------------------------ json */

TEST(json_escapes_strings) {
    Json j = {0};
    json_array_begin(&j);
    json_string(&j, "a \"quoted\" \\path\\");
    json_string(&j, "tab\tnewline\nbell\x07 unit\x1f del\x7f caf\xc3\xa9");
    json_string(&j, NULL);
    json_stringf(&j, "%s.%d", "block\"3", 7);
    json_array_end(&j);
    const char *want = "[\"a \\\"quoted\\\" \\\\path\\\\\","
                       "\"tab\\u0009newline\\u000abell\\u0007 unit\\u001f del\x7f caf\xc3\xa9\","
                       "\"\",\"block\\\"3.7\"]";
    CHECK(!strcmp(json_text(&j), want), "got %s", json_text(&j));
    CHECK(json_len(&j) == strlen(want), "length %zu", json_len(&j));
    json_free(&j);
    CHECK(!strcmp(json_text(&j), "") && json_len(&j) == 0, "freed writer is empty");
}

TEST(json_nests_with_commas) {
    Json j = {0};
    json_object_begin(&j);
    json_key(&j, "n");
    json_int(&j, -3);
    json_key(&j, "big");
    json_uint(&j, 18446744073709551615ull);
    json_key(&j, "empty");
    json_object_begin(&j);
    json_object_end(&j);
    json_key(&j, "rows");
    json_array_begin(&j);
    for (int i = 0; i < 2; i++) {
        json_object_begin(&j);
        json_key(&j, "i");
        json_int(&j, i);
        json_key(&j, "ok");
        json_bool(&j, i);
        json_key(&j, "none");
        json_null(&j);
        json_object_end(&j);
    }
    json_array_begin(&j);
    json_array_end(&j);
    json_array_end(&j);
    json_key(&j, "lines");
    json_array_begin_lines(&j);
    json_int(&j, 1);
    json_int(&j, 2);
    json_array_end(&j);
    json_key(&j, "no_lines");
    json_array_begin_lines(&j);
    json_array_end(&j);
    json_key(&j, "num");
    json_array_begin(&j);
    json_g(&j, 0.1, 9);
    json_g(&j, 8e-4, 6);
    json_fixed(&j, 1.5, 3);
    json_fixed(&j, 1234567.0, 0);
    json_g(&j, NAN, 9);
    json_fixed(&j, -INFINITY, 3);
    json_array_end(&j);
    /* a note's fields, written apart, then put inside an object */
    Json f = {0};
    json_members_begin(&f);
    json_key(&f, "step");
    json_int(&f, 2);
    json_key(&f, "module");
    json_string(&f, "head");
    json_members_end(&f);
    CHECK(!strcmp(json_text(&f), "\"step\":2,\"module\":\"head\""), "members: %s", json_text(&f));
    json_key(&j, "note");
    json_object_begin(&j);
    json_key(&j, "kind");
    json_string(&j, "hook_check");
    json_members(&j, json_text(&f));
    json_members(&j, "");
    json_object_end(&j);
    json_free(&f);
    json_object_end(&j);
    json_line_end(&j);
    const char *want = "{\"n\":-3,\"big\":18446744073709551615,\"empty\":{},"
                       "\"rows\":[{\"i\":0,\"ok\":false,\"none\":null},{\"i\":1,\"ok\":true,\"none\":null},[]],"
                       "\"lines\":[\n1,\n2\n],\"no_lines\":[\n],"
                       "\"num\":[0.1,0.0008,1.500,1234567,null,null],"
                       "\"note\":{\"kind\":\"hook_check\",\"step\":2,\"module\":\"head\"}}\n";
    CHECK(!strcmp(json_text(&j), want), "got %s", json_text(&j));
    /* reset keeps the buffer and starts a new document */
    json_reset(&j);
    json_int(&j, 5);
    CHECK(!strcmp(json_text(&j), "5"), "after reset: %s", json_text(&j));
    json_free(&j);
}

TEST(json_grows_past_its_first_buffer) {
    /* 5,000 characters, two in five of them quotes or backslashes: far past the first 256 bytes */
    enum { N = 5000 };
    char *s = xmalloc(N + 1);
    for (int i = 0; i < N; i++) s[i] = i % 5 == 3 ? '"' : i % 5 == 4 ? '\\' : (char)('a' + i % 26);
    s[N] = 0;
    Json j = {0};
    json_object_begin(&j);
    json_key(&j, "data");
    json_string(&j, s);
    json_key(&j, "many");
    json_array_begin(&j);
    for (int i = 0; i < 1000; i++) json_int(&j, i);
    json_array_end(&j);
    json_object_end(&j);
    const char *t = json_text(&j);
    size_t escaped = N + N / 5 * 2; /* every quote and backslash gains a backslash */
    CHECK(!strncmp(t, "{\"data\":\"", 9), "start");
    size_t k = 9, bad = 0;
    for (int i = 0; i < N; i++) {
        if (s[i] == '"' || s[i] == '\\') bad += t[k++] != '\\';
        bad += t[k++] != s[i];
    }
    CHECK(bad == 0 && k == 9 + escaped, "%zu characters escaped wrongly", bad);
    CHECK(!strncmp(t + k, "\",\"many\":[0,1,2,", 14), "after the string: %.20s", t + k);
    size_t tail = strlen(",998,999]}");
    CHECK(json_len(&j) == strlen(t) && !strcmp(t + json_len(&j) - tail, ",998,999]}"), "end: %s",
          t + json_len(&j) - tail);
    json_free(&j);
    free(s);
}

/* ---------------------------------------------------------- probe modes */

static long arg_long(const char *s) {
    char *end;
    long v = strtol(s, &end, 10);
    if (*end || end == s) fatal("bad number '%s'", s);
    return v;
}

static int probe(int argc, char **argv) {
    const char *mode = argv[1];
    if (!strcmp(mode, "--load-npy") && argc == 3) {
        TokenData d = data_load(argv[2]);
        printf("n %zu max %d\n", d.n, (int)d.max_token);
        for (size_t i = 0; i < d.n; i++) printf("%d%c", (int)d.tokens[i], i + 1 == d.n ? '\n' : ' ');
        data_free(&d);
        return 0;
    }
    if (!strcmp(mode, "--check") && argc == 5) {
        TokenData d = data_load(argv[2]);
        data_check(&d, (size_t)arg_long(argv[3]), (int)arg_long(argv[4]));
        printf("ok\n");
        data_free(&d);
        return 0;
    }
    if (!strcmp(mode, "--batch") && argc == 8) {
        TokenData d = data_load(argv[2]);
        size_t B = (size_t)arg_long(argv[6]), T = (size_t)arg_long(argv[7]);
        int32_t *in = xmalloc(B * T * 4), *tg = xmalloc(B * T * 4);
        data_batch(&d, (int)arg_long(argv[3]), (int)arg_long(argv[4]), (int)arg_long(argv[5]), B, T, in, tg);
        for (size_t i = 0; i < B * T; i++) printf("%d%c", (int)in[i], i + 1 == B * T ? '\n' : ' ');
        for (size_t i = 0; i < B * T; i++) printf("%d%c", (int)tg[i], i + 1 == B * T ? '\n' : ' ');
        free(in);
        free(tg);
        data_free(&d);
        return 0;
    }
    if (!strcmp(mode, "--save-npy") && argc == 4) {
        size_t n = (size_t)arg_long(argv[3]);
        int32_t *t = xmalloc(n * 4);
        for (size_t i = 0; i < n; i++) t[i] = (int32_t)((i * 7919) % 100003);
        data_save_npy(argv[2], t, n);
        free(t);
        return 0;
    }
    if (!strcmp(mode, "--load-st") && argc == 3) {
        StFile f = st_read(argv[2]);
        for (int i = 0; i < f.n; i++) {
            const StTensor *t = &f.tensors[i];
            printf("%s|%d|", t->name, t->ndim);
            for (int k = 0; k < t->ndim; k++) printf(k ? ",%zu" : "%zu", t->shape[k]);
            printf("|");
            for (size_t k = 0; k < t->numel; k++) printf(k ? " %.9g" : "%.9g", (double)t->data[k]);
            printf("\n");
        }
        st_free(&f);
        return 0;
    }
    if (!strcmp(mode, "--write-st") && argc == 3) {
        float a[12], b[4] = {0.5f, -0.25f, 1e-20f, 123456.789f};
        for (int i = 0; i < 12; i++) a[i] = (float)i / 3.0f;
        StTensor t[3];
        memset(t, 0, sizeof t);
        t[0] = (StTensor){.name = "tok_embeddings.weight", .ndim = 2, .shape = {4, 3}, .numel = 12, .data = a};
        t[1] = (StTensor){.name = "norm.weight", .ndim = 1, .shape = {4}, .numel = 4, .data = b};
        t[2] = (StTensor){.name = "cube", .ndim = 3, .shape = {1, 2, 2}, .numel = 4, .data = b};
        st_write(argv[2], t, 3, "\"format\":\"pt\",\"step\":\"7\"");
        return 0;
    }
    fatal("unknown probe mode '%s' (or wrong number of arguments)", mode);
}

int main(int argc, char **argv) {
    if (argc > 1 && argv[1][0] == '-' && argv[1][1] == '-') return probe(argc, argv);
    return check_main(argc, argv);
}
