# The demo cohort: generated on demand when the sample sheet points under config demo.dir.


rule demo_data:
    """Write one synthetic demo sample (data and truth.tsv) with `agent synth`."""
    output:
        truth=f"{DEMO_DIR}/{{name}}/truth.tsv",
    log:
        "logs/demo_data/{name}.log",
    params:
        outdir=lambda wildcards, output: Path(output.truth).parent,
    resources:
        **rule_resources("demo_data"),
    threads: 1
    conda:
        "../../envs/agent.yaml"
    container:
        AGENT_IMAGE
    shell:
        "python -m agent synth --outdir {params.outdir:q} --sample {wildcards.name:q} > {log:q} 2>&1"
