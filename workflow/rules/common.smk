# Config and sample sheet: validated once at parse time, before any job is planned or submitted.
# Everything here is linear in the number of samples: one pass over the sheet, dict look-ups
# in the per-job functions (a 1,000-sample sheet must not cost more than ~10x a 100-sample one).

import os
import re
import shlex
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

# `agent` imports from any working directory: it is installed (scripts/setup.sh), and Snakemake
# puts the main Snakefile's folder on sys.path.
from agent.endpoint import EndpointError, read_api_key
from agent.layout import SampleLayout
from agent.lock import holder_of
from agent.samplesheet import SampleSheetError, load_sheet

# Paths of this workflow's own files come from this file's folder (workflow.current_basedir), not
# workflow.basedir: imported as a `module`, the latter is the importing Snakefile's folder.
_BASEDIR = workflow.current_basedir.get_path_or_uri(secret_free=True)
# the repository, where it is a folder here; None for a remote source (git+file://, https://)
WORKFLOW_ROOT = None if "://" in _BASEDIR else Path(_BASEDIR).parents[1]
SAMPLE_SCHEMA = Path(workflow.source_path("../schemas/samples.schema.yaml"))
# A sample's folder; its files' names come from agent/layout.py.
SAMPLE = SampleLayout("results/samples/{sample}")

validate(config, "../schemas/config.schema.yaml")

SERVER = config["server"]
ENDPOINT = "results/servers/{shard}.json"  # serve_vllm's service output, read by its agents
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
        folders += [os.path.abspath(p) for p in (s["path"], s.get("celltypist_model")) if p]
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
        )
        samples = resolve_samples(sheet.rows)
        check_server_mode(sheet, samples)
    except SampleSheetError as err:
        raise WorkflowError(str(err)) from None
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


def analyze_input(wildcards):
    inputs = {"data": input_data(wildcards)}
    if SAMPLES[wildcards.sample]["celltypist_model"]:  # a changed model reruns the sample
        inputs["celltypist_model"] = SAMPLES[wildcards.sample]["celltypist_model"]
    if wildcards.sample in SHARD_OF:
        inputs["endpoint"] = ENDPOINT.format(shard=SHARD_OF[wildcards.sample])
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
    if s["policy"] == "llm":
        args += ["--outage-wait", str(SERVER["outage_wait"])]
        if not SERVER["thinking"]:
            args += ["--no-thinking"]
        if SERVER.get("thinking_budget") is not None:  # null: the model family's budget
            args += ["--thinking-budget", str(SERVER["thinking_budget"])]
    if s["policy"] == "llm" and SERVER["mode"] == "vllm":
        args += ["--endpoint-file", ENDPOINT.format(shard=SHARD_OF[wildcards.sample])]
    elif s["policy"] == "llm" and SERVER["mode"] == "external":
        args += ["--base-url", SERVER["base_url"], "--model", SERVER["model"]]
        args += ["--api-key-file", SERVER["api_key_file"]]
    return shlex.join(args)


def wait_for_server(wildcards):
    """Shell that waits for the shard's endpoint file: a service's consumers start with it,
    and the server writes the file only once it is healthy."""
    shard = SHARD_OF.get(wildcards.sample)
    if shard is None:
        return ":"
    path = ENDPOINT.format(shard=shard)  # only [A-Za-z0-9_./]: safe inside the quotes below
    return (
        f"timeout {SERVER['timeout']} bash -c 'until test -s {path}; do sleep 2; done' "
        f"|| {{ echo 'no healthy server: {path} missing after {SERVER['timeout']} s' >&2; exit 1; }}"
    )


WAIT_FOR_SERVER = wait_for_server if SHARD_OF else ":"


def serve_args(wildcards):
    """The `agent serve` options of one shard, shell-quoted."""
    args = ["--model", SERVER["model"], "--revision", SERVER["revision"]]
    args += ["--gpus", str(SERVER["gpus"])]
    args += ["--agents", str(len(SHARDS[wildcards.shard])), "--gpu", SERVER["gpu"]]
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
