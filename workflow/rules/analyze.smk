# One agent job per sample: the agent loop with the sample's policy, writing the provenance record,
# per-step metrics, checkpoints, plots and, when the analysis finishes, the final AnnData (the
# files' names: agent/record/layout.py). An analysis that ends unfinished (repeated failures, step
# limit) still exits 0 with its record: the report shows it as failed. So does a refused input
# (load_data could not read counts from it, e.g. too few cells or normalised values): `agent run`
# exits 3, which the job accepts as the sample's result (a retry would end the same way): the log
# ends with "input refused (exit 3)" and the reason, which the record's meta.error keeps too; a
# fixed sheet row (its `layer` or `gene_symbols` column) redoes the sample. A fault of the machine
# (server gone, I/O error, too little memory or disk for the input, SIGTERM at a time limit) exits
# non-zero; the unfinished record in checkpoints/ lets the retry, with more memory, resume. A rerun
# of a finished sample with the same settings keeps its record (the same file) and redoes nothing,
# and publishes again, from their copies beside the checkpoints, the outputs Snakemake deleted (a
# job failed after the agent ended, e.g. "output older than input" when the input's time is in the
# future). One results folder per workflow: a folder another run's agent writes stops the workflow
# before any job (common.smk, analyze_input). Snakemake deletes a job's log before each attempt:
# every attempt's is also appended to logs/analyze/{sample}.attempts.log.
#
# Declared: the record, the metrics and plots/ (made even when nothing was drawn). Not declared:
# adata.h5ad, which only a finished analysis writes (Snakemake has no optional outputs, and a
# missing declared output fails the job), and checkpoints/, since Snakemake deletes the declared
# outputs of a failed job and the retry resumes from it. plots/ is `update()`: Snakemake would
# otherwise delete it before every rerun, and a kept analysis draws nothing again.


rule analyze:
    """Analyse one sample with `agent run` (reference or llm policy)."""
    input:
        unpack(analyze_input),
    output:
        world_state=report(
            str(SAMPLE.record),
            caption="../report/world_state.rst",
            category="Samples",
            subcategory="{sample}",
            labels={"sample": "{sample}", "item": "world state"},
        ),
        metrics=str(SAMPLE.metrics),
        plots=update(
            report(
                directory(str(SAMPLE.plots)),
                patterns=["{name}.png"],
                caption="../report/plots.rst",
                category="Samples",
                subcategory="{sample}",
                labels={"sample": "{sample}", "item": "plot {name}"},
            )
        ),
    log:
        "logs/analyze/{sample}.log",
    benchmark:
        "benchmarks/analyze/{sample}.tsv"
    params:
        args=analyze_args,
        outdir=str(SAMPLE.root),  # Snakemake fills in {sample}, as in the outputs
        attempts="logs/analyze/{sample}.attempts.log",
        wait_for_server=WAIT_FOR_SERVER,
    threads: sample_value("cpus_per_task")
    resources:
        **analyze_partition(),
        runtime=sample_per_attempt("runtime"),
        mem_mb=sample_per_attempt("mem_mb"),
        cpus_per_task=sample_value("cpus_per_task"),
    group:
        ANALYZE_GROUP
    conda:
        "../../envs/agent.yaml"
    container:
        AGENT_IMAGE
    shell:
        """
        echo "$(date -u +%FT%TZ) host $(hostname), slurm job ${{SLURM_JOB_ID:-none}}" > {log:q}
        # Snakemake empties the log before a retry: each attempt's is appended to the attempts
        # log as the job ends, however it ends (no pipe into tee: a tee killed first at a time
        # limit would turn the agent's last words into a broken pipe)
        trap "cat {log:q} >> {params.attempts:q}" EXIT
        {{ {params.wait_for_server}; }} >> {log:q} 2>&1
        # BLAS threads within the job's allocation
        export OMP_NUM_THREADS={threads} OPENBLAS_NUM_THREADS={threads} MKL_NUM_THREADS={threads}
        python -m agent run --outdir {params.outdir:q} {params.args} >> {log:q} 2>&1 || [ $? -eq 3 ]
        mkdir -p {output.plots:q}  # an analysis that drew nothing still has the declared folder
        """
