/*
 * A STAND-IN for the pyxis SPANK plugin, for the one-node TEST cluster only (scripts/slurm_cluster.sh
 * builds it and lists it in plugstack.conf). It is not pyxis and runs no container.
 *
 * Why: the generated sbatch scripts pass pyxis's srun options (--container-image, --container-name,
 * --container-mounts, --container-workdir) on every step. Without pyxis, srun rejects them, so the
 * integration tests could only run scripts that differ from what a real cluster runs. This plugin
 * registers the same four options with srun, so the scripts run on the test cluster byte for byte,
 * and it checks what it can without a container:
 *   - every mount source exists, and is mounted at its own path (the jobs' convention: the same
 *     absolute paths work inside and outside the container; a remap cannot be emulated);
 *   - the task starts in --container-workdir;
 *   - it prints one "[pyxis-standin] ..." line per task with the values it received, so the tests
 *     can assert that the step got the flags.
 * The task then runs on the host filesystem (the "image" is the host), which is why the tests pass
 * --container-dflash-bin with the host's dflash-trt.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <slurm/spank.h>

SPANK_PLUGIN(pyxis_standin, 1);

enum { OPT_IMAGE, OPT_MOUNTS, OPT_WORKDIR, OPT_NAME, OPT_COUNT };
static char *values[OPT_COUNT];

static int set_option(int val, const char *optarg, int remote)
{
    (void)remote;
    if (val < 0 || val >= OPT_COUNT)
        return -1;
    free(values[val]);
    values[val] = optarg ? strdup(optarg) : NULL;
    return 0;
}

struct spank_option spank_options[] = {
    {"container-image", "IMAGE", "[pyxis stand-in] image (recorded; the task runs on the host)", 1, OPT_IMAGE, set_option},
    {"container-mounts", "SRC:DST[,...]", "[pyxis stand-in] mounts: SRC must exist and equal DST", 1, OPT_MOUNTS, set_option},
    {"container-workdir", "DIR", "[pyxis stand-in] working directory of the task", 1, OPT_WORKDIR, set_option},
    {"container-name", "NAME", "[pyxis stand-in] container name (recorded)", 1, OPT_NAME, set_option},
    SPANK_OPTIONS_TABLE_END
};

static int fail(const char *what, const char *detail)
{
    fprintf(stderr, "[pyxis-standin] error: %s: %s\n", what, detail);
    slurm_error("pyxis-standin: %s: %s", what, detail);
    return -1;
}

static int check_mounts(const char *mounts)
{
    char *copy = strdup(mounts), *save = NULL;
    int rc = 0;
    for (char *m = strtok_r(copy, ",", &save); m && rc == 0; m = strtok_r(NULL, ",", &save)) {
        char *dst = strchr(m, ':');
        if (dst) {
            *dst++ = '\0';
            char *flags = strchr(dst, ':');
            if (flags)
                *flags = '\0';
        } else {
            dst = m;
        }
        struct stat st;
        if (stat(m, &st) != 0)
            rc = fail(m, strerror(errno));
        else if (strcmp(m, dst) != 0)
            rc = fail(m, "mounted at another path: the stand-in cannot remap without a container");
    }
    free(copy);
    return rc;
}

/* In the task, after its I/O is set up and before the command is exec'd. */
int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
    (void)sp; (void)ac; (void)av;
    int any = 0;
    for (int i = 0; i < OPT_COUNT; i++)
        any |= values[i] != NULL;
    if (!any)
        return 0;
    if (values[OPT_MOUNTS] && check_mounts(values[OPT_MOUNTS]) != 0)
        return -1;
    if (values[OPT_WORKDIR] && chdir(values[OPT_WORKDIR]) != 0)
        return fail(values[OPT_WORKDIR], strerror(errno));
    fprintf(stderr, "[pyxis-standin] image=%s name=%s workdir=%s mounts=%s\n",
            values[OPT_IMAGE] ? values[OPT_IMAGE] : "-", values[OPT_NAME] ? values[OPT_NAME] : "-",
            values[OPT_WORKDIR] ? values[OPT_WORKDIR] : "-", values[OPT_MOUNTS] ? values[OPT_MOUNTS] : "-");
    return 0;
}
