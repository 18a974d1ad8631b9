# Paper-replication harness: DEX, TEV/ExitTrain, vSkipper. See README.md.
#   snakemake --cores 2                                   # embedded CPU default (configs/default.yaml)
#   snakemake --cores 2 --configfile configs/smoke.yaml   # CI smoke
#   snakemake --profile profiles/slurm --configfile configs/paper/dex.yaml
from snakemake.utils import min_version

min_version("9.0")


# The embedded default unless --configfile names other files (then the default is not merged in;
# --config KEY=VALUE overrides apply on top of whichever file is used).
if not workflow.overwrite_configfiles:

    configfile: "configs/default.yaml"



include: "workflows/common.smk"
include: "workflows/models.smk"
include: "workflows/workloads.smk"
include: "workflows/ead.smk"
include: "workflows/dex.smk"
include: "workflows/tev.smk"
include: "workflows/vskipper.smk"
include: "workflows/vskipper_bench.smk"
include: "workflows/vskipper_http.smk"
include: "workflows/vskipper_sglang.smk"
include: "workflows/report.smk"


rule all:
    input:
        get_final_output(),
    default_target: True
