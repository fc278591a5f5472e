# One vLLM server per shard of llm samples (server.mode: vllm). Its endpoint file is a service
# output: the shard's analyze jobs run beside it in one group (one Slurm allocation), and
# Snakemake stops the server once they have all finished. It is also temporary: once the shard's
# analyses are done the file is gone, and since nothing then needs it, a later run starts no
# server for a finished shard (a missing file that no job to be run needs is not remade).
#
# Its launcher samples the server's figures into SHARD.metrics.jsonl beside the endpoint file
# (agent/serve/metrics.py), for the report's performance section: not an output, since a service
# job must not fail for a file it could not write (a server that never served writes none).

from agent.serve.metrics import metrics_path

SERVER_METRICS = [str(metrics_path(Path(ENDPOINT.format(shard=shard)))) for shard in SHARDS]


rule serve_vllm:
    """Start a vLLM server for one shard; it writes the endpoint file only once healthy."""
    input:
        **SERVE_INPUTS,
    output:
        endpoint=temp(service(ENDPOINT)),
    log:
        "logs/serve_vllm/{shard}.log",
    benchmark:
        "benchmarks/serve_vllm/{shard}.tsv"
    params:
        command=SERVER["command"],
        args=serve_args,
        env=server_environment(),
    resources:
        **server_resources(),
    threads: 1
    group:
        "server_{shard}"
    conda:
        "../../envs/vllm.yaml"
    container:
        VLLM_IMAGE
    shell:
        # exec: the server itself receives Snakemake's SIGTERM at the end, not a wrapping shell
        "exec env {params.env} {params.command} --endpoint-file {output.endpoint:q} {params.args} "
        "> {log:q} 2>&1"


# The weights come from the Hugging Face cache (server.hf_home, else the environment's HF_HOME);
# the servers only read it (offline). This fills it, where there is internet: a login node, since
# it is a localrule (the main Snakemake process runs it). Asked for by name (`snakemake
# fetch_model`), or before the first server when config server.fetch is true. Its output says
# which snapshot (commit) of server.model at server.revision it put where.


rule fetch_model:
    """Download server.model at server.revision into the Hugging Face cache (login node)."""
    localrule: True  # needs the internet, which compute nodes may not have; kept under a module prefix
    output:
        fetched_marker(),
    log:
        "logs/fetch_model.log",
    params:
        model=SERVER["model"],
        revision=SERVER["revision"],
        hf_home=HF_HOME,
    conda:
        "../../envs/vllm.yaml"
    container:
        VLLM_IMAGE
    script:
        "../scripts/fetch_model.py"
