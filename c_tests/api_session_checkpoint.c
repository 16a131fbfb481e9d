/* Checkpoints through the C API (so_session_save / so_session_load):
 *
 * 1. N steps + save + load into a fresh session (other initial weights) + N steps equals 2N
 *    steps bit for bit: master weights, both moments, step counts, the loss scale (the
 *    built-in scaler's growth tracker is saved mid-interval, so a lost tracker shows), the
 *    group hyperparameters. The steps use clipping, a loss-scaler backoff (overflow), late
 *    gradients, micro-steps and an LR schedule. Right after the load, the fresh session holds
 *    exactly the saved state.
 * 2. The same across partitions: saved from a session with three sub-groups, loaded into one
 *    with two (documented: state is stored per slice), without clipping (the clip factor
 *    sums the norm per sub-group, so it may round differently in another partition).
 * 3. Refused files change nothing: a flipped data byte (checksum), a truncated file, an empty
 *    file, a bad header length, a broken JSON header, another model's checkpoint, one saved
 *    with another Adam mode, without the loss scaler, with another number of groups:
 *    SO_STATUS_BAD_CHECKPOINT with a message saying why; a missing file and a directory:
 *    SO_STATUS_IO. After each, the state (weights, moments, counts), the loss scale and the
 *    group hyperparameters are unchanged; N more steps then equal those of a twin session
 *    that never saw the refused files.
 * 4. Saving is atomic: saving over a checkpoint replaces it, a failed save (onto a directory)
 *    is SO_STATUS_IO, and neither leaves temporary files behind.
 */
#include <dirent.h>
#include <sys/stat.h>

#include "session_test.h"

static const so_st_sg_def MODEL_A[] = {
    {0, 2, {{"tok", 700}, {"pos", 64}}},
    {0, 2, {{"blk.w", 900}, {"blk.b", 30}}},
    {1, 2, {{"out.w", 500}, {"out.b", 5}}},
};
/* The same slices, partitioned differently (the groups of the slices agree). */
static const so_st_sg_def MODEL_B[] = {
    {0, 4, {{"tok", 700}, {"pos", 64}, {"blk.w", 900}, {"blk.b", 30}}},
    {1, 2, {{"out.w", 500}, {"out.b", 5}}},
};
/* Unrelated slices. */
static const so_st_sg_def MODEL_OTHER[] = {
    {0, 1, {{"unrelated", 64}}},
    {1, 1, {{"other", 32}}},
};
#define N_STEPS 6

static char dir[512];

static void path_in_dir(char *buf, size_t len, const char *name) {
    int n = snprintf(buf, len, "%s/%s", dir, name);
    CHECK(n > 0 && (size_t)n < len);
}

static so_group_hparams schedule(uint32_t group, int step) {
    so_group_hparams h = so_group_hparams_default();
    h.lr = (group == 0 ? 1e-3 : 4e-4) * (1.0 + 0.1 * (double)step);
    if (group == 1) {
        h.beta1 = 0.8;
        h.weight_decay = 0.0;
    }
    return h;
}

/* A session with the built-in loss scaler (growth every 3 clean steps) and two groups. */
static so_session *new_session(uint32_t mode, bool scaler, int groups) {
    so_loss_scaler_options ls = so_loss_scaler_options_default();
    ls.init_scale = 1024.0f;
    ls.growth_interval = 3;
    so_session_options o = so_session_options_default();
    o.mode = mode;
    o.loss_scaler = scaler ? &ls : NULL;
    /* Resumed and straight runs are compared bit for bit with clipping that triggers, with
     * speculation on: its plan and the Auto history travel in the checkpoint. */
    o.speculation = SO_SPECULATION_ON;
    so_session *s = NULL;
    CHECK_OK(so_session_create(&o, &s));
    for (int g = 0; g < groups; g++) {
        so_group_hparams h = schedule((uint32_t)g, 0);
        uint32_t id = 0;
        CHECK_OK(so_session_add_group(s, &h, &id));
    }
    return s;
}

static so_session *standard_session(void) { return new_session(SO_ADAM_MODE_ADAMW, true, 2); }

static int slice_index(const so_st_model *m, const char *name) {
    for (size_t k = 0; k < m->num_slices; k++) {
        if (strcmp(m->slice_name[k], name) == 0) return (int)k;
    }
    return -1;
}

static uint64_t name_hash(const char *name) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *name != '\0'; name++) h = (h ^ (unsigned char)*name) * 1099511628211ull;
    return h;
}

/* Steps [from, to) of the training run: gradients depend on the step and the slice name only,
 * so that models with other partitions receive the same ones. `clip` enables clipping and
 * late gradients (a late gradient redoes its whole sub-group, so with another partition
 * other slices would go through a rollback too). */
static void run(const so_st_model *m, int from, int to, bool clip) {
    so_session *s = m->session;
    float g[1024];
    uint32_t groups = 0;
    for (size_t sg = 0; sg < m->num_sg; sg++) groups = m->sg_group[sg] + 1 > groups ? m->sg_group[sg] + 1 : groups;
    for (int step = from; step < to; step++) {
        for (uint32_t grp = 0; grp < groups; grp++) {
            so_group_hparams h = schedule(grp, step);
            CHECK_OK(so_session_set_group(s, grp, &h));
        }
        const uint32_t micro_steps = step % 4 == 2 ? 2 : 1;
        CHECK_OK(so_session_begin_step(s, 0.0f, micro_steps));
        float scale = 0.0f;
        CHECK_OK(so_session_loss_scale(s, &scale));
        for (uint32_t micro = 0; micro < micro_steps; micro++) {
            if (micro > 0) CHECK_OK(so_session_next_micro_step(s));
            for (size_t k = m->num_slices; k-- > 0;) {
                const char *name = m->slice_name[k];
                so_rng r = so_rng_new(name_hash(name) ^ (uint64_t)(step * 10 + (int)micro));
                for (size_t j = 0; j < m->slice_numel[k]; j++) g[j] = (float)(so_rng_normalish(&r, 0.01) * scale);
                CHECK_OK(so_session_grad_copy(s, m->slice_id[k], g, m->slice_numel[k], NULL));
            }
        }
        if (clip && step % 5 == 3) { /* a late gradient for "pos" */
            int k = slice_index(m, "pos");
            for (size_t j = 0; j < 64; j++) g[j] = (float)(0.003 * (double)scale * (double)(j % 7));
            CHECK_OK(so_session_grad_copy(s, m->slice_id[k], g, 64, NULL));
        }
        so_step_args a = so_step_args_default();
        a.max_norm = clip ? 0.05 : 0.0;
        a.overflow = step == 4;
        so_ticket t = 0;
        CHECK_OK(so_session_step(s, &a, &t));
        const so_step_result r = so_test_step_result(s, t);
        CHECK(r.skipped == (step == 4));
        if (clip && !r.skipped) CHECKF(r.clip_coef < 1.0, "step %d: clipping triggers", step);
    }
}

/* Everything observable of a session: its state, loss scale, group hyperparameters. */
typedef struct snapshot {
    so_st_state state;
    float loss_scale;
    so_group_hparams groups[2];
} snapshot;

static snapshot take(const so_st_model *m, const char *tag) {
    char path[600];
    path_in_dir(path, sizeof path, tag);
    snapshot s;
    s.state = so_st_state_initial(m);
    so_st_read_state(m, path, &s.state);
    remove(path);
    CHECK_OK(so_session_loss_scale(m->session, &s.loss_scale));
    for (uint32_t g = 0; g < 2; g++) {
        s.groups[g] = so_group_hparams_default();
        CHECK_OK(so_session_get_group(m->session, g, &s.groups[g]));
    }
    return s;
}

static void expect_equal(const snapshot *a, const snapshot *b, const char *what) {
    CHECKF(so_st_state_equal(&a->state, &b->state, what), "%s: the states differ", what);
    CHECKF(a->loss_scale == b->loss_scale, "%s: loss scale %g vs %g", what, (double)a->loss_scale,
           (double)b->loss_scale);
    for (int g = 0; g < 2; g++) {
        CHECKF(memcmp(&a->groups[g], &b->groups[g], sizeof a->groups[g]) == 0, "%s: group %d differs", what, g);
    }
}

/* Slice by slice, between models of different partitions. */
static void expect_equal_per_slice(const so_st_model *ma, const so_st_state *a, const so_st_model *mb,
                                   const so_st_state *b) {
    for (size_t k = 0; k < ma->num_slices; k++) {
        int kb = slice_index(mb, ma->slice_name[k]);
        CHECK(kb >= 0);
        size_t sa = ma->slice_sg[k], sb = mb->slice_sg[kb], oa = ma->slice_offset[k], ob = mb->slice_offset[kb];
        size_t n = ma->slice_numel[k] * sizeof(float);
        CHECKF(memcmp(a->p[sa] + oa, b->p[sb] + ob, n) == 0, "slice %s: master weights differ", ma->slice_name[k]);
        CHECKF(memcmp(a->m[sa] + oa, b->m[sb] + ob, n) == 0, "slice %s: exp_avg differs", ma->slice_name[k]);
        CHECKF(memcmp(a->v[sa] + oa, b->v[sb] + ob, n) == 0, "slice %s: exp_avg_sq differs", ma->slice_name[k]);
        CHECKF(a->count[sa] == b->count[sb], "slice %s: step counts differ", ma->slice_name[k]);
    }
}

/* Files in `dir` other than `keep` (temporary files left behind). */
static int stray_files(const char *keep) {
    DIR *d = opendir(dir);
    CHECK(d != NULL);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        if (keep != NULL && strcmp(e->d_name, keep) == 0) continue;
        if (strcmp(e->d_name, "subdir") == 0) continue;
        fprintf(stderr, "stray file: %s\n", e->d_name);
        n++;
    }
    closedir(d);
    return n;
}

static void resume_is_bit_exact(void) {
    char ckpt[600];
    path_in_dir(ckpt, sizeof ckpt, "resume.safetensors");
    so_st_model straight, first, resumed;
    so_st_model_init(&straight, standard_session(), MODEL_A, 3, 1);
    so_st_model_init(&first, standard_session(), MODEL_A, 3, 1);
    so_st_model_init(&resumed, standard_session(), MODEL_A, 3, 99);
    run(&straight, 0, 2 * N_STEPS, true);
    run(&first, 0, N_STEPS, true);
    CHECK_OK(so_session_save(first.session, ckpt));
    CHECK(stray_files("resume.safetensors") == 0);

    /* The loss scaler grew after 3 clean steps and backed off at step 4: its state matters. */
    float scale = 0.0f;
    CHECK_OK(so_session_loss_scale(first.session, &scale));
    CHECKF(scale == 1024.0f, "loss scale %g at the save", (double)scale);
    char tracker[32];
    so_st_ckpt c = so_st_ckpt_read(ckpt);
    CHECK(so_st_ckpt_meta(&c, "loss_scaler.growth_tracker", tracker, sizeof tracker));
    CHECKF(strcmp(tracker, "1") == 0, "growth tracker %s at the save", tracker);
    so_st_ckpt_free(&c);

    snapshot saved = take(&first, "t1"), fresh = take(&resumed, "t2");
    CHECK(memcmp(saved.state.p[0], fresh.state.p[0], first.sg_numel[0] * sizeof(float)) != 0);
    CHECK_OK(so_session_load(resumed.session, ckpt));
    snapshot loaded = take(&resumed, "t3");
    expect_equal(&saved, &loaded, "right after the load");

    run(&resumed, N_STEPS, 2 * N_STEPS, true);
    snapshot a = take(&straight, "t4"), b = take(&resumed, "t5");
    expect_equal(&a, &b, "N + save + load + N vs 2N");
    CHECK(a.state.count[0] == 2 * N_STEPS - 1); /* one skipped step */
    /* torch GradScaler's rule (hysteresis 1): back off on an overflow, grow after 3 clean steps. */
    float want_scale = 1024.0f;
    for (int step = 0, clean = 0; step < 2 * N_STEPS; step++) {
        if (step == 4) {
            want_scale *= 0.5f;
            clean = 0;
        } else if (++clean == 3) {
            want_scale *= 2.0f;
            clean = 0;
        }
    }
    CHECKF(a.loss_scale == want_scale, "loss scale %g, expected %g", (double)a.loss_scale, (double)want_scale);

    /* Another partition, no clipping. */
    so_st_model straight_nc, first_nc, other;
    so_st_model_init(&straight_nc, standard_session(), MODEL_A, 3, 2);
    so_st_model_init(&first_nc, standard_session(), MODEL_A, 3, 2);
    so_st_model_init(&other, standard_session(), MODEL_B, 2, 3);
    run(&straight_nc, 0, 2 * N_STEPS, false);
    run(&first_nc, 0, N_STEPS, false);
    CHECK_OK(so_session_save(first_nc.session, ckpt));
    CHECK_OK(so_session_load(other.session, ckpt));
    run(&other, N_STEPS, 2 * N_STEPS, false);
    snapshot x = take(&straight_nc, "t6"), y = take(&other, "t7");
    expect_equal_per_slice(&straight_nc, &x.state, &other, &y.state);
    CHECK(x.loss_scale == y.loss_scale);

    so_st_model *all[6] = {&straight, &first, &resumed, &straight_nc, &first_nc, &other};
    for (int i = 0; i < 6; i++) {
        so_session_destroy(all[i]->session);
        so_st_model_free(all[i]);
    }
    snapshot *snaps[7] = {&saved, &fresh, &loaded, &a, &b, &x, &y};
    for (int i = 0; i < 7; i++) so_st_state_free(&snaps[i]->state);
    remove(ckpt);
}

/* Saves a checkpoint of a session built by `make` with model `defs`. */
static void save_from(so_session *s, const so_st_sg_def *defs, size_t num, const char *path) {
    so_st_model m;
    so_st_model_init(&m, s, defs, num, 4);
    run(&m, 0, 2, false);
    CHECK_OK(so_session_save(s, path));
    so_session_destroy(s);
    so_st_model_free(&m);
}

static void refused_files_change_nothing(void) {
    char good[600], bad[600], other[600], l2[600], noscale[600], onegroup[600], sub[600], missing[600];
    path_in_dir(good, sizeof good, "good.safetensors");
    path_in_dir(bad, sizeof bad, "bad.safetensors");
    path_in_dir(other, sizeof other, "other.safetensors");
    path_in_dir(l2, sizeof l2, "l2.safetensors");
    path_in_dir(noscale, sizeof noscale, "noscale.safetensors");
    path_in_dir(onegroup, sizeof onegroup, "onegroup.safetensors");
    path_in_dir(sub, sizeof sub, "subdir");
    path_in_dir(missing, sizeof missing, "missing.safetensors");

    save_from(standard_session(), MODEL_OTHER, 2, other);
    save_from(new_session(SO_ADAM_MODE_L2, true, 2), MODEL_A, 3, l2);
    save_from(new_session(SO_ADAM_MODE_ADAMW, false, 2), MODEL_A, 3, noscale);
    static const so_st_sg_def ONE_GROUP[] = {
        {0, 2, {{"tok", 700}, {"pos", 64}}},
        {0, 2, {{"blk.w", 900}, {"blk.b", 30}}},
        {0, 2, {{"out.w", 500}, {"out.b", 5}}},
    };
    save_from(new_session(SO_ADAM_MODE_ADAMW, true, 1), ONE_GROUP, 3, onegroup);
    CHECK(mkdir(sub, 0700) == 0);

    so_st_model X, Y;
    so_st_model_init(&X, standard_session(), MODEL_A, 3, 7);
    so_st_model_init(&Y, standard_session(), MODEL_A, 3, 7);
    run(&X, 0, N_STEPS, true);
    run(&Y, 0, N_STEPS, true);
    CHECK_OK(so_session_save(X.session, good));
    /* Hyperparameters that differ from the file's, so that a partial load would show. */
    so_group_hparams h = schedule(0, 50);
    CHECK_OK(so_session_set_group(X.session, 0, &h));
    CHECK_OK(so_session_set_group(Y.session, 0, &h));
    snapshot before = take(&X, "b0");

    size_t len = 0;
    unsigned char *bytes = so_st_read_file(good, &len);
    CHECK(bytes != NULL && len > 1000);
    unsigned char *copy = (unsigned char *)so_test_malloc(len);

    struct variant {
        const char *what;
        const char *path;
        so_status status;
        const char *needle;
    };
    const struct variant variants[] = {
        {"a flipped data byte", bad, SO_STATUS_BAD_CHECKPOINT, "checksum"},
        {"a truncated file", bad, SO_STATUS_BAD_CHECKPOINT, "bad.safetensors"},
        {"an empty file", bad, SO_STATUS_BAD_CHECKPOINT, "bad.safetensors"},
        {"a bad header length", bad, SO_STATUS_BAD_CHECKPOINT, "bad.safetensors"},
        {"a broken JSON header", bad, SO_STATUS_BAD_CHECKPOINT, "bad.safetensors"},
        {"another model", other, SO_STATUS_BAD_CHECKPOINT, "lacks slice"},
        {"another Adam mode", l2, SO_STATUS_BAD_CHECKPOINT, "mode"},
        {"no loss scaler", noscale, SO_STATUS_BAD_CHECKPOINT, "loss scaler"},
        {"one param group", onegroup, SO_STATUS_BAD_CHECKPOINT, "param groups"},
        {"a missing file", missing, SO_STATUS_IO, "missing.safetensors"},
        {"a directory", sub, SO_STATUS_IO, "subdir"},
    };
    for (size_t v = 0; v < sizeof variants / sizeof variants[0]; v++) {
        memcpy(copy, bytes, len);
        size_t out_len = len;
        switch (v) {
        case 0: copy[len - 100] ^= 0x10; break;
        case 1: out_len = len / 2; break;
        case 2: out_len = 0; break;
        case 3: copy[7] = 0x7f; break;
        case 4: copy[8] = 'x'; break; /* the header's opening brace */
        default: break;
        }
        if (variants[v].path == bad) so_st_write_file(bad, copy, out_len);
        EXPECT_REFUSED(so_session_load(X.session, variants[v].path), variants[v].status, "so_session_load",
                       variants[v].needle);
        printf("%-22s -> %s: %s\n", variants[v].what, so_status_str(variants[v].status), so_test_last_error());
        snapshot now = take(&X, "b1");
        expect_equal(&before, &now, variants[v].what);
        so_st_state_free(&now.state);
    }

    /* N more steps: the same as the twin's. */
    run(&X, N_STEPS, 2 * N_STEPS, true);
    run(&Y, N_STEPS, 2 * N_STEPS, true);
    snapshot a = take(&X, "b2"), b = take(&Y, "b3");
    expect_equal(&a, &b, "after the refused loads");

    /* Atomic saves: over an existing checkpoint, and a failed one onto a directory. */
    CHECK_OK(so_session_save(X.session, good));
    CHECK_OK(so_session_load(Y.session, good));
    EXPECT_REFUSED(so_session_save(X.session, sub), SO_STATUS_IO, "so_session_save", "subdir");
    remove(bad);
    remove(other);
    remove(l2);
    remove(noscale);
    remove(onegroup);
    CHECK(stray_files("good.safetensors") == 0);
    remove(good);
    CHECK(rmdir(sub) == 0);

    free(bytes);
    free(copy);
    so_st_state_free(&before.state);
    so_st_state_free(&a.state);
    so_st_state_free(&b.state);
    so_session_destroy(X.session);
    so_session_destroy(Y.session);
    so_st_model_free(&X);
    so_st_model_free(&Y);
}

/* The speculation history a state dict kept outside a checkpoint file carries: read, restored
 * into another session, and refused when malformed (without a change). */
static void speculation_history_round_trips(void) {
    so_session *a = NULL, *b = NULL;
    CHECK_OK(so_session_create(NULL, &a));
    CHECK_OK(so_session_create(NULL, &b));
    uint32_t bits = 99, steps = 99;
    CHECK_OK(so_session_get_speculation_history(a, &bits, &steps));
    CHECK(bits == 0 && steps == 0);
    CHECK_OK(so_session_set_speculation_history(b, 0x5, 4));
    CHECK_OK(so_session_get_speculation_history(b, &bits, &steps));
    CHECK(bits == 0x5 && steps == 4);
    CHECK_STATUS(so_session_set_speculation_history(b, 0x10, 4), SO_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(so_session_set_speculation_history(b, 0, 9), SO_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(so_session_get_speculation_history(b, &bits, NULL), SO_STATUS_NULL_ARGUMENT);
    CHECK_OK(so_session_get_speculation_history(b, &bits, &steps));
    CHECK(bits == 0x5 && steps == 4);
    so_session_destroy(a);
    so_session_destroy(b);
}

int main(void) {
    const char *tmp = getenv("TMPDIR");
    int n = snprintf(dir, sizeof dir, "%s/superoffload-ckpt-XXXXXX", tmp != NULL && tmp[0] != '\0' ? tmp : "/tmp");
    CHECK(n > 0 && (size_t)n < sizeof dir);
    CHECK(mkdtemp(dir) != NULL);

    resume_is_bit_exact();
    refused_files_change_nothing();
    speculation_history_round_trips();

    CHECK(stray_files(NULL) == 0);
    CHECK(rmdir(dir) == 0);
    printf("api_session_checkpoint: ok\n");
    return 0;
}
