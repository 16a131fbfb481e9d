/* Symbol hygiene of the shared library. Arguments: the library's path and the header's.
 *
 * - `nm -D --defined-only`: every exported (global: text, data, bss, rodata, weak) symbol
 *   starts with so_; every function declared in the header is exported as text; nothing
 *   is exported that the header does not declare.
 * - `readelf -d`: the library's SONAME (given by build.rs) is SO_TEST_SONAME (CMake's
 *   so_soname), and this program (linked against it) records exactly that name as NEEDED.
 */
#include <unistd.h>

#include "so_test.h"

#define MAX_NAMES 1024

typedef struct names {
    char *name[MAX_NAMES];
    size_t count;
} names;

static void add_name(names *n, const char *s, size_t len) {
    for (size_t i = 0; i < n->count; i++)
        if (strlen(n->name[i]) == len && strncmp(n->name[i], s, len) == 0) return;
    CHECK(n->count < MAX_NAMES);
    char *copy = (char *)so_test_malloc(len + 1);
    memcpy(copy, s, len);
    copy[len] = '\0';
    n->name[n->count++] = copy;
}

static bool has_name(const names *n, const char *s) {
    for (size_t i = 0; i < n->count; i++)
        if (strcmp(n->name[i], s) == 0) return true;
    return false;
}

static bool is_ident(char c) {
    return c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
}

/* Functions declared in the header: on a line that starts a declaration (not a comment,
 * not a preprocessor line), an identifier so_* directly followed by '('. */
static void header_functions(const char *path, names *out) {
    FILE *f = fopen(path, "r");
    CHECKF(f != NULL, "cannot open %s", path);
    char line[4096];
    while (fgets(line, sizeof line, f)) {
        char c = line[0];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_')) continue;
        for (const char *s = strstr(line, "so_"); s; s = strstr(s + 1, "so_")) {
            if (s > line && is_ident(s[-1])) continue;
            size_t len = 0;
            while (is_ident(s[len])) len++;
            if (s[len] == '(') add_name(out, s, len);
        }
    }
    fclose(f);
}

static FILE *run(const char *tool, const char *args, const char *path) {
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "%s %s '%s' 2>&1", tool, args, path);
    FILE *p = popen(cmd, "r");
    CHECKF(p != NULL, "cannot run %s", cmd);
    return p;
}

int main(int argc, char **argv) {
    CHECKF(argc == 3, "usage: %s LIBRARY HEADER", argv[0]);
    const char *lib = argv[1], *header = argv[2];
    CHECK(so_abi_version() == SO_ABI_VERSION); /* also makes the library NEEDED */

    names declared;
    declared.count = 0;
    header_functions(header, &declared);
    CHECKF(declared.count >= 10, "only %zu functions found in %s", declared.count, header);
    CHECK(has_name(&declared, "so_adam_update") && has_name(&declared, "so_pool_get_info") &&
          has_name(&declared, "so_last_error_message"));

    names exported_text;
    exported_text.count = 0;
    size_t exported = 0, bad = 0;
    FILE *nm = run("nm", "-D --defined-only", lib);
    char line[4096];
    while (fgets(line, sizeof line, nm)) {
        char addr[64], type[8], name[2048];
        if (sscanf(line, "%63s %7s %2047s", addr, type, name) != 3) {
            CHECKF(false, "unexpected nm output: %s", line);
        }
        char t = type[0];
        if (!(t >= 'A' && t <= 'Z')) continue; /* local symbol */
        if (t == 'A') continue;                /* absolute: version nodes, not code or data */
        exported++;
        if (strncmp(name, "so_", 3) != 0) {
            fprintf(stderr, "exported symbol without the so_ prefix: %s (%c)\n", name, t);
            bad++;
            continue;
        }
        char *at = strchr(name, '@');
        if (at) *at = '\0';
        if (t == 'T') add_name(&exported_text, name, strlen(name));
        if (!has_name(&declared, name)) {
            fprintf(stderr, "exported but not declared in the header: %s (%c)\n", name, t);
            bad++;
        }
    }
    CHECKF(pclose(nm) == 0, "nm -D --defined-only %s failed", lib);
    for (size_t i = 0; i < declared.count; i++) {
        if (!has_name(&exported_text, declared.name[i])) {
            fprintf(stderr, "declared in the header but not exported as a function: %s\n", declared.name[i]);
            bad++;
        }
    }
    CHECKF(bad == 0, "%zu symbol problems", bad);
    printf("%zu exported symbols, all so_*; %zu header functions, all exported\n", exported, declared.count);

    char soname[64];
    snprintf(soname, sizeof soname, "[%s]", SO_TEST_SONAME);
    bool found = false;
    FILE *re = run("readelf", "-d", lib);
    while (fgets(line, sizeof line, re))
        if (strstr(line, "(SONAME)")) {
            CHECKF(strstr(line, soname) != NULL, "SONAME line: %s", line);
            found = true;
        }
    CHECK(pclose(re) == 0);
    CHECKF(found, "%s has no SONAME", lib);

    size_t needed = 0;
    char self[4096]; /* this program's file (in the shell run by popen, /proc/self is the shell) */
    ssize_t self_len = readlink("/proc/self/exe", self, sizeof self - 1);
    CHECK(self_len > 0);
    self[self_len] = '\0';
    re = run("readelf", "-d", self);
    while (fgets(line, sizeof line, re))
        if (strstr(line, "(NEEDED)") && strstr(line, "libsuperoffload")) {
            CHECKF(strstr(line, soname) != NULL, "NEEDED line: %s", line);
            needed++;
        }
    CHECK(pclose(re) == 0);
    CHECKF(needed == 1, "this program records %zu NEEDED entries for libsuperoffload", needed);
    printf("SONAME and NEEDED are %s\n", soname);
    for (size_t i = 0; i < declared.count; i++) free(declared.name[i]);
    for (size_t i = 0; i < exported_text.count; i++) free(exported_text.name[i]);
    printf("ok\n");
    return 0;
}
