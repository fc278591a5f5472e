# Replay every recorded analysis without a model, then aggregate the cohort.


rule replay:
    """Re-run the recorded steps of one sample and compare the results with the record."""
    input:
        world_state=str(SAMPLE.record),
    output:
        replay=str(SAMPLE.replay),
    log:
        "logs/replay/{sample}.log",
    threads: sample_value("cpus_per_task")  # the thread count of the run it checks
    resources:
        **rule_resources("replay"),
        cpus_per_task=sample_value("cpus_per_task"),
    conda:
        "../../envs/agent.yaml"
    container:
        AGENT_IMAGE
    shell:
        """
        export OMP_NUM_THREADS={threads} OPENBLAS_NUM_THREADS={threads} MKL_NUM_THREADS={threads}
        # exit 1 = diverged or altered, 3 = not replayed (input missing or changed): findings in
        # replay.json that the report shows; 4 = the machine failed the replay (full disk, I/O
        # error, memory) and anything else fails the job, so the next run replays it
        python -m agent replay --world-state {input.world_state:q} --out {output.replay:q} > {log:q} 2>&1 \
            || case $? in 1|3) ;; *) false ;; esac
        """


rule report:
    """The cohort report (index.html, cohort.tsv, RO-Crate) from all world states and replays."""
    input:
        # the cohort object's summary (only when it is on), the composition's and, with
        # conditions, the differential expression's
        **COHORT_REPORT_INPUT,
        **EVAL_REPORT_INPUT,  # the model's evaluation, only with eval.min_score (eval.smk)
        world_states=expand(str(SAMPLE.record), sample=SAMPLES),
        replays=expand(str(SAMPLE.replay), sample=SAMPLES),
        comparison=rules.compare.output.tsv,  # what reprocessing changed, copied and linked
    output:
        # One folder: index.html links cohort.tsv and ro-crate/, which `snakemake --report`
        # ships with it only when they are one htmlindex item.
        report=report(
            directory("results/report"),
            htmlindex="index.html",
            caption="../report/cohort.rst",
            category="Cohort report",
        ),
    log:
        "logs/report/report.log",
    params:
        # the Snakefile's folder, for the crate; relative, so that moving the checkout together
        # with its results does not change the param (a changed param reruns the report); a
        # remote source has no folder to copy: the crate then names no workflow files
        workflow_root=(
            f"--workflow-root {shlex.quote(os.path.relpath(WORKFLOW_ROOT))}"
            if WORKFLOW_ROOT
            else ""
        ),
        cohort=f"--cohort {COHORT_DIR}" if COHORT_ON else "",
        conditions=CONDITIONS_REPORT_OPTIONS,
        comparison=lambda wildcards, input: Path(input.comparison).parent,
        # the servers' figures (only those that exist are read): the performance section
        server_metrics=shlex.join(["--server-metrics", *SERVER_METRICS]) if SERVER_METRICS else "",
        # the model's latest evaluation, where there is one: linked when it is the samples' model
        evaluation=EVAL_REPORT_OPTION,
        evaluation_sha256=EVAL_REPORT_SHA256,
    resources:
        **rule_resources("report"),
    threads: 1
    conda:
        "../../envs/agent.yaml"
    container:
        AGENT_IMAGE
    shell:
        "python -m agent report --world-states {input.world_states:q} --replays {input.replays:q}"
        " --outdir {output.report:q} {params.workflow_root} {params.cohort} {params.conditions}"
        " --comparison {params.comparison:q} {params.server_metrics} {params.evaluation}"
        " > {log:q} 2>&1"
