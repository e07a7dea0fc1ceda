/* A stand-in for the NVIDIA driver's libcuda.so.1: only the process-checkpoint API
 * (cuCheckpointProcess*) and what a caller needs around it (cuInit, cuDriverGetVersion,
 * cuGetErrorName). Built by the tests (tests/standin_libcuda/build.py) into a directory
 * put first on LD_LIBRARY_PATH, so provisioner.node.checkpoint loads it as the driver.
 *
 * State lives in files under $STANDIN_LIBCUDA_DIR so the test and the agent (another
 * process) see the same thing:
 *   <dir>/<pid>.state    the process's CUprocessState (0 RUNNING .. 3 FAILED), absent = RUNNING
 *   <dir>/calls.log      one line per call: "<function> <pid> <result>"
 *   <dir>/fail-<step>    make <step> (lock|checkpoint|restore|unlock) fail; its content, if
 *                        "failed", also leaves the process FAILED
 *   $STANDIN_LIBCUDA_DRIVER_API   what cuDriverGetVersion answers (default 12090)
 * Transitions are the driver's: lock RUNNING->LOCKED, checkpoint LOCKED->CHECKPOINTED,
 * restore CHECKPOINTED->LOCKED, unlock LOCKED->RUNNING; anything else is ILLEGAL_STATE.
 * Compiled with -DNO_CHECKPOINT it is a driver older than 570 (no checkpoint entry points).
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

typedef int CUresult;
enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999,
};

static int initialised = 0;

static const char *dir(void) { return getenv("STANDIN_LIBCUDA_DIR"); }

__attribute__((unused)) static void log_call(const char *fn, int pid, CUresult r) {
    char path[4096];
    if (!dir()) return;
    snprintf(path, sizeof path, "%s/calls.log", dir());
    FILE *f = fopen(path, "a");
    if (!f) return;
    fprintf(f, "%s %d %d\n", fn, pid, r);
    fclose(f);
}

CUresult cuInit(unsigned int flags) {
    (void)flags;
    if (!dir()) return CUDA_ERROR_NO_DEVICE;
    initialised = 1;
    return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int *version) {
    const char *v = getenv("STANDIN_LIBCUDA_DRIVER_API");
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = v ? atoi(v) : 12090;
    return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char **name) {
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    switch (error) {
    case CUDA_SUCCESS: *name = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *name = "CUDA_ERROR_NOT_INITIALIZED"; break;
    case CUDA_ERROR_NO_DEVICE: *name = "CUDA_ERROR_NO_DEVICE"; break;
    case CUDA_ERROR_ILLEGAL_STATE: *name = "CUDA_ERROR_ILLEGAL_STATE"; break;
    case CUDA_ERROR_NOT_SUPPORTED: *name = "CUDA_ERROR_NOT_SUPPORTED"; break;
    case CUDA_ERROR_UNKNOWN: *name = "CUDA_ERROR_UNKNOWN"; break;
    default: *name = "CUDA_ERROR_UNKNOWN"; return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

#ifndef NO_CHECKPOINT
static int state_path(int pid, char *path, size_t n) {
    return snprintf(path, n, "%s/%d.state", dir(), pid) < (int)n;
}

static int read_state(int pid) {
    char path[4096];
    int s = 0;
    if (!state_path(pid, path, sizeof path)) return 0;
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    if (fscanf(f, "%d", &s) != 1) s = 0;
    fclose(f);
    return s;
}

static void write_state(int pid, int s) {
    char path[4096];
    if (!state_path(pid, path, sizeof path)) return;
    FILE *f = fopen(path, "w");
    if (!f) return;
    fprintf(f, "%d\n", s);
    fclose(f);
}

/* 1 if <dir>/fail-<step> exists; *failed set when it says "failed" */
static int injected(const char *step, int *failed) {
    char path[4096], word[16] = {0};
    snprintf(path, sizeof path, "%s/fail-%s", dir(), step);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    if (fscanf(f, "%15s", word) == 1 && strcmp(word, "failed") == 0) *failed = 1;
    fclose(f);
    return 1;
}

static CUresult transition(const char *fn, const char *step, int pid, int from, int to) {
    CUresult r = CUDA_SUCCESS;
    int failed = 0;
    if (!initialised) r = CUDA_ERROR_NOT_INITIALIZED;
    else if (pid <= 0 || (kill(pid, 0) != 0 && errno != EPERM)) r = CUDA_ERROR_INVALID_VALUE;
    else if (read_state(pid) != from) r = CUDA_ERROR_ILLEGAL_STATE;
    else if (injected(step, &failed)) {
        r = CUDA_ERROR_UNKNOWN;
        if (failed) write_state(pid, 3);
    } else write_state(pid, to);
    log_call(fn, pid, r);
    return r;
}

CUresult cuCheckpointProcessGetState(int pid, int *state) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!state || pid <= 0 || (kill(pid, 0) != 0 && errno != EPERM)) return CUDA_ERROR_INVALID_VALUE;
    *state = read_state(pid);
    return CUDA_SUCCESS;
}

CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!tid) return CUDA_ERROR_INVALID_VALUE;
    *tid = pid;
    return CUDA_SUCCESS;
}

CUresult cuCheckpointProcessLock(int pid, void *args) {
    (void)args;
    return transition("cuCheckpointProcessLock", "lock", pid, 0, 1);
}

CUresult cuCheckpointProcessCheckpoint(int pid, void *args) {
    (void)args;
    return transition("cuCheckpointProcessCheckpoint", "checkpoint", pid, 1, 2);
}

CUresult cuCheckpointProcessRestore(int pid, void *args) {
    (void)args;
    return transition("cuCheckpointProcessRestore", "restore", pid, 2, 1);
}

CUresult cuCheckpointProcessUnlock(int pid, void *args) {
    (void)args;
    return transition("cuCheckpointProcessUnlock", "unlock", pid, 1, 0);
}
#endif
