# Config and sample sheet: validated once at parse time, before any job is planned or submitted.
# Everything here is linear in the number of samples: one pass over the sheet, dict look-ups
# in the per-job functions (a 1,000-sample sheet must not cost more than ~10x a 100-sample one).

import hashlib
import os
import re
import shlex
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.logging import logger
from snakemake.utils import validate

# `agent` imports from any working directory: it is installed (scripts/setup.sh), and Snakemake
# puts the main Snakefile's folder on sys.path.
from agent.endpoint import EndpointError, read_api_key
from agent.record.layout import SampleLayout
from agent.record.lock import holder_of
from agent.resume import publish_unless_held
from agent.samplesheet import SampleSheetError, load_sheet

# Paths of this workflow's own files come from this file's folder (workflow.current_basedir), not
# workflow.basedir: imported as a `module`, the latter is the importing Snakefile's folder.
_BASEDIR = workflow.current_basedir.get_path_or_uri(secret_free=True)
# the repository, where it is a folder here; None for a remote source (git+file://, https://)
WORKFLOW_ROOT = None if "://" in _BASEDIR else Path(_BASEDIR).parents[1]
SAMPLE_SCHEMA = Path(workflow.source_path("../schemas/samples.schema.yaml"))
# A sample's folder; its files' names come from agent/record/layout.py.
SAMPLE = SampleLayout("results/samples/{sample}")

validate(config, "../schemas/config.schema.yaml")

SERVER = config["server"]
ENDPOINT = "results/servers/{shard}.json"  # serve_vllm's service output, read by its agents
EVAL_SHARD = "eval"  # serve_vllm's shard of the model's evaluation (eval.smk): one client
# Shared folders as absolute paths: every job, on whatever node and in whatever container working
# directory, must name the same one (the HF cache the weights are in, the one compile cache).
HF_HOME = os.path.abspath(SERVER["hf_home"]) if SERVER["hf_home"] else ""
COMPILE_CACHE = os.path.abspath(SERVER["cache_dir"]) if SERVER["cache_dir"] else ""
DEMO_DIR = Path(os.path.normpath(config["demo"]["dir"]))


# ---- software: the workflow's own `agent` package and images, wherever the workflow is used ----


def image(name):
    """The Apptainer image of the rules of envs/NAME.def: config containers.NAME (a path from the
    working directory, or a URI such as oras:// or docker://), else NAME.sif built beside its
    definition in this workflow's own folder (not the working directory: used as a module, the
    two differ); a remote source has no folder, so there it is envs/NAME.sif in the working
    directory."""
    given = config["containers"][name]
    if given:
        return given
    return str(WORKFLOW_ROOT / "envs" / f"{name}.sif") if WORKFLOW_ROOT else f"envs/{name}.sif"


AGENT_IMAGE = image("agent")
VLLM_IMAGE = image("vllm")


def job_environment():
    """Environment the jobs inherit (set in this process: a job, also a Slurm one, runs its own
    Snakemake, which parses this file again). PYTHONPATH: the repository of a local source first,
    so a job's `python -m agent` runs this workflow's own package from any working directory, in a
    conda env (which holds the dependencies) or an image (which also installs the package: the
    one a remote source uses). APPTAINER_BIND: the folders outside the working directory (which
    Snakemake mounts) that jobs read or write: the repository, server.hf_home, server.cache_dir
    and the inputs' folders (a missing one's parent: apptainer refuses a missing source)."""
    env = {}
    if WORKFLOW_ROOT:  # first, before an installed copy (a job inherits the value: no repeats)
        paths = [str(WORKFLOW_ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(filter(None, paths)))
    here = os.getcwd()
    folders = [str(WORKFLOW_ROOT or ""), HF_HOME, COMPILE_CACHE]
    for s in SAMPLES.values():
        paths = (s["path"], s.get("celltypist_model"), s.get("raw_input"))
        folders += [os.path.abspath(p) for p in paths if p]
    if config["cohort_integration"]["celltypist_model"]:  # the integrate_cohort job reads it
        folders.append(os.path.abspath(config["cohort_integration"]["celltypist_model"]))
    binds = []
    for folder in folders:
        folder = folder if os.path.isdir(folder) else os.path.dirname(folder)
        inside = [f for f in (here, *binds) if folder == f or folder.startswith(f + os.sep)]
        if folder and os.path.isdir(folder) and not inside:
            binds.append(folder)
    if binds:  # after a site's own; Apptainer reads APPTAINER_BIND, SingularityCE SINGULARITY_BIND
        given = [b for b in os.environ.get("APPTAINER_BIND", "").split(",") if b]
        env["APPTAINER_BIND"] = env["SINGULARITY_BIND"] = ",".join(dict.fromkeys(given + binds))
    return env


def demo_sample_of(path):
    """The demo sample NAME when `path` is DEMO_DIR/NAME (a 10x folder) or lies under it."""
    path = os.path.normpath(path)
    prefix = f"{DEMO_DIR}{os.sep}"
    return path[len(prefix) :].split(os.sep)[0] if path.startswith(prefix) else None


def resolve_samples(rows):
    """Each sample's settings: its own cells over config's defaults (analysis, resources)."""
    defaults = {**config["analysis"], **config["resources"]["analyze"]}
    return {row["sample"]: {**defaults, **row} for row in rows}


def assign_shards(samples, per_server):
    """llm samples, in sheet order, in groups of `per_server`: one model server per group."""
    llm = [name for name, s in samples.items() if s["policy"] == "llm"]
    shards = {}
    for k in range(0, len(llm), per_server):
        shards[f"shard{k // per_server:03d}"] = llm[k : k + per_server]
    return shards


def check_server_mode(sheet, samples):
    """The llm policy needs a server: vllm (made here) or external (given in config)."""
    mode = SERVER["mode"]
    rows = sheet.rows
    llm = [i for i, row in enumerate(rows) if samples[row["sample"]]["policy"] == "llm"]
    if mode == "none" and llm:
        problem = (
            f"policy 'llm' needs a model server but config server.mode is 'none' ({len(llm)} llm "
            "sample(s)); set server.mode to 'vllm' or 'external', or the policy to 'reference'"
        )
        first = llm[0]
        if "policy" in rows[first]:
            raise sheet.error(first, "policy", problem)
        raise WorkflowError(f"config analysis.policy: {problem}")
    if mode == "external":
        for key in ("base_url", "api_key_file"):
            if not SERVER[key]:
                raise WorkflowError(
                    f"config server.{key} is required when server.mode is 'external'"
                )
        try:  # the agents' own check (owner-only, not empty), before any job is submitted
            read_api_key(SERVER["api_key_file"])
        except EndpointError as err:
            raise WorkflowError(f"config server.api_key_file: {err}") from None


def load_samples(path):
    try:
        sheet = load_sheet(
            path,
            made_by_workflow=lambda p: demo_sample_of(p) is not None,
            hint=f"; paths under {DEMO_DIR}/NAME/ are generated by the demo_data rule",
            schema=SAMPLE_SCHEMA,
            # the sheet columns config names for the cohort's conditions (cohort.smk)
            extra_columns=[
                c for c in (config["conditions"]["column"], config["conditions"]["group_by"]) if c
            ],
        )
        samples = resolve_samples(sheet.rows)
        check_server_mode(sheet, samples)
    except SampleSheetError as err:
        raise WorkflowError(str(err)) from None
    if workflow.is_main_process:  # once, not again in each job that parses the workflow
        for warning in sheet.warnings:
            logger.warning(warning)
    return samples


SAMPLES = load_samples(Path(config["samples"]))
SHARDS = assign_shards(SAMPLES, SERVER["samples_per_server"]) if SERVER["mode"] == "vllm" else {}
SHARD_OF = {name: shard for shard, members in SHARDS.items() for name in members}
os.environ.update(job_environment())


# ---- functions the rules call (one dict look-up per job) ----


# Memory and runtime grow with each attempt (the profile's `retries`): a job killed for either
# would fail again with the same amount. A job alone doubles them per attempt. A server's group
# (the server and its shard's agents, one allocation whose request is their sum) grows by a
# quarter per attempt: doubled, the cluster example's 192 GB / 12 h would ask 384 GB / 24 h, more
# than most GPU nodes or partitions grant, and the retry would never start.
GROWING = ("mem_mb", "runtime")
GROWTH = 1.0
GROUP_GROWTH = 0.25


def grown(value, attempt, growth):
    """`value` on the first attempt, then `growth` times it more per later attempt."""
    return int(value * (1 + growth * (attempt - 1)))


def per_attempt(value, growth=GROWTH):
    return lambda wildcards, attempt: grown(value, attempt, growth)


def job_resources(spec, growth=GROWTH):
    """Resources from a config entry; an empty partition is left to the profile's default."""
    return {
        key: per_attempt(value, growth) if key in GROWING else value
        for key, value in spec.items()
        if key != "slurm_partition" or value
    }


def rule_resources(rule_name):
    return job_resources(config["resources"][rule_name])


def server_resources():
    """GPUs as `gres` when a typed string is configured, else Snakemake's `gpu` resource; one
    node and one task: vLLM runs its tensor-parallel workers itself on the node's GPUs, and the
    Slurm plugin's default for a GPU job (`--ntasks-per-gpu=1`, no `--nodes`) would let N GPUs
    become N tasks spread over nodes (tasks_per_gpu 0 drops that flag)."""
    gpus = {"gres": SERVER["gres"]} if SERVER["gres"] else {"gpu": SERVER["gpus"]}
    return {
        **job_resources(SERVER["resources"], GROUP_GROWTH),
        **gpus,
        "nodes": 1,
        "tasks_per_gpu": 0,
    }


def sample_value(key):
    """A per-sample setting as an input function (sheet cell, else the config default); the
    value itself when every sample has the same one. Snakemake calls a function once or more
    per job, and inspects its signature on every call: at 10,000 samples each function per job
    costs about half a second of `snakemake -n`."""
    values = {s[key] for s in SAMPLES.values()}
    if len(values) == 1:
        return values.pop()
    return lambda wildcards: SAMPLES[wildcards.sample][key]


def sample_per_attempt(key):
    """A per-sample resource, grown with the attempt (see GROWING): by a quarter inside a
    server's group, else doubled."""

    def value(wildcards, attempt):
        growth = GROUP_GROWTH if wildcards.sample in SHARD_OF else GROWTH
        return grown(SAMPLES[wildcards.sample][key], attempt, growth)

    return value


def analyze_partition():
    """A shard's agents share its server's allocation, so they must name its partition.

    Only set when config names a partition: otherwise the profile's default applies to every
    job alike. A callable's None drops the key (then the cluster's default partition is used).
    """
    server_partition = SERVER["resources"]["slurm_partition"] or None
    if not (server_partition or config["resources"]["analyze"]["slurm_partition"]):
        return {}

    def partition(wildcards):
        if wildcards.sample in SHARD_OF:
            return server_partition
        return SAMPLES[wildcards.sample]["slurm_partition"] or None

    return {"slurm_partition": partition}


def input_data(wildcards):
    """The sample's input; for a demo sample, the truth file its generator writes last."""
    path = SAMPLES[wildcards.sample]["path"]
    demo = demo_sample_of(path)
    return str(DEMO_DIR / demo / "truth.tsv") if demo else path


def no_other_writer():
    """Stops the workflow before any job (so before Snakemake deletes any job's outputs) when a
    sample folder is being written by another run, e.g. a second workflow on the same results
    folder: a folder another workflow's agent writes is not this workflow's to clean. Called at
    start (`onstart`, never on a dry run or `--report`): one look per sample, not per DAG build."""
    for sample in SAMPLES:
        folder = str(SAMPLE.root).format(sample=sample)
        if holder := holder_of(SampleLayout(folder).lock):
            raise WorkflowError(
                f"{folder} is being written by another run ({holder}), e.g. a second workflow "
                "on the same results folder: one results folder per workflow; wait for that run "
                "to end (or stop it), then run this again"
            )


def publish_kept():
    """Every finished sample's published files (record, metrics, plots, final object) linked
    again from their copies beside the checkpoints where they are gone, e.g. deleted by Snakemake
    with a job it failed after the agent ended: on every run, at parse time in the main process
    (also a dry run), before Snakemake decides what to run; it may decide nothing, and then no
    agent publishes them. Only analyses that ended with their result (a failed one stays gone,
    so that its job reruns); a folder another run writes is left to it."""
    for sample in SAMPLES:
        folder = str(SAMPLE.root).format(sample=sample)
        try:
            publish_unless_held(SampleLayout(folder))
        except OSError as e:
            raise WorkflowError(f"{folder}: cannot publish its kept outputs again: {e}")


def analyze_input(wildcards):
    inputs = {"data": input_data(wildcards)}
    if SAMPLES[wildcards.sample]["celltypist_model"]:  # a changed model reruns the sample
        inputs["celltypist_model"] = SAMPLES[wildcards.sample]["celltypist_model"]
    if SAMPLES[wildcards.sample].get("raw_input"):  # so does a changed unfiltered matrix
        inputs["raw_input"] = SAMPLES[wildcards.sample]["raw_input"]
    if wildcards.sample in SHARD_OF:
        inputs["endpoint"] = ENDPOINT.format(shard=SHARD_OF[wildcards.sample])
    if EVAL_REQUIRED and SAMPLES[wildcards.sample]["policy"] == "llm":
        # the gate of eval_min_score; ancient: a newer evaluation that passes redoes nothing
        inputs["evaluation"] = ancient(EVAL_PASSED)
    return inputs


def analyze_group(wildcards):
    shard = SHARD_OF.get(wildcards.sample)
    return f"server_{shard}" if shard else None


# Without shards (server.mode none or external) no job is grouped and none waits for a server:
# analyze gets the constants (no group; ":", no wait) instead of functions called per job
# (a group function returning None is even called again on each access).
ANALYZE_GROUP = analyze_group if SHARD_OF else None


def analyze_args(wildcards):
    """The `agent run` options that vary per sample, shell-quoted."""
    s = SAMPLES[wildcards.sample]
    args = ["--input", s["path"], "--sample", wildcards.sample, "--policy", s["policy"]]
    # A job Snakemake reruns keeps the sample's finished analysis when nothing it depends on
    # changed (e.g. its server restarted for another sample), and redoes it (the old one moved to
    # previous/) when the sheet or the input changed.
    args += ["--replace-changed"]
    args += ["--seed", str(s["seed"]), "--max-steps", str(s["max_steps"])]
    if s["brief"]:
        args += [f"--brief={s['brief']}"]  # one word: a brief may start with "--"
    for column in ("layer", "gene_symbols"):  # optional sheet columns, no config default
        if s.get(column):
            args += [f"--{column.replace('_', '-')}", s[column]]
    if s["celltypist_model"]:
        args += ["--celltypist-model", s["celltypist_model"]]
    args += ["--doublets", s["doublets"]]
    if s.get("raw_input"):  # optional sheet column, no config default
        args += ["--raw-input", s["raw_input"]]
    if s["policy"] == "llm":
        args += ["--outage-wait", str(SERVER["outage_wait"])]
        args += model_options(SHARD_OF.get(wildcards.sample))
    return shlex.join(args)


def model_options(shard):
    """The options of `agent run` and `agent eval` that name the model and how it thinks: the
    endpoint file of `shard`'s server (vllm mode) or the external server."""
    args = []
    if not SERVER["thinking"]:
        args += ["--no-thinking"]
    if SERVER.get("thinking_budget") is not None:  # null: the model family's budget
        args += ["--thinking-budget", str(SERVER["thinking_budget"])]
    if SERVER["mode"] == "vllm":
        args += ["--endpoint-file", ENDPOINT.format(shard=shard)]
    elif SERVER["mode"] == "external":
        args += ["--base-url", SERVER["base_url"], "--model", SERVER["model"]]
        args += ["--api-key-file", SERVER["api_key_file"]]
    return args


def wait_for_server(wildcards):
    """Shell that waits for the shard's endpoint file (":" for a sample without one)."""
    shard = SHARD_OF.get(wildcards.sample)
    return wait_for_endpoint(shard) if shard else ":"


def wait_for_endpoint(shard):
    """Shell that waits for `shard`'s endpoint file: a service's consumers start with it, and
    the server writes the file only once it is healthy."""
    path = ENDPOINT.format(shard=shard)  # only [A-Za-z0-9_./]: safe inside the quotes below
    return (
        f"timeout {SERVER['timeout']} bash -c 'until test -s {path}; do sleep 2; done' "
        f"|| {{ echo 'no healthy server: {path} missing after {SERVER['timeout']} s' >&2; exit 1; }}"
    )


WAIT_FOR_SERVER = wait_for_server if SHARD_OF else ":"


def serve_args(wildcards):
    """The job's shard's `agent serve` options."""
    return serve_options(wildcards.shard)


def serve_options(shard):
    """The `agent serve` options of one shard, shell-quoted."""
    agents = 1 if shard == EVAL_SHARD else len(SHARDS[shard])
    args = ["--model", SERVER["model"], "--revision", SERVER["revision"]]
    args += ["--gpus", str(SERVER["gpus"])]
    args += ["--agents", str(agents), "--gpu", SERVER["gpu"]]
    args += ["--timeout", str(SERVER["timeout"])]
    if SERVER["max_model_len"]:
        args += ["--max-model-len", str(SERVER["max_model_len"])]
    if COMPILE_CACHE:  # every shard's server compiles into, and later ones start from, one folder
        args += ["--cache-dir", COMPILE_CACHE]
    return shlex.join(args)


def server_environment():
    """`env` assignments of a server job, shell-quoted: the Hugging Face cache it reads, offline
    (compute nodes may have no internet: a model missing from the cache fails at once, naming
    the cache and the command that fills it, instead of starting a download per shard)."""
    return shlex.join([*([f"HF_HOME={HF_HOME}"] if HF_HOME else []), "HF_HUB_OFFLINE=1"])


# ---- the model's weights (fetch_model) ----


def model_is_a_folder():
    """server.model names a folder (used as it is) rather than a Hub id (looked up in the cache)."""
    return os.path.isdir(SERVER["model"])


def fetched_marker():
    """fetch_model's output: which snapshot of server.model at server.revision it put where."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{SERVER['model']}@{SERVER['revision']}")
    return f"results/models/{name}.json"


# With server.fetch, a server starts only once fetch_model has filled the cache.
SERVE_INPUTS = {"weights": fetched_marker()} if SERVER["fetch"] else {}


if SERVER["fetch"] and SERVER["mode"] == "vllm" and model_is_a_folder():
    raise WorkflowError(
        f"config server.fetch: server.model {SERVER['model']!r} is a folder, which has nothing "
        "to fetch; set server.fetch to false, or server.model to a Hugging Face Hub id"
    )


# ---- the model's evaluation (eval.smk) ----

EVAL = config["eval"]
EVAL_DIR = "results/eval"
EVAL_JSON = f"{EVAL_DIR}/eval.json"
EVAL_HTML = f"{EVAL_DIR}/eval.html"
# written when the evaluation reached eval.min_score; the llm samples' analyses need it
EVAL_PASSED = f"{EVAL_DIR}/min_score.json"
EVAL_REQUIRED = EVAL["min_score"] is not None and any(
    s["policy"] == "llm" for s in SAMPLES.values()
)


def eval_input(wildcards):
    """The eval server's endpoint file (vllm mode). Without a server there is nothing to
    evaluate: said when an evaluation is asked for (a cohort of the reference policy needs none)."""
    if SERVER["mode"] == "none":
        raise WorkflowError(
            "eval_model: config server.mode is 'none', so there is no model to evaluate; set "
            "server.mode to 'vllm' (the workflow serves server.model) or 'external'"
        )
    return {"endpoint": ENDPOINT.format(shard=EVAL_SHARD)} if SERVER["mode"] == "vllm" else {}


def eval_args():
    """`agent eval`'s options, shell-quoted: the cases, and the model, seed and step limit as
    the cohort's analyses get them."""
    args = ["--seed", str(config["analysis"]["seed"])]
    args += ["--max-steps", str(config["analysis"]["max_steps"])]
    if EVAL["cases"]:  # null: every case
        args += ["--cases", ",".join(EVAL["cases"])]
    args += ["--end-to-end", ",".join(EVAL["end_to_end"]) or "none"]
    return shlex.join(args + model_options(EVAL_SHARD))


def eval_resources():
    """resources.eval; in vllm mode in the server's partition and grown as its group."""
    if SERVER["mode"] != "vllm":
        return rule_resources("eval")
    spec = {
        **config["resources"]["eval"],
        "slurm_partition": SERVER["resources"]["slurm_partition"],
    }
    return job_resources(spec, GROUP_GROWTH)


def eval_for_report():
    """The report's `--eval` option and what reruns the report for it. With eval.min_score the
    evaluation is an input (it is part of the run anyway). Otherwise it is not: as an input, any
    change of the eval rule (its config, the workflow's code) would start a model server for the
    report's sake; an existing one is passed by path, with its sha256 as a param, so that a new
    evaluation (`snakemake eval_model`) redoes the report."""
    if EVAL_REQUIRED:
        return {"evaluation": EVAL_JSON}, f"--eval {EVAL_JSON}", ""
    if not os.path.isfile(EVAL_JSON):
        return {}, "", ""
    digest = hashlib.sha256(Path(EVAL_JSON).read_bytes()).hexdigest()
    return {}, f"--eval {EVAL_JSON}", digest


EVAL_REPORT_INPUT, EVAL_REPORT_OPTION, EVAL_REPORT_SHA256 = eval_for_report()
