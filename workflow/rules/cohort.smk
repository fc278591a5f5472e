# The cohort object, only when config cohort_integration.method is not "disabled": every finished
# sample's final object in one AnnData, integrated, clustered and labelled (agent/cohort/). The
# cohort's composition (always) and, where the sheet names conditions, its tests: the composition
# test and differential expression per label (config conditions).

from agent.cohort import composition, de
from agent.cohort.integrate import SUMMARY

COHORT = config["cohort_integration"]
COHORT_DIR = "results/cohort"
COHORT_SUMMARY = f"{COHORT_DIR}/{SUMMARY}"
# what the report reads when the cohort object is on; nothing (and no cohort job) when off
COHORT_ON = COHORT["method"] != "disabled"
# the composition and the tests read the cohort object's labels when it integrated them all
COHORT_OBJECT = {"cohort": COHORT_SUMMARY} if COHORT_ON else {}
CONDITIONS = config["conditions"]
COMPOSITION_SUMMARY = f"{COHORT_DIR}/composition/{composition.SUMMARY}"
DE_SUMMARY = f"{COHORT_DIR}/de/{de.SUMMARY}"
# the differential expression only where some sample has a condition; the composition always
DE_ON = bool(CONDITIONS["column"]) and any(s.get(CONDITIONS["column"]) for s in SAMPLES.values())
COHORT_REPORT_INPUT = {
    **COHORT_OBJECT,
    "composition": COMPOSITION_SUMMARY,
    **({"de": DE_SUMMARY} if DE_ON else {}),
}
# the report's options for them (`agent report --composition DIR --de DIR`)
CONDITIONS_REPORT_OPTIONS = shlex.join(
    [
        *("--composition", os.path.dirname(COMPOSITION_SUMMARY)),
        *(("--de", os.path.dirname(DE_SUMMARY)) if DE_ON else ()),
    ]
)
# `agent composition`'s and `agent de`'s shared options from config, shell-quoted
CONDITIONS_OPTIONS = [
    *("--condition", CONDITIONS["column"], "--min-samples", str(CONDITIONS["min_samples"])),
    *(("--reference", CONDITIONS["reference"]) if CONDITIONS["reference"] else ()),
    *(("--cohort", COHORT_DIR) if COHORT_ON else ()),
]
COMPOSITION_OPTIONS = shlex.join(
    [
        *CONDITIONS_OPTIONS,
        *(("--group-by", CONDITIONS["group_by"]) if CONDITIONS["group_by"] else ()),
    ]
)
DE_OPTIONS = shlex.join(
    [
        *CONDITIONS_OPTIONS,
        *("--min-cells", str(CONDITIONS["min_cells"]), "--alpha", str(CONDITIONS["alpha"])),
    ]
)


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


rule cohort_composition:
    """Each finished sample's share of every label (composition.tsv, stacked bars) and, with two or
    more conditions of enough samples, propeller's test of which labels' shares differ."""
    input:
        **COHORT_OBJECT,  # its labels, when it integrated every finished sample
        world_states=expand(str(SAMPLE.record), sample=SAMPLES),
        sheet=config["samples"],  # the conditions and groups
    output:
        summary=COMPOSITION_SUMMARY,
    log:
        "logs/cohort/composition.log",
    benchmark:
        "benchmarks/cohort/composition.tsv"
    params:
        outdir=lambda wildcards, output: os.path.dirname(output.summary),
        options=COMPOSITION_OPTIONS,
    threads: 1
    resources:
        **rule_resources("cohort"),
    conda:
        "../../envs/agent.yaml"
    container:
        AGENT_IMAGE
    shell:
        """
        python -m agent composition --world-states {input.world_states:q} --samples {input.sheet:q} \
            --outdir {params.outdir:q} {params.options} > {log:q} 2>&1
        """


rule cohort_de:
    """Differential expression between the conditions per label: pseudobulk counts of the samples
    with enough cells of it, PyDESeq2 (~condition); the labels too rare for a test listed."""
    input:
        **COHORT_OBJECT,  # its labels and counts, when it integrated every finished sample
        world_states=expand(str(SAMPLE.record), sample=SAMPLES),
        sheet=config["samples"],
    output:
        summary=DE_SUMMARY,
    log:
        "logs/cohort/de.log",
    benchmark:
        "benchmarks/cohort/de.tsv"
    params:
        outdir=lambda wildcards, output: os.path.dirname(output.summary),
        options=DE_OPTIONS,
    threads: config["resources"]["cohort"]["cpus_per_task"]
    resources:
        **rule_resources("cohort"),
    conda:
        "../../envs/agent.yaml"
    container:
        AGENT_IMAGE
    shell:
        """
        export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
        python -m agent de --world-states {input.world_states:q} --samples {input.sheet:q} \
            --outdir {params.outdir:q} --threads {threads} {params.options} > {log:q} 2>&1
        """
