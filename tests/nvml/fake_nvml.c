/*
 * A fake libnvidia-ml.so.1 for torchdoctor's tests: the NVML C ABI over a scenario file.
 *
 * Why in C: nvidia-ml-py (``import pynvml``) is a ctypes layer over this library. Faking NVML
 * at the Python level skips the part that breaks on a new driver: struct layouts and versions
 * (the _v3 process info, the versioned memory and temperature structs), the two-call
 * "insufficient size" protocol, return codes turned into NVMLError subclasses. With this file
 * the real binding runs and only the driver is simulated.
 *
 * Build: cc -shared -fPIC -o libnvidia-ml.so.1 fake_nvml.c   (nothing else: no headers of
 * NVIDIA's, no extra libraries). Load: LD_LIBRARY_PATH=<its folder>, as pynvml opens
 * "libnvidia-ml.so.1" by name.
 *
 * The scenario: the file named by TORCHDOCTOR_FAKE_NVML_SCENARIO (or set with
 * fakeNvmlSetScenario()), re-read whenever it changes (size, mtime or inode), so a test can
 * write the PIDs of real child processes into it while the job runs. Without one: one healthy
 * GPU. One setting a line, "key value...", '#' starts a comment; "gpu" starts a device and the
 * keys after it describe that device. Numeric device values may be a comma-separated list:
 * the k-th read of that value gives the k-th item (the last one repeats), so utilization,
 * memory, power, temperature, clocks and reasons can change sample by sample.
 *
 *   driver 550.54.15 | nvml 12.550.54.15 | cuda 12040     versions
 *   init_error 18                                       nvmlInit fails with this code
 *                                                       (18: driver/library mismatch)
 *   init_banner TEXT                                    nvmlInit prints TEXT on fd 1 ("\n":
 *                                                       a newline), as the CUDA stub does
 *   no_memory_v2                                        old driver: _v2 memory answers
 *                                                       FunctionNotFound
 *   drop_exited_processes                               a listed PID that has exited (or is
 *                                                       a zombie) holds nothing, as with the
 *                                                       real driver
 *   topology A B LEVEL | p2p A B STATUS                 NVML_TOPOLOGY_* / NVML_P2P_STATUS_*
 *   gpu
 *     name S | uuid S | compute_capability 8 0 | numa_node N | pci_bus 0x17
 *     memory_total B | memory_reserved B | memory_used B[,B...]   (default used: the sum of
 *                                                       the listed compute processes)
 *     utilization_gpu P,... | utilization_memory P,... | power_mw W,... | power_limit_mw W
 *     temperature_c C,... | sm_clock_mhz M,... | mem_clock_mhz M | clock_event_reasons X,...
 *     pcie_rx_kb K,... | pcie_tx_kb K,... | pcie_rx_bytes B | pcie_tx_bytes B
 *     no_pcie_counters                                  NVML_FI_DEV_PCIE_COUNT_* not supported
 *     process PID BYTES|na | graphics_process PID BYTES|na
 *     cpu_affinity 0-15,32                              the "ideal" CPUs of the device
 *     nvlink PEER|switch|none ...                       one word a link
 *     ecc_volatile CORRECTED UNCORRECTED | ecc_aggregate CORRECTED UNCORRECTED
 *     xid CODE                                          one Xid event (delivered once to each
 *                                                       event set registered for Xid events)
 *     not_supported FUNCTION                            that entry point answers NotSupported
 *     error FUNCTION CODE                               that entry point answers CODE
 *     lost_after_calls N                                after N calls the GPU is lost
 *
 * FUNCTION names match with or without their _vN suffix (nvmlDeviceGetCount = _v2).
 */

#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MAX_GPUS 32
#define MAX_SEQ 64
#define MAX_PROCS 64
#define MAX_NAMED 32
#define MAX_LINKS 36
#define MAX_XID 64
#define MAX_PAIRS 128
#define MAX_SETS 64
#define NAME_LEN 96

enum {
    OK = 0, UNINITIALIZED = 1, INVALID_ARGUMENT = 2, NOT_SUPPORTED = 3, NO_PERMISSION = 4,
    NOT_FOUND = 6, INSUFFICIENT_SIZE = 7, DRIVER_NOT_LOADED = 9, TIMEOUT = 10,
    FUNCTION_NOT_FOUND = 13, GPU_IS_LOST = 15, LIB_RM_VERSION_MISMATCH = 18,
    ARGUMENT_VERSION_MISMATCH = 25, UNKNOWN = 999
};

#define EVENT_XID 0x8ULL
#define MEMORY_V2 0x02000028U
#define TEMPERATURE_V1 0x0100000CU
#define NA_ULL 0xFFFFFFFFFFFFFFFFULL

/* The value read at each sample of a device setting. */
enum { S_UTIL_GPU, S_UTIL_MEM, S_MEM_USED, S_POWER, S_TEMP, S_SM_CLOCK, S_REASONS, S_PCIE_RX,
       S_PCIE_TX, S_COUNT };

typedef struct {
    int n;
    unsigned long long v[MAX_SEQ];
} seq_t;

typedef struct {
    unsigned pid;
    unsigned long long used;
} proc_t;

typedef struct {
    char name[NAME_LEN];
    int code;
} named_t;

typedef struct gpu {
    char name[NAME_LEN];
    char uuid[NAME_LEN];
    int cc_major, cc_minor;
    int numa_node; /* -1: NotSupported */
    int pci_bus;   /* -1: 0x07 + index */
    unsigned long long memory_total, memory_reserved;
    int memory_used_given;
    seq_t seqs[S_COUNT];
    unsigned power_limit_mw, mem_clock_mhz;
    int pcie_counters;
    unsigned long long pcie_rx_bytes, pcie_tx_bytes;
    proc_t compute[MAX_PROCS];
    int n_compute;
    proc_t graphics[MAX_PROCS];
    int n_graphics;
    unsigned long long affinity[4]; /* 256 CPUs */
    int links[MAX_LINKS];           /* -1 none, -2 switch, else peer index */
    int n_links;
    unsigned long long ecc[2][2]; /* [corrected, uncorrected][volatile, aggregate] */
    unsigned xid[MAX_XID];
    int n_xid;
    named_t failing[MAX_NAMED]; /* code 3 for not_supported */
    int n_failing;
    long lost_after; /* -1: never */
} gpu_t;

typedef struct {
    int a, b, value;
} pair_t;

typedef struct {
    char driver[NAME_LEN], nvml[NAME_LEN];
    int cuda;
    int init_error;
    char banner[1024];
    int no_memory_v2;
    int drop_exited;
    pair_t topology[MAX_PAIRS];
    int n_topology;
    pair_t p2p[MAX_PAIRS];
    int n_p2p;
    gpu_t gpus[MAX_GPUS];
    int n_gpus;
} scenario_t;

typedef struct {
    int used;
    unsigned long long mask[MAX_GPUS];
    int delivered[MAX_GPUS];
} eventset_t;

/* Everything below is guarded by lock. Counters survive a re-read of the same file (a test
 * that edits the scenario mid-run keeps its sample positions); a different file resets them. */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static scenario_t sc;
static int loaded;
static char loaded_path[4096];
static struct stat loaded_stat;
static char override_path[4096];
static int refcount;
static long calls[MAX_GPUS];
static long reads[MAX_GPUS][S_COUNT];
static eventset_t sets[MAX_SETS];


/* -- the scenario ------------------------------------------------------------------------ */

static void seq_set(seq_t *s, unsigned long long v) {
    s->n = 1;
    s->v[0] = v;
}

static void gpu_defaults(gpu_t *g, int index) {
    memset(g, 0, sizeof *g);
    snprintf(g->name, sizeof g->name, "NVIDIA A100-SXM4-80GB");
    snprintf(g->uuid, sizeof g->uuid, "GPU-3b1f6c52-0d7e-4b8e-9a51-8f6a3a1c%04x", index);
    g->cc_major = 8;
    g->numa_node = -1;
    g->pci_bus = -1;
    g->memory_total = 80ULL << 30;
    g->memory_reserved = 512ULL << 20;
    seq_set(&g->seqs[S_MEM_USED], 1ULL << 30);
    seq_set(&g->seqs[S_POWER], 61000);
    g->power_limit_mw = 400000;
    seq_set(&g->seqs[S_TEMP], 34);
    seq_set(&g->seqs[S_SM_CLOCK], 1410);
    g->mem_clock_mhz = 1593;
    seq_set(&g->seqs[S_REASONS], 0x1); /* GpuIdle */
    seq_set(&g->seqs[S_UTIL_GPU], 0);
    seq_set(&g->seqs[S_UTIL_MEM], 0);
    seq_set(&g->seqs[S_PCIE_RX], 0);
    seq_set(&g->seqs[S_PCIE_TX], 0);
    g->pcie_counters = 1;
    g->pcie_rx_bytes = 7000000000ULL;
    g->pcie_tx_bytes = 3000000000ULL;
    g->affinity[0] = 0xFF;
    g->lost_after = -1;
}

static void scenario_defaults(scenario_t *s) {
    memset(s, 0, sizeof *s);
    snprintf(s->driver, sizeof s->driver, "550.54.15");
    snprintf(s->nvml, sizeof s->nvml, "12.550.54.15");
    s->cuda = 12040;
}

static unsigned long long number(const char *word) {
    return strtoull(word, NULL, 0); /* 0x.. for masks and buses, decimal otherwise */
}

static void parse_seq(seq_t *s, char *words) {
    s->n = 0;
    for (char *item = strtok(words, ", \t"); item && s->n < MAX_SEQ; item = strtok(NULL, ", \t"))
        s->v[s->n++] = number(item);
    if (s->n == 0)
        seq_set(s, 0);
}

static void parse_cpus(unsigned long long mask[4], char *words) {
    memset(mask, 0, 4 * sizeof mask[0]);
    for (char *item = strtok(words, ", \t"); item; item = strtok(NULL, ", \t")) {
        char *dash = strchr(item, '-');
        long lo = strtol(item, NULL, 10), hi = dash ? strtol(dash + 1, NULL, 10) : lo;
        for (long cpu = lo; cpu <= hi && cpu < 256; cpu++)
            if (cpu >= 0)
                mask[cpu / 64] |= 1ULL << (cpu % 64);
    }
}

static void parse_proc(proc_t *list, int *n, char *rest) {
    char pid[32] = "", used[32] = "";
    if (*n >= MAX_PROCS || sscanf(rest, "%31s %31s", pid, used) < 1)
        return;
    list[*n].pid = (unsigned)number(pid);
    list[*n].used = (used[0] == '\0' || strcmp(used, "na") == 0) ? NA_ULL : number(used);
    (*n)++;
}

static void parse_pair(pair_t *list, int *n, const char *rest) {
    int a, b, v;
    if (*n < MAX_PAIRS && sscanf(rest, "%d %d %d", &a, &b, &v) == 3) {
        list[*n] = (pair_t){a < b ? a : b, a < b ? b : a, v};
        (*n)++;
    }
}

/* "\n" in the scenario is a newline, so one line can hold a banner of several. */
static void unescape(char *dst, size_t size, const char *src) {
    size_t n = 0;
    for (; *src && *src != '\n' && n + 1 < size; src++)
        if (src[0] == '\\' && src[1] == 'n') {
            dst[n++] = '\n';
            src++;
        } else {
            dst[n++] = *src;
        }
    dst[n] = '\0';
}

static void copy_word(char *dst, size_t size, const char *src) {
    snprintf(dst, size, "%s", src);
    size_t len = strlen(dst);
    while (len && isspace((unsigned char)dst[len - 1]))
        dst[--len] = '\0';
}

/* One line: a global setting, "gpu", or a setting of the last device. Unknown keys are
 * ignored, so a newer scenario still loads into an older library. */
static void parse_line(scenario_t *s, char *line) {
    char *hash = strchr(line, '#');
    if (hash)
        *hash = '\0';
    size_t len = strlen(line);
    while (len && isspace((unsigned char)line[len - 1]))
        line[--len] = '\0';
    while (isspace((unsigned char)*line))
        line++;
    if (*line == '\0')
        return;
    char *rest = line;
    while (*rest && !isspace((unsigned char)*rest))
        rest++;
    if (*rest)
        *rest++ = '\0';
    while (isspace((unsigned char)*rest))
        rest++;
    const char *key = line;

    if (!strcmp(key, "gpu")) {
        if (s->n_gpus < MAX_GPUS) {
            gpu_defaults(&s->gpus[s->n_gpus], s->n_gpus);
            s->n_gpus++;
        }
        return;
    }
    if (!strcmp(key, "driver")) copy_word(s->driver, sizeof s->driver, rest);
    else if (!strcmp(key, "nvml")) copy_word(s->nvml, sizeof s->nvml, rest);
    else if (!strcmp(key, "cuda")) s->cuda = (int)number(rest);
    else if (!strcmp(key, "init_error")) s->init_error = (int)number(rest);
    else if (!strcmp(key, "init_banner")) unescape(s->banner, sizeof s->banner, rest);
    else if (!strcmp(key, "no_memory_v2")) s->no_memory_v2 = 1;
    else if (!strcmp(key, "drop_exited_processes")) s->drop_exited = 1;
    else if (!strcmp(key, "topology")) parse_pair(s->topology, &s->n_topology, rest);
    else if (!strcmp(key, "p2p")) parse_pair(s->p2p, &s->n_p2p, rest);
    if (s->n_gpus == 0)
        return;

    gpu_t *g = &s->gpus[s->n_gpus - 1];
    static const struct { const char *key; int slot; } seqs[] = {
        {"utilization_gpu", S_UTIL_GPU}, {"utilization_memory", S_UTIL_MEM},
        {"memory_used", S_MEM_USED}, {"power_mw", S_POWER}, {"temperature_c", S_TEMP},
        {"sm_clock_mhz", S_SM_CLOCK}, {"clock_event_reasons", S_REASONS},
        {"pcie_rx_kb", S_PCIE_RX}, {"pcie_tx_kb", S_PCIE_TX},
    };
    for (size_t i = 0; i < sizeof seqs / sizeof seqs[0]; i++)
        if (!strcmp(key, seqs[i].key)) {
            parse_seq(&g->seqs[seqs[i].slot], rest);
            if (seqs[i].slot == S_MEM_USED)
                g->memory_used_given = 1;
            return;
        }
    if (!strcmp(key, "name")) copy_word(g->name, sizeof g->name, rest);
    else if (!strcmp(key, "uuid")) copy_word(g->uuid, sizeof g->uuid, rest);
    else if (!strcmp(key, "compute_capability")) sscanf(rest, "%d %d", &g->cc_major, &g->cc_minor);
    else if (!strcmp(key, "numa_node")) g->numa_node = (int)strtol(rest, NULL, 0);
    else if (!strcmp(key, "pci_bus")) g->pci_bus = (int)number(rest);
    else if (!strcmp(key, "memory_total")) g->memory_total = number(rest);
    else if (!strcmp(key, "memory_reserved")) g->memory_reserved = number(rest);
    else if (!strcmp(key, "power_limit_mw")) g->power_limit_mw = (unsigned)number(rest);
    else if (!strcmp(key, "mem_clock_mhz")) g->mem_clock_mhz = (unsigned)number(rest);
    else if (!strcmp(key, "pcie_rx_bytes")) g->pcie_rx_bytes = number(rest);
    else if (!strcmp(key, "pcie_tx_bytes")) g->pcie_tx_bytes = number(rest);
    else if (!strcmp(key, "no_pcie_counters")) g->pcie_counters = 0;
    else if (!strcmp(key, "process")) parse_proc(g->compute, &g->n_compute, rest);
    else if (!strcmp(key, "graphics_process")) parse_proc(g->graphics, &g->n_graphics, rest);
    else if (!strcmp(key, "cpu_affinity")) parse_cpus(g->affinity, rest);
    else if (!strcmp(key, "nvlink")) {
        g->n_links = 0;
        for (char *w = strtok(rest, " \t"); w && g->n_links < MAX_LINKS; w = strtok(NULL, " \t"))
            g->links[g->n_links++] = !strcmp(w, "switch") ? -2 : !strcmp(w, "none") ? -1
                                                                : (int)strtol(w, NULL, 10);
    }
    else if (!strcmp(key, "ecc_volatile")) sscanf(rest, "%llu %llu", &g->ecc[0][0], &g->ecc[1][0]);
    else if (!strcmp(key, "ecc_aggregate")) sscanf(rest, "%llu %llu", &g->ecc[0][1], &g->ecc[1][1]);
    else if (!strcmp(key, "xid") && g->n_xid < MAX_XID) g->xid[g->n_xid++] = (unsigned)number(rest);
    else if (!strcmp(key, "lost_after_calls")) g->lost_after = strtol(rest, NULL, 10);
    else if ((!strcmp(key, "not_supported") || !strcmp(key, "error")) && g->n_failing < MAX_NAMED) {
        named_t *f = &g->failing[g->n_failing];
        char code[32] = "";
        if (sscanf(rest, "%95s %31s", f->name, code) >= 1) {
            f->code = !strcmp(key, "error") && code[0] ? (int)number(code) : NOT_SUPPORTED;
            g->n_failing++;
        }
    }
}

static void parse_file(scenario_t *s, FILE *f) {
    char line[8192];
    scenario_defaults(s);
    while (fgets(line, sizeof line, f))
        parse_line(s, line);
}

static void reset_counters(void) {
    memset(calls, 0, sizeof calls);
    memset(reads, 0, sizeof reads);
    memset(sets, 0, sizeof sets);
    refcount = 0;
}

/* Bring the scenario up to date with its file. Called with the lock held. A file that cannot
 * be read right now (being replaced) keeps the last good one. */
static void refresh(void) {
    const char *path = override_path[0] ? override_path : getenv("TORCHDOCTOR_FAKE_NVML_SCENARIO");
    if (!path || !*path) {
        if (!loaded || loaded_path[0]) {
            scenario_defaults(&sc);
            gpu_defaults(&sc.gpus[0], 0);
            sc.n_gpus = 1;
            if (loaded)
                reset_counters();
            loaded = 1;
            loaded_path[0] = '\0';
        }
        return;
    }
    struct stat st;
    if (stat(path, &st) != 0)
        return;
    int same_path = loaded && !strcmp(path, loaded_path);
    if (same_path && st.st_ino == loaded_stat.st_ino && st.st_size == loaded_stat.st_size &&
        st.st_mtim.tv_sec == loaded_stat.st_mtim.tv_sec &&
        st.st_mtim.tv_nsec == loaded_stat.st_mtim.tv_nsec)
        return;
    FILE *f = fopen(path, "r");
    if (!f)
        return;
    static scenario_t next;
    parse_file(&next, f);
    fclose(f);
    sc = next;
    if (!same_path)
        reset_counters();
    loaded = 1;
    snprintf(loaded_path, sizeof loaded_path, "%s", path);
    loaded_stat = st;
}

/* -- plumbing ---------------------------------------------------------------------------- */

typedef gpu_t *nvmlDevice_t;

static int version_free_equal(const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    for (const char **s = &a; s; s = (s == &a) ? &b : NULL) {
        size_t *len = (s == &a) ? &la : &lb;
        const char *v = strrchr(*s, '_');
        if (v && v[1] == 'v' && isdigit((unsigned char)v[2]))
            *len = (size_t)(v - *s);
    }
    return la == lb && !strncmp(a, b, la);
}

static int gpu_index(nvmlDevice_t d) {
    if (d < sc.gpus || d >= sc.gpus + sc.n_gpus)
        return -1;
    return (int)(d - sc.gpus);
}

/* Every device call: initialised, a handle of ours, the GPU not lost, the function not
 * failing on this device. Takes the lock; on success the caller releases it. */
static int enter_device(nvmlDevice_t d, const char *fn) {
    pthread_mutex_lock(&lock);
    refresh();
    if (refcount == 0)
        return UNINITIALIZED;
    int i = gpu_index(d);
    if (i < 0)
        return INVALID_ARGUMENT;
    gpu_t *g = &sc.gpus[i];
    calls[i]++;
    if (g->lost_after >= 0 && calls[i] > g->lost_after)
        return GPU_IS_LOST;
    for (int k = 0; k < g->n_failing; k++)
        if (version_free_equal(g->failing[k].name, fn))
            return g->failing[k].code;
    return OK;
}

static int enter(void) {
    pthread_mutex_lock(&lock);
    refresh();
    return refcount == 0 ? UNINITIALIZED : OK;
}

#define LEAVE(code) do { int _c = (code); pthread_mutex_unlock(&lock); return _c; } while (0)
#define DEVICE(d) do { int _r = enter_device((d), __func__); if (_r != OK) LEAVE(_r); } while (0)
#define SYSTEM() do { int _r = enter(); if (_r != OK) LEAVE(_r); } while (0)

static unsigned long long sample(gpu_t *g, int slot) {
    int i = gpu_index(g);
    seq_t *s = &g->seqs[slot];
    long k = reads[i][slot]++;
    return s->v[k < s->n ? k : s->n - 1];
}

static int running(unsigned pid) {
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%u/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    char *paren = strrchr(buf, ')');
    return paren && paren[1] && paren[2] != 'Z' && paren[2] != 'X';
}

static int live_procs(const proc_t *list, int n, proc_t *out) {
    int m = 0;
    for (int i = 0; i < n; i++)
        if (!sc.drop_exited || running(list[i].pid))
            out[m++] = list[i];
    return m;
}

static unsigned long long memory_used(gpu_t *g) {
    if (g->memory_used_given)
        return sample(g, S_MEM_USED);
    proc_t live[MAX_PROCS];
    unsigned long long sum = 0;
    int n = live_procs(g->compute, g->n_compute, live);
    for (int i = 0; i < n; i++)
        if (live[i].used != NA_ULL)
            sum += live[i].used;
    return sum;
}

static int put_string(char *dst, unsigned size, const char *src) {
    if (!dst)
        return INVALID_ARGUMENT;
    if (strlen(src) + 1 > size)
        return INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return OK;
}

static int pair_value(const pair_t *list, int n, int a, int b, int fallback) {
    int lo = a < b ? a : b, hi = a < b ? b : a;
    for (int i = 0; i < n; i++)
        if (list[i].a == lo && list[i].b == hi)
            return list[i].value;
    return fallback;
}

/* -- structures, as nvml.h lays them out -------------------------------------------------- */

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
typedef struct { unsigned gpu, memory; } nvmlUtilization_t;
typedef struct { unsigned version; int sensorType; int temperature; } nvmlTemperature_v1_t;
typedef struct { unsigned pid; unsigned long long usedGpuMemory; } nvmlProcessInfo_v1_t;
typedef struct {
    unsigned pid;
    unsigned long long usedGpuMemory;
    unsigned gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t; /* _v2 and _v3 share this layout */
typedef struct {
    char busIdLegacy[16];
    unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;
typedef union {
    double dVal;
    unsigned uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    long long sllVal;
    int siVal;
    unsigned short usVal;
} nvmlValue_t;
typedef struct {
    unsigned fieldId, scopeId;
    long long timestamp, latencyUsec;
    int valueType;
    int nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;
typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned gpuInstanceId, computeInstanceId;
} nvmlEventData_t;
typedef eventset_t *nvmlEventSet_t;

/* -- the test hook (not part of NVML) ----------------------------------------------------- */

/* Name the scenario file for this copy of the library, over the environment variable: a test
 * process that holds several fake machines loads one copy of the library per machine. */
int fakeNvmlSetScenario(const char *path) {
    pthread_mutex_lock(&lock);
    snprintf(override_path, sizeof override_path, "%s", path ? path : "");
    refresh();
    LEAVE(OK);
}

/* The index of a handle, without counting a call (the test's own bookkeeping of calls). */
int fakeNvmlHandleIndex(nvmlDevice_t d) {
    pthread_mutex_lock(&lock);
    int i = gpu_index(d);
    pthread_mutex_unlock(&lock);
    return i;
}

/* -- initialisation and the system ------------------------------------------------------- */

const char *nvmlErrorString(int result) {
    switch (result) {
    case OK: return "Success";
    case UNINITIALIZED: return "Uninitialized";
    case INVALID_ARGUMENT: return "Invalid Argument";
    case NOT_SUPPORTED: return "Not Supported";
    case NO_PERMISSION: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case NOT_FOUND: return "Not Found";
    case INSUFFICIENT_SIZE: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case TIMEOUT: return "Timeout";
    case 11: return "Interrupt Request Issue";
    case 12: return "NVML Shared Library Not Found";
    case FUNCTION_NOT_FOUND: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case GPU_IS_LOST: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 17: return "The operating system has blocked the request.";
    case LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case 20: return "Insufficient Memory";
    case 21: return "No data";
    case ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

int nvmlInitWithFlags(unsigned flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    refresh();
    if (sc.banner[0]) {
        /* The stub library prints from C straight to file descriptor 1. */
        ssize_t ignored = write(1, sc.banner, strlen(sc.banner));
        (void)ignored;
    }
    if (sc.init_error)
        LEAVE(sc.init_error);
    refcount++;
    LEAVE(OK);
}

int nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
int nvmlInit(void) { return nvmlInitWithFlags(0); }

int nvmlShutdown(void) {
    SYSTEM();
    refcount--;
    LEAVE(OK);
}

int nvmlSystemGetDriverVersion(char *version, unsigned length) {
    SYSTEM();
    LEAVE(put_string(version, length, sc.driver));
}

int nvmlSystemGetNVMLVersion(char *version, unsigned length) {
    SYSTEM();
    LEAVE(put_string(version, length, sc.nvml));
}

int nvmlSystemGetCudaDriverVersion(int *version) {
    SYSTEM();
    if (!version) LEAVE(INVALID_ARGUMENT);
    *version = sc.cuda;
    LEAVE(OK);
}

int nvmlSystemGetCudaDriverVersion_v2(int *version) { return nvmlSystemGetCudaDriverVersion(version); }

int nvmlDeviceGetCount_v2(unsigned *count) {
    SYSTEM();
    if (!count) LEAVE(INVALID_ARGUMENT);
    *count = (unsigned)sc.n_gpus;
    LEAVE(OK);
}

int nvmlDeviceGetCount(unsigned *count) { return nvmlDeviceGetCount_v2(count); }

int nvmlDeviceGetHandleByIndex_v2(unsigned index, nvmlDevice_t *device) {
    SYSTEM();
    if (!device || index >= (unsigned)sc.n_gpus) LEAVE(INVALID_ARGUMENT);
    pthread_mutex_unlock(&lock);
    DEVICE(&sc.gpus[index]); /* a lost or failing device fails here too */
    *device = &sc.gpus[index];
    LEAVE(OK);
}

int nvmlDeviceGetHandleByIndex(unsigned index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

int nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    SYSTEM();
    if (!uuid || !device) LEAVE(INVALID_ARGUMENT);
    for (int i = 0; i < sc.n_gpus; i++)
        if (!strcmp(sc.gpus[i].uuid, uuid)) {
            *device = &sc.gpus[i];
            LEAVE(OK);
        }
    LEAVE(NOT_FOUND);
}

/* -- static facts of a device -------------------------------------------------------------- */

int nvmlDeviceGetIndex(nvmlDevice_t d, unsigned *index) {
    DEVICE(d);
    if (!index) LEAVE(INVALID_ARGUMENT);
    *index = (unsigned)gpu_index(d);
    LEAVE(OK);
}

int nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned length) {
    DEVICE(d);
    LEAVE(put_string(name, length, d->name));
}

int nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned length) {
    DEVICE(d);
    LEAVE(put_string(uuid, length, d->uuid));
}

int nvmlDeviceGetCudaComputeCapability(nvmlDevice_t d, int *major, int *minor) {
    DEVICE(d);
    if (!major || !minor) LEAVE(INVALID_ARGUMENT);
    *major = d->cc_major;
    *minor = d->cc_minor;
    LEAVE(OK);
}

int nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t d, unsigned *limit) {
    DEVICE(d);
    if (!limit) LEAVE(INVALID_ARGUMENT);
    *limit = d->power_limit_mw;
    LEAVE(OK);
}

int nvmlDeviceGetPowerManagementLimit(nvmlDevice_t d, unsigned *limit) {
    DEVICE(d);
    if (!limit) LEAVE(INVALID_ARGUMENT);
    *limit = d->power_limit_mw;
    LEAVE(OK);
}

int nvmlDeviceGetNumaNodeId(nvmlDevice_t d, int *node) {
    DEVICE(d);
    if (!node) LEAVE(INVALID_ARGUMENT);
    if (d->numa_node < 0) LEAVE(NOT_SUPPORTED); /* one-node machines, older drivers */
    *node = d->numa_node;
    LEAVE(OK);
}

/* -- what changes sample by sample ------------------------------------------------------- */

int nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *memory) {
    DEVICE(d);
    if (!memory) LEAVE(INVALID_ARGUMENT);
    /* v1 counts the driver's reserved memory as used. */
    unsigned long long used = memory_used(d) + d->memory_reserved;
    memory->total = d->memory_total;
    memory->used = used;
    memory->free = used < d->memory_total ? d->memory_total - used : 0;
    LEAVE(OK);
}

int nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *memory) {
    DEVICE(d);
    if (sc.no_memory_v2) LEAVE(FUNCTION_NOT_FOUND);
    if (!memory) LEAVE(INVALID_ARGUMENT);
    if (memory->version != MEMORY_V2) LEAVE(ARGUMENT_VERSION_MISMATCH);
    unsigned long long used = memory_used(d), held = used + d->memory_reserved;
    memory->total = d->memory_total;
    memory->reserved = d->memory_reserved;
    memory->used = used;
    memory->free = held < d->memory_total ? d->memory_total - held : 0;
    LEAVE(OK);
}

int nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *utilization) {
    DEVICE(d);
    if (!utilization) LEAVE(INVALID_ARGUMENT);
    utilization->gpu = (unsigned)sample(d, S_UTIL_GPU);
    utilization->memory = (unsigned)sample(d, S_UTIL_MEM);
    LEAVE(OK);
}

/* The two-call protocol: a count too small (or no array) answers InsufficientSize with the
 * count needed; no process at all answers Success with 0. */
static int list_processes(const proc_t *listed, int n_listed, unsigned *count, void *infos,
                          size_t stride, int with_instances) {
    if (!count) return INVALID_ARGUMENT;
    proc_t live[MAX_PROCS];
    int n = live_procs(listed, n_listed, live);
    if (infos == NULL || *count < (unsigned)n) {
        int empty = n == 0;
        *count = (unsigned)n;
        return empty ? OK : INSUFFICIENT_SIZE;
    }
    for (int i = 0; i < n; i++) {
        char *slot = (char *)infos + (size_t)i * stride;
        if (with_instances) {
            nvmlProcessInfo_t *p = (nvmlProcessInfo_t *)slot;
            *p = (nvmlProcessInfo_t){live[i].pid, live[i].used, 0xFFFFFFFFU, 0xFFFFFFFFU};
        } else {
            nvmlProcessInfo_v1_t *p = (nvmlProcessInfo_v1_t *)slot;
            *p = (nvmlProcessInfo_v1_t){live[i].pid, live[i].used};
        }
    }
    *count = (unsigned)n;
    return OK;
}

#define PROCESS_LIST(fn, list, type, instances)                                                  \
    int fn(nvmlDevice_t d, unsigned *count, type *infos) {                                       \
        DEVICE(d);                                                                               \
        LEAVE(list_processes(d->list, d->n_##list, count, infos, sizeof(type), instances));      \
    }

PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses_v3, compute, nvmlProcessInfo_t, 1)
PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses_v2, compute, nvmlProcessInfo_t, 1)
PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses, compute, nvmlProcessInfo_v1_t, 0)
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses_v3, graphics, nvmlProcessInfo_t, 1)
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses_v2, graphics, nvmlProcessInfo_t, 1)
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses, graphics, nvmlProcessInfo_v1_t, 0)

int nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned *power) {
    DEVICE(d);
    if (!power) LEAVE(INVALID_ARGUMENT);
    *power = (unsigned)sample(d, S_POWER);
    LEAVE(OK);
}

int nvmlDeviceGetTemperature(nvmlDevice_t d, int sensor, unsigned *temp) {
    DEVICE(d);
    if (sensor != 0 || !temp) LEAVE(INVALID_ARGUMENT);
    *temp = (unsigned)sample(d, S_TEMP);
    LEAVE(OK);
}

int nvmlDeviceGetTemperatureV(nvmlDevice_t d, nvmlTemperature_v1_t *temperature) {
    DEVICE(d);
    if (!temperature) LEAVE(INVALID_ARGUMENT);
    if (temperature->version != TEMPERATURE_V1) LEAVE(ARGUMENT_VERSION_MISMATCH);
    if (temperature->sensorType != 0) LEAVE(INVALID_ARGUMENT);
    temperature->temperature = (int)sample(d, S_TEMP);
    LEAVE(OK);
}

int nvmlDeviceGetClockInfo(nvmlDevice_t d, int type, unsigned *clock) {
    DEVICE(d);
    if (!clock) LEAVE(INVALID_ARGUMENT);
    if (type == 0 || type == 1) /* graphics and SM run on one clock on these parts */
        *clock = (unsigned)sample(d, S_SM_CLOCK);
    else if (type == 2)
        *clock = d->mem_clock_mhz;
    else
        LEAVE(NOT_SUPPORTED);
    LEAVE(OK);
}

int nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t d, unsigned long long *reasons) {
    DEVICE(d);
    if (!reasons) LEAVE(INVALID_ARGUMENT);
    *reasons = sample(d, S_REASONS);
    LEAVE(OK);
}

int nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t d, unsigned long long *reasons) {
    DEVICE(d);
    if (!reasons) LEAVE(INVALID_ARGUMENT);
    *reasons = sample(d, S_REASONS);
    LEAVE(OK);
}

int nvmlDeviceGetPcieThroughput(nvmlDevice_t d, int counter, unsigned *value) {
    DEVICE(d);
    if (!value) LEAVE(INVALID_ARGUMENT);
    if (counter == 0) *value = (unsigned)sample(d, S_PCIE_TX);
    else if (counter == 1) *value = (unsigned)sample(d, S_PCIE_RX);
    else LEAVE(INVALID_ARGUMENT);
    LEAVE(OK);
}

/* Per field, as NVML does: the call succeeds and each value carries its own status. */
int nvmlDeviceGetFieldValues(nvmlDevice_t d, int count, nvmlFieldValue_t *values) {
    DEVICE(d);
    if (count < 0 || (count > 0 && !values)) LEAVE(INVALID_ARGUMENT);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    for (int i = 0; i < count; i++) {
        nvmlFieldValue_t *v = &values[i];
        v->timestamp = (long long)now.tv_sec * 1000000 + now.tv_nsec / 1000;
        v->latencyUsec = 0;
        v->nvmlReturn = NOT_SUPPORTED;
        if (d->pcie_counters && (v->fieldId == 197 || v->fieldId == 198)) {
            v->valueType = 3; /* NVML_VALUE_TYPE_UNSIGNED_LONG_LONG */
            v->value.ullVal = v->fieldId == 198 ? d->pcie_rx_bytes : d->pcie_tx_bytes;
            v->nvmlReturn = OK;
        }
    }
    LEAVE(OK);
}

/* errorType: 0 corrected (single bit), 1 uncorrected (double bit); counterType: 0 volatile
 * (since the driver loaded), 1 aggregate (the device's lifetime). */
int nvmlDeviceGetTotalEccErrors(nvmlDevice_t d, int errorType, int counterType,
                                unsigned long long *count) {
    DEVICE(d);
    if (!count || errorType < 0 || errorType > 1 || counterType < 0 || counterType > 1)
        LEAVE(INVALID_ARGUMENT);
    *count = d->ecc[errorType][counterType];
    LEAVE(OK);
}

/* -- the bus, NVLink, peer-to-peer, CPU affinity ---------------------------------------- */

static void fill_pci(nvmlPciInfo_t *pci, unsigned bus) {
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02X:00.0", bus);
    snprintf(pci->busId, sizeof pci->busId, "00000000:%02X:00.0", bus);
    pci->bus = bus;
    pci->pciDeviceId = 0x20B010DE;
    pci->pciSubSystemId = 0x134F10DE;
}

static unsigned bus_of(int index) {
    int bus = sc.gpus[index].pci_bus;
    return bus < 0 ? 0x07u + (unsigned)index : (unsigned)bus;
}

int nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *pci) {
    DEVICE(d);
    if (!pci) LEAVE(INVALID_ARGUMENT);
    fill_pci(pci, bus_of(gpu_index(d)));
    LEAVE(OK);
}

int nvmlDeviceGetPciInfo_v2(nvmlDevice_t d, nvmlPciInfo_t *pci) { return nvmlDeviceGetPciInfo_v3(d, pci); }
int nvmlDeviceGetPciInfo(nvmlDevice_t d, nvmlPciInfo_t *pci) { return nvmlDeviceGetPciInfo_v3(d, pci); }

int nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t a, nvmlDevice_t b, int *level) {
    DEVICE(a);
    pthread_mutex_unlock(&lock);
    DEVICE(b);
    if (!level) LEAVE(INVALID_ARGUMENT);
    int i = gpu_index(a), j = gpu_index(b);
    *level = i == j ? 0 : pair_value(sc.topology, sc.n_topology, i, j, 30 /* HOSTBRIDGE */);
    LEAVE(OK);
}

int nvmlDeviceGetP2PStatus(nvmlDevice_t a, nvmlDevice_t b, int index, int *status) {
    DEVICE(a);
    pthread_mutex_unlock(&lock);
    DEVICE(b);
    if (!status || index < 0 || index > 4) LEAVE(INVALID_ARGUMENT);
    *status = pair_value(sc.p2p, sc.n_p2p, gpu_index(a), gpu_index(b), 0 /* OK */);
    LEAVE(OK);
}

static int link_peer(nvmlDevice_t d, unsigned link, int *peer) {
    if (d->n_links == 0) return NOT_SUPPORTED; /* a PCIe-only GPU */
    if (link >= (unsigned)d->n_links) return INVALID_ARGUMENT; /* past the device's last link */
    *peer = d->links[link];
    return OK;
}

int nvmlDeviceGetNvLinkState(nvmlDevice_t d, unsigned link, int *active) {
    DEVICE(d);
    int peer, r;
    if (!active) LEAVE(INVALID_ARGUMENT);
    if ((r = link_peer(d, link, &peer)) != OK) LEAVE(r);
    *active = peer != -1;
    LEAVE(OK);
}

int nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t d, unsigned link, nvmlPciInfo_t *pci) {
    DEVICE(d);
    int peer, r;
    if (!pci) LEAVE(INVALID_ARGUMENT);
    if ((r = link_peer(d, link, &peer)) != OK) LEAVE(r);
    if (peer == -1) LEAVE(NOT_SUPPORTED); /* an inactive link has no far end */
    if (peer == -2)
        fill_pci(pci, 0xC0u + link); /* each NVSwitch port has its own bus id */
    else if (peer >= 0 && peer < sc.n_gpus)
        fill_pci(pci, bus_of(peer));
    else
        LEAVE(UNKNOWN);
    LEAVE(OK);
}

int nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t d, unsigned link, nvmlPciInfo_t *pci) {
    return nvmlDeviceGetNvLinkRemotePciInfo_v2(d, link, pci);
}

int nvmlDeviceGetCpuAffinity(nvmlDevice_t d, unsigned size, unsigned long *cpus) {
    DEVICE(d);
    if (!cpus || size == 0) LEAVE(INVALID_ARGUMENT);
    for (unsigned i = 0; i < size; i++)
        cpus[i] = i < 4 ? (unsigned long)d->affinity[i] : 0;
    LEAVE(OK);
}

/* -- events: Xid errors ----------------------------------------------------------------- */

int nvmlDeviceGetSupportedEventTypes(nvmlDevice_t d, unsigned long long *types) {
    DEVICE(d);
    if (!types) LEAVE(INVALID_ARGUMENT);
    *types = 0x1 | 0x2 | EVENT_XID; /* single- and double-bit ECC, Xid critical errors */
    LEAVE(OK);
}

int nvmlEventSetCreate(nvmlEventSet_t *set) {
    SYSTEM();
    if (!set) LEAVE(INVALID_ARGUMENT);
    for (int i = 0; i < MAX_SETS; i++)
        if (!sets[i].used) {
            memset(&sets[i], 0, sizeof sets[i]);
            sets[i].used = 1;
            *set = &sets[i];
            LEAVE(OK);
        }
    LEAVE(20); /* NVML_ERROR_MEMORY */
}

static int set_ok(nvmlEventSet_t set) {
    return set >= sets && set < sets + MAX_SETS && set->used;
}

int nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types, nvmlEventSet_t set) {
    DEVICE(d);
    if (!set_ok(set)) LEAVE(INVALID_ARGUMENT);
    if (types & ~(0x1ULL | 0x2ULL | EVENT_XID)) LEAVE(NOT_SUPPORTED);
    int i = gpu_index(d);
    set->mask[i] |= types;
    set->delivered[i] = d->n_xid; /* events from now on, as with the driver */
    LEAVE(OK);
}

/* The next Xid not yet delivered to this set; waits up to timeout ms, re-reading the
 * scenario, so a test can append "xid 79" while a job runs. */
int nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned timeout_ms) {
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        SYSTEM();
        if (!set_ok(set) || !data) LEAVE(INVALID_ARGUMENT);
        for (int i = 0; i < sc.n_gpus; i++) {
            gpu_t *g = &sc.gpus[i];
            if ((set->mask[i] & EVENT_XID) && set->delivered[i] < g->n_xid) {
                if (g->lost_after >= 0 && calls[i] >= g->lost_after) continue;
                *data = (nvmlEventData_t){g, EVENT_XID, g->xid[set->delivered[i]++], 0xFFFFFFFFU,
                                          0xFFFFFFFFU};
                LEAVE(OK);
            }
        }
        pthread_mutex_unlock(&lock);
        clock_gettime(CLOCK_MONOTONIC, &now);
        long waited = (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
        if (waited >= (long)timeout_ms)
            return TIMEOUT;
        usleep(10000);
    }
}

int nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned timeout_ms) {
    return nvmlEventSetWait_v2(set, data, timeout_ms);
}

int nvmlEventSetFree(nvmlEventSet_t set) {
    pthread_mutex_lock(&lock);
    if (!set_ok(set)) LEAVE(INVALID_ARGUMENT);
    set->used = 0;
    LEAVE(OK);
}
