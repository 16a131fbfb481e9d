/* Helpers shared by the session tests (api_session_*, leak_session*, api_cpp_session*):
 *
 * - temporary file paths and whole-file I/O;
 * - a minimal reader of the session's checkpoint files. A checkpoint is a safetensors file
 *   (8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and
 *   byte range, then the data); per named param slice it holds `master/<name>`,
 *   `exp_avg/<name>` and `exp_avg_sq/<name>`. The C API has no call that returns the moments,
 *   so the tests read them from a checkpoint;
 * - a small model: sub-groups of named slices with their master weights, registered in a
 *   session, and a snapshot of the session's whole optimizer state (master weights, moments,
 *   step counts) taken through a checkpoint.
 *
 * Everything is `static inline` and in the common subset of C11 and C++17, like so_test.h.
 */
#ifndef SO_SESSION_TEST_H
#define SO_SESSION_TEST_H

#include <errno.h>
#include <unistd.h>

#include "so_test.h"

/* ------------------------------------------------------------------------------- files */

/* A path in $TMPDIR (or /tmp) unique to this process and `tag`. */
static inline void so_st_temp_path(char *buf, size_t len, const char *tag) {
    const char *dir = getenv("TMPDIR");
    if (dir == NULL || dir[0] == '\0') dir = "/tmp";
    int n = snprintf(buf, len, "%s/superoffload-ctest-%ld-%s.safetensors", dir, (long)getpid(), tag);
    CHECK(n > 0 && (size_t)n < len);
}

/* The whole file (NUL-terminated for convenience; the NUL is not counted in *out_len), or
 * NULL if it cannot be opened. */
static inline unsigned char *so_st_read_file(const char *path, size_t *out_len) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) return NULL;
    CHECK(fseek(f, 0, SEEK_END) == 0);
    long size = ftell(f);
    CHECK(size >= 0);
    CHECK(fseek(f, 0, SEEK_SET) == 0);
    unsigned char *bytes = (unsigned char *)so_test_malloc((size_t)size + 1);
    CHECK(fread(bytes, 1, (size_t)size, f) == (size_t)size);
    fclose(f);
    bytes[size] = 0;
    *out_len = (size_t)size;
    return bytes;
}

static inline void so_st_write_file(const char *path, const void *data, size_t len) {
    FILE *f = fopen(path, "wb");
    CHECKF(f != NULL, "cannot write %s: %s", path, strerror(errno));
    if (len > 0) CHECK(fwrite(data, 1, len, f) == len);
    CHECK(fclose(f) == 0);
}

/* ------------------------------------------------------------------ checkpoint reader */

typedef struct so_st_ckpt {
    unsigned char *bytes; /* the whole file */
    size_t len;
    char *header;      /* the JSON header, NUL-terminated copy */
    size_t data_start; /* offset of the data section in `bytes` */
} so_st_ckpt;

/* Reads and checks the framing of a checkpoint (exits on a malformed file: the tests only
 * read checkpoints the library wrote). */
static inline so_st_ckpt so_st_ckpt_read(const char *path) {
    so_st_ckpt c;
    c.bytes = so_st_read_file(path, &c.len);
    CHECKF(c.bytes != NULL, "cannot read the checkpoint %s", path);
    CHECKF(c.len >= 8, "%s: %zu bytes", path, c.len);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | c.bytes[i];
    CHECKF(n <= c.len - 8, "%s: header length %llu beyond the file", path, (unsigned long long)n);
    c.header = (char *)so_test_malloc((size_t)n + 1);
    memcpy(c.header, c.bytes + 8, (size_t)n);
    c.header[n] = '\0';
    CHECKF(c.header[0] == '{', "%s: the header is not a JSON object", path);
    c.data_start = 8 + (size_t)n;
    return c;
}

static inline void so_st_ckpt_free(so_st_ckpt *c) {
    free(c->bytes);
    free(c->header);
    c->bytes = NULL;
    c->header = NULL;
}

/* The entry of tensor `<prefix>/<slice>`: its dtype string is checked to be "F32" and its
 * bytes are returned (pointer into the file, count in *out_bytes). Exits if absent. */
static inline const unsigned char *so_st_ckpt_tensor(const so_st_ckpt *c, const char *prefix, const char *slice,
                                                     size_t *out_bytes) {
    char key[512];
    int n = snprintf(key, sizeof key, "\"%s/%s\":", prefix, slice);
    CHECK(n > 0 && (size_t)n < sizeof key);
    const char *entry = strstr(c->header, key);
    CHECKF(entry != NULL, "the checkpoint has no tensor %s/%s", prefix, slice);
    const char *end = strchr(entry, '}');
    CHECK(end != NULL);
    const char *dtype = strstr(entry, "\"dtype\":\"F32\"");
    CHECKF(dtype != NULL && dtype < end, "tensor %s/%s is not F32", prefix, slice);
    const char *offsets = strstr(entry, "\"data_offsets\":[");
    CHECKF(offsets != NULL && offsets < end, "tensor %s/%s has no data_offsets", prefix, slice);
    unsigned long long begin = 0, stop = 0;
    CHECK(sscanf(offsets + strlen("\"data_offsets\":["), "%llu,%llu", &begin, &stop) == 2);
    CHECK(begin <= stop && stop <= c->len - c->data_start);
    *out_bytes = (size_t)(stop - begin);
    return c->bytes + c->data_start + begin;
}

/* Copies tensor `<prefix>/<slice>` (F32, `numel` elements, else exits) into `dst`. */
static inline void so_st_ckpt_copy_f32(const so_st_ckpt *c, const char *prefix, const char *slice, float *dst,
                                       size_t numel) {
    size_t bytes = 0;
    const unsigned char *src = so_st_ckpt_tensor(c, prefix, slice, &bytes);
    CHECKF(bytes == numel * sizeof(float), "tensor %s/%s has %zu bytes, expected %zu", prefix, slice, bytes,
           numel * sizeof(float));
    memcpy(dst, src, bytes);
}

/* The metadata value of `key` into `out` (at most len - 1 bytes); false if absent. */
static inline bool so_st_ckpt_meta(const so_st_ckpt *c, const char *key, char *out, size_t len) {
    const char *meta = strstr(c->header, "\"__metadata__\":{");
    if (meta == NULL) return false;
    const char *end = strchr(meta, '}');
    char pattern[256];
    int n = snprintf(pattern, sizeof pattern, "\"%s\":\"", key);
    CHECK(n > 0 && (size_t)n < sizeof pattern);
    const char *at = strstr(meta, pattern);
    if (at == NULL || at > end) return false;
    at += n;
    const char *stop = strchr(at, '"');
    CHECK(stop != NULL);
    size_t k = (size_t)(stop - at);
    CHECK(k < len);
    memcpy(out, at, k);
    out[k] = '\0';
    return true;
}

/* ------------------------------------------------------------------------ a small model */

#define SO_ST_MAX_SG 8
#define SO_ST_MAX_SLICES 32
#define SO_ST_MAX_SLICES_PER_SG 4

/* One slice of a model definition: name and size. */
typedef struct so_st_slice_def {
    const char *name;
    size_t numel;
} so_st_slice_def;

/* One sub-group of a model definition: its param group and slices (in offset order). */
typedef struct so_st_sg_def {
    uint32_t group;
    size_t num_slices;
    so_st_slice_def slices[SO_ST_MAX_SLICES_PER_SG];
} so_st_sg_def;

/* A model registered in a session: the master weights (borrowed by the session) and where
 * every slice lives. Slices are numbered in registration (forward) order. */
typedef struct so_st_model {
    so_session *session;
    size_t num_sg;
    uint32_t sg_group[SO_ST_MAX_SG];
    size_t sg_numel[SO_ST_MAX_SG];
    float *master[SO_ST_MAX_SG];
    size_t num_slices;
    const char *slice_name[SO_ST_MAX_SLICES];
    size_t slice_sg[SO_ST_MAX_SLICES];
    size_t slice_offset[SO_ST_MAX_SLICES];
    size_t slice_numel[SO_ST_MAX_SLICES];
    uint32_t slice_id[SO_ST_MAX_SLICES];
} so_st_model;

/* Lays out the model, allocates master weights drawn from `seed` (normal-ish, scale 0.5) and,
 * if `session` is not NULL, registers every sub-group in it (the groups must exist). */
static inline void so_st_model_init(so_st_model *m, so_session *session, const so_st_sg_def *defs, size_t num_defs,
                                    uint64_t seed) {
    CHECK(num_defs <= SO_ST_MAX_SG);
    memset(m, 0, sizeof *m);
    m->session = session;
    m->num_sg = num_defs;
    so_rng rng = so_rng_new(seed);
    for (size_t sg = 0; sg < num_defs; sg++) {
        size_t offset = 0;
        m->sg_group[sg] = defs[sg].group;
        for (size_t k = 0; k < defs[sg].num_slices; k++) {
            size_t i = m->num_slices++;
            CHECK(i < SO_ST_MAX_SLICES);
            m->slice_name[i] = defs[sg].slices[k].name;
            m->slice_sg[i] = sg;
            m->slice_offset[i] = offset;
            m->slice_numel[i] = defs[sg].slices[k].numel;
            offset += defs[sg].slices[k].numel;
        }
        m->sg_numel[sg] = offset;
        m->master[sg] = (float *)so_test_malloc(offset * sizeof(float));
        for (size_t j = 0; j < offset; j++) m->master[sg][j] = (float)so_rng_normalish(&rng, 0.5);
    }
    if (session == NULL) return;
    for (size_t sg = 0; sg < num_defs; sg++) {
        so_slice_desc slices[SO_ST_MAX_SLICES_PER_SG];
        size_t ns = 0;
        for (size_t i = 0; i < m->num_slices; i++) {
            if (m->slice_sg[i] != sg) continue;
            slices[ns].name = m->slice_name[i];
            slices[ns].offset = m->slice_offset[i];
            slices[ns].numel = m->slice_numel[i];
            ns++;
        }
        so_subgroup_desc d = so_subgroup_desc_default();
        d.group = m->sg_group[sg];
        d.master = m->master[sg];
        d.master_dtype = SO_DTYPE_F32;
        d.numel = m->sg_numel[sg];
        d.slices = slices;
        d.num_slices = ns;
        uint32_t id = 99;
        CHECK_OK(so_session_add_subgroup(session, &d, &id));
        CHECKF(id == (uint32_t)sg, "sub-group ids count from 0 in registration order: got %u for %zu", id, sg);
    }
    for (size_t i = 0; i < m->num_slices; i++) {
        CHECK_OK(so_session_slice_id(session, m->slice_name[i], &m->slice_id[i]));
    }
}

/* Frees the master weights; the session (owned by the caller) must be destroyed first. */
static inline void so_st_model_free(so_st_model *m) {
    for (size_t sg = 0; sg < m->num_sg; sg++) free(m->master[sg]);
    memset(m, 0, sizeof *m);
}

/* The optimizer state of every sub-group: master weights, moments, step count. */
typedef struct so_st_state {
    size_t num_sg;
    size_t n[SO_ST_MAX_SG];
    float *p[SO_ST_MAX_SG];
    float *m[SO_ST_MAX_SG];
    float *v[SO_ST_MAX_SG];
    uint64_t count[SO_ST_MAX_SG];
} so_st_state;

/* A state shaped like the model: master weights copied from it, zero moments and counts
 * (what a freshly registered sub-group holds). */
static inline so_st_state so_st_state_initial(const so_st_model *model) {
    so_st_state s;
    memset(&s, 0, sizeof s);
    s.num_sg = model->num_sg;
    for (size_t sg = 0; sg < model->num_sg; sg++) {
        size_t n = model->sg_numel[sg];
        s.n[sg] = n;
        s.p[sg] = (float *)so_test_dup(model->master[sg], n * sizeof(float));
        s.m[sg] = (float *)so_test_malloc(n * sizeof(float));
        s.v[sg] = (float *)so_test_malloc(n * sizeof(float));
        for (size_t j = 0; j < n; j++) s.m[sg][j] = s.v[sg][j] = 0.0f;
    }
    return s;
}

static inline void so_st_state_free(so_st_state *s) {
    for (size_t sg = 0; sg < s->num_sg; sg++) {
        free(s->p[sg]);
        free(s->m[sg]);
        free(s->v[sg]);
    }
    memset(s, 0, sizeof *s);
}

static inline void so_st_state_copy(so_st_state *dst, const so_st_state *src) {
    CHECK(dst->num_sg == src->num_sg);
    for (size_t sg = 0; sg < src->num_sg; sg++) {
        CHECK(dst->n[sg] == src->n[sg]);
        memcpy(dst->p[sg], src->p[sg], src->n[sg] * sizeof(float));
        memcpy(dst->m[sg], src->m[sg], src->n[sg] * sizeof(float));
        memcpy(dst->v[sg], src->v[sg], src->n[sg] * sizeof(float));
        dst->count[sg] = src->count[sg];
    }
}

/* Reads the session's state into `out` (shaped by so_st_state_initial) through a checkpoint
 * saved at `path` (which waits for in-flight work): the moments from the file, the master
 * weights from the model's buffers, which must equal the file's bit for bit, and the step
 * counts from so_session_step_count. */
static inline void so_st_read_state(const so_st_model *model, const char *path, so_st_state *out) {
    CHECK_OK(so_session_save(model->session, path));
    so_st_ckpt c = so_st_ckpt_read(path);
    for (size_t i = 0; i < model->num_slices; i++) {
        size_t sg = model->slice_sg[i], off = model->slice_offset[i], n = model->slice_numel[i];
        so_st_ckpt_copy_f32(&c, "exp_avg", model->slice_name[i], out->m[sg] + off, n);
        so_st_ckpt_copy_f32(&c, "exp_avg_sq", model->slice_name[i], out->v[sg] + off, n);
        so_st_ckpt_copy_f32(&c, "master", model->slice_name[i], out->p[sg] + off, n);
        CHECKF(memcmp(out->p[sg] + off, model->master[sg] + off, n * sizeof(float)) == 0,
               "slice %s: the checkpoint's master weights differ from the borrowed buffer", model->slice_name[i]);
    }
    so_st_ckpt_free(&c);
    for (size_t sg = 0; sg < model->num_sg; sg++) {
        CHECK_OK(so_session_step_count(model->session, (uint32_t)sg, &out->count[sg]));
    }
}

/* Whether two states are equal bit for bit (step counts included); prints the first
 * difference. */
static inline bool so_st_state_equal(const so_st_state *a, const so_st_state *b, const char *what) {
    if (a->num_sg != b->num_sg) return false;
    for (size_t sg = 0; sg < a->num_sg; sg++) {
        if (a->count[sg] != b->count[sg]) {
            fprintf(stderr, "%s: sub-group %zu: step count %llu vs %llu\n", what, sg, (unsigned long long)a->count[sg],
                    (unsigned long long)b->count[sg]);
            return false;
        }
        const float *xa[3] = {a->p[sg], a->m[sg], a->v[sg]}, *xb[3] = {b->p[sg], b->m[sg], b->v[sg]};
        const char *names[3] = {"master", "exp_avg", "exp_avg_sq"};
        for (int k = 0; k < 3; k++) {
            for (size_t j = 0; j < a->n[sg]; j++) {
                if (so_f32_to_bits(xa[k][j]) != so_f32_to_bits(xb[k][j])) {
                    fprintf(stderr, "%s: sub-group %zu %s[%zu]: %.9g vs %.9g\n", what, sg, names[k], j,
                            (double)xa[k][j], (double)xb[k][j]);
                    return false;
                }
            }
        }
    }
    return true;
}

/* -------------------------------------------------------------------- error messages */

/* Puts a known message in the thread's last error (from a refused call of another
 * function), so that a refusal checked next cannot pass on a stale message. */
static inline void so_st_poison_last_error(void) {
    double out = 0.0;
    CHECK_STATUS(so_grad_sumsq(NULL, NULL, SO_DTYPE_F32, 4, 1.0f, &out), SO_STATUS_NULL_ARGUMENT);
    CHECK(strstr(so_test_last_error(), "so_grad_sumsq") != NULL);
}

/* `expr` must return `want`, and so_last_error_message must start with `fn` and contain
 * `needle` (case-sensitive). The last error is poisoned first. */
#define EXPECT_REFUSED(expr, want, fn, needle)                                                            \
    do {                                                                                                  \
        so_st_poison_last_error();                                                                        \
        CHECK_STATUS((expr), (want));                                                                     \
        const char *msg_ = so_test_last_error();                                                          \
        CHECKF(strncmp(msg_, fn, strlen(fn)) == 0 && msg_[strlen(fn)] == ':',                             \
               "message \"%s\" does not "                                                                 \
               "start with %s:",                                                                          \
               msg_, fn);                                                                                 \
        CHECKF(strstr(msg_, (needle)) != NULL, "message \"%s\" does not mention \"%s\"", msg_, (needle)); \
    } while (0)

#endif /* SO_SESSION_TEST_H */
