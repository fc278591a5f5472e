# The single-cell agent pipeline: demo data -> vLLM servers (per shard) -> one agent job per
# sample -> replay -> cohort report. `snakemake --cores 2` runs the demo cohort locally with the
# reference policy; `snakemake --profile profiles/slurm` runs it on a cluster. Every config key and
# sheet column: config/README.md. `snakemake --report report.zip` after a run: the cohort report,
# each sample's world state and plots.

from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/demo.smk"
include: "workflow/rules/serve.smk"
include: "workflow/rules/analyze.smk"
include: "workflow/rules/report.smk"


wildcard_constraints:
    sample=r"[A-Za-z0-9][A-Za-z0-9_.-]*",
    name=r"[A-Za-z0-9][A-Za-z0-9_.-]*",
    shard=r"shard\d+",


localrules:
    all,
    fetch_model,  # needs the internet, which compute nodes may not have


rule all:
    """The cohort report, which needs every sample analysed and replayed."""
    input:
        rules.report.output,
    default_target: True
