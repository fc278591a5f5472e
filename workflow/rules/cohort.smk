# The cohort object, only when config cohort_integration.method is not "disabled": every finished
# sample's final object in one AnnData, integrated, clustered and labelled (agent/cohort/).

from agent.cohort.integrate import SUMMARY

COHORT = config["cohort_integration"]
COHORT_DIR = "results/cohort"
COHORT_SUMMARY = f"{COHORT_DIR}/{SUMMARY}"
# what the report reads when the cohort object is on; nothing (and no cohort job) when off
COHORT_ON = COHORT["method"] != "disabled"
COHORT_REPORT_INPUT = {"cohort": COHORT_SUMMARY} if COHORT_ON else {}


# `agent integrate`'s options from config, shell-quoted
COHORT_OPTIONS = shlex.join(
    [
        *("--method", COHORT["method"], "--seed", str(COHORT["seed"])),
        *("--n-top-genes", str(COHORT["n_top_genes"]), "--n-comps", str(COHORT["n_comps"])),
        *("--resolution", str(COHORT["resolution"])),
        *(("--celltypist-model", COHORT["celltypist_model"]) if COHORT["celltypist_model"] else ()),
    ]
)


rule integrate_cohort:
    """Gather the finished samples' final objects, integrate them (harmonypy or none), cluster and
    label the cohort, and measure batch mixing and label conservation. With fewer than two
    finished samples the summary says "not integrated" and the job still succeeds."""
    input:
        world_states=expand(str(SAMPLE.record), sample=SAMPLES),
        sheet=config["samples"],  # its columns go into obs
        model=[COHORT["celltypist_model"]] if COHORT["celltypist_model"] else [],
    output:
        # the summary only: the object and plots exist only when two or more samples finished
        # (the summary names them then), and a missing declared output would fail the job
        summary=COHORT_SUMMARY,
    log:
        "logs/cohort/integrate.log",
    benchmark:
        "benchmarks/cohort/integrate.tsv"
    params:
        outdir=lambda wildcards, output: os.path.dirname(output.summary),
        options=COHORT_OPTIONS,
    threads: config["resources"]["cohort"]["cpus_per_task"]
    resources:
        **rule_resources("cohort"),
    conda:
        "../../envs/agent.yaml"
    container:
        AGENT_IMAGE
    shell:
        """
        export OMP_NUM_THREADS={threads} OPENBLAS_NUM_THREADS={threads} MKL_NUM_THREADS={threads}
        python -m agent integrate --world-states {input.world_states:q} --samples {input.sheet:q} \
            --outdir {params.outdir:q} {params.options} > {log:q} 2>&1
        """
