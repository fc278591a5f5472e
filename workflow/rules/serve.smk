# One vLLM server per shard of llm samples (server.mode: vllm). Its endpoint file is a service
# output: the shard's analyze jobs run beside it in one group (one Slurm allocation), and
# Snakemake stops the server once they have all finished. It is also temporary: once the shard's
# analyses are done the file is gone, and since nothing then needs it, a later run starts no
# server for a finished shard (a missing file that no job to be run needs is not remade).


rule serve_vllm:
    """Start a vLLM server for one shard; it writes the endpoint file only once healthy."""
    output:
        endpoint=temp(service(ENDPOINT)),
    log:
        "logs/serve_vllm/{shard}.log",
    benchmark:
        "benchmarks/serve_vllm/{shard}.tsv"
    params:
        command=SERVER["command"],
        args=serve_args,
    resources:
        **server_resources(),
    threads: 1
    group:
        "server_{shard}"
    conda:
        "../../envs/vllm.yaml"
    container: "envs/vllm.sif"
    shell:
        # exec: the server itself receives Snakemake's SIGTERM at the end, not a wrapping shell
        "exec {params.command} --endpoint-file {output.endpoint:q} {params.args} > {log:q} 2>&1"
