# The served model evaluated before a cohort runs on it (`agent eval`, agent/eval/): asked at the
# decision points of reference analyses of the cases that packages ship, and analysing a few of
# them on its own; its scores and speed in results/eval/eval.json and eval.html. Only when asked:
# `snakemake eval_model`, or config eval.min_score, which makes every llm sample's analysis wait
# for an evaluation that reached it. The model is served as for the cohort: in vllm mode by
# serve_vllm's shard "eval" (the same options), a service job in one group (one Slurm
# allocation) with the eval job, which Snakemake stops when the evaluation ends; in external
# mode the given server is asked.
#
# The evaluation's work (the cases' inputs, its sessions, the end-to-end analyses) stays in
# results/eval/cases/ and end_to_end/, undeclared: only eval.json and eval.html are read later.
# Its functions: common.smk.


rule eval_model:
    """Score the served model's decisions and speed (`agent eval`) before a cohort runs on it."""
    input:
        unpack(eval_input),
    output:
        json=EVAL_JSON,
        html=EVAL_HTML,
    log:
        "logs/eval_model/eval.log",
    benchmark:
        "benchmarks/eval_model/eval.tsv"
    params:
        outdir=lambda wildcards, output: os.path.dirname(output.json),
        args=eval_args(),
        # how the model is served: another model or other flags evaluate again
        served=serve_options(EVAL_SHARD) if SERVER["mode"] == "vllm" else "",
        wait_for_server=wait_for_endpoint(EVAL_SHARD) if SERVER["mode"] == "vllm" else ":",
    threads: config["resources"]["eval"]["cpus_per_task"]
    resources:
        **eval_resources(),
    group:
        f"server_{EVAL_SHARD}" if SERVER["mode"] == "vllm" else None
    conda:
        "../../envs/agent.yaml"
    container:
        AGENT_IMAGE
    shell:
        """
        {{ {params.wait_for_server}; }} > {log:q} 2>&1
        export OMP_NUM_THREADS={threads} OPENBLAS_NUM_THREADS={threads} MKL_NUM_THREADS={threads}
        python -m agent eval --outdir {params.outdir:q} {params.args} >> {log:q} 2>&1
        """


rule eval_min_score:
    """Refuse the llm samples' analyses when the evaluation scored below eval.min_score."""
    localrule: True  # reads one small file
    input:
        evaluation=EVAL_JSON,
    output:
        EVAL_PASSED,
    log:
        "logs/eval_model/min_score.log",
    params:
        min_score=EVAL["min_score"],
        page=EVAL_HTML,
    conda:
        "../../envs/agent.yaml"
    container:
        AGENT_IMAGE
    script:
        "../scripts/eval_min_score.py"
