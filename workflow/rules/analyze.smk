# One agent job per sample: the agent loop with the sample's policy, writing the provenance
# record, per-step metrics, checkpoints, plots and, when the analysis finishes, the final AnnData
# (the files' names: agent/layout.py). An analysis that ends unfinished (e.g. unreadable input)
# still exits 0 with its record: the report shows it as failed. A fault of the machine (server
# gone, I/O error, SIGTERM at a time limit) exits non-zero; the unfinished record in checkpoints/
# (not an output, so Snakemake keeps it) lets the retry resume. A rerun of a finished sample with
# the same settings keeps its record (the same file) and redoes nothing.


rule analyze:
    """Analyse one sample with `agent run` (reference or llm policy)."""
    input:
        unpack(analyze_input),
    output:
        world_state=str(SAMPLE.record),
        metrics=str(SAMPLE.metrics),
    log:
        "logs/analyze/{sample}.log",
    params:
        args=analyze_args,
        outdir=lambda wildcards: str(SAMPLE.root).format(sample=wildcards.sample),
        wait_for_server=wait_for_server,
    threads: sample_value("cpus_per_task")
    resources:
        runtime=sample_value("runtime"),
        mem_mb=sample_value("mem_mb"),
        cpus_per_task=sample_value("cpus_per_task"),
        **analyze_partition(),
    group:
        analyze_group
    conda:
        "../../envs/agent.yaml"
    shell:
        """
        echo "host $(hostname), slurm job ${{SLURM_JOB_ID:-none}}" > {log:q}
        {{ {params.wait_for_server}; }} >> {log:q} 2>&1
        # BLAS threads within the job's allocation
        export OMP_NUM_THREADS={threads} OPENBLAS_NUM_THREADS={threads} MKL_NUM_THREADS={threads}
        python -m agent run --outdir {params.outdir:q} {params.args} >> {log:q} 2>&1
        """
