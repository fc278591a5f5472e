# What reprocessing changed (agent/cohort/compare.py): each sample's analysis against the newest
# one it replaced, which `agent run --replace-changed` (the analyze rule's) set aside in the
# sample's previous/ when the sheet or the input asked for other settings. Which sample will be
# redone is known only once its analyze job ran, so the comparison follows every change of the
# records (it reads records and the final objects' cell annotations: seconds); a sample never
# redone is a "not reprocessed" row. The report copies the comparison and links it.

from agent.cohort.compare import HTML, TSV

COMPARISON_DIR = "results/comparison"


rule compare:
    """Compare each sample's current analysis with its newest previous one."""
    input:
        world_states=expand(str(SAMPLE.record), sample=SAMPLES),
    output:
        tsv=f"{COMPARISON_DIR}/{TSV}",
        html=f"{COMPARISON_DIR}/{HTML}",
    log:
        "logs/compare/compare.log",
    params:
        # RESULTS of RESULTS/samples/NAME/world_state.json, and the output's folder
        results=lambda wildcards, input: Path(input.world_states[0]).parents[2],
        outdir=lambda wildcards, output: Path(output.tsv).parent,
        samples=shlex.join(SAMPLES),
    resources:
        **rule_resources("report"),  # read like the report: one process, the same few files
    threads: 1
    conda:
        "../../envs/agent.yaml"
    container:
        AGENT_IMAGE
    shell:
        "python -m agent compare {params.results:q} --samples {params.samples}"
        " --outdir {params.outdir:q} > {log:q} 2>&1"
