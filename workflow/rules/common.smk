# Config and sample sheet: validated once at parse time, before any job is planned or submitted.
# Everything here is linear in the number of samples: one pass over the sheet, dict look-ups
# in the per-job functions (a 1,000-sample sheet must not cost more than ~10x a 100-sample one).

import csv
import os
import shlex
from pathlib import Path

import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

SAMPLE_SCHEMA = Path(workflow.basedir) / "workflow" / "schemas" / "samples.schema.yaml"

validate(config, "../schemas/config.schema.yaml")

SERVER = config["server"]
ENDPOINT = "results/servers/{shard}.json"  # serve_vllm's service output, read by its agents
DEMO_DIR = Path(os.path.normpath(config["demo"]["dir"]))


def sheet_error(sheet, line, sample, field, message):
    """A parse-time error that names the sheet, its line, the sample and the column."""
    where = f"{sheet}, line {line}"
    if sample:
        where += f" (sample {sample!r})"
    if field:
        where += f", column {field!r}"
    return WorkflowError(f"sample sheet {where}: {message}")


def read_sheet(sheet, schema):
    """Read the TSV into rows of non-empty cells, checking the columns against the schema.

    Integer columns are converted here so that the schema judges values, not spellings;
    a cell that is no number is reported with its line. Returns (rows, line numbers).
    """
    if not sheet.is_file():
        raise WorkflowError(f"sample sheet {sheet} does not exist (config key 'samples')")
    columns = schema["properties"]
    integer_columns = {name for name, spec in columns.items() if spec.get("type") == "integer"}
    with sheet.open(newline="") as handle:
        reader = csv.reader(handle, delimiter="\t")
        header = [cell.strip() for cell in next(reader, [])]
        missing = [name for name in schema["required"] if name not in header]
        if missing:
            raise sheet_error(
                sheet, 1, None, missing[0],
                f"missing column (header has {header}; required: {schema['required']})",
            )
        unknown = [name for name in header if name not in columns]
        if unknown:
            raise sheet_error(
                sheet, 1, None, unknown[0], f"unknown column (allowed: {sorted(columns)})"
            )
        if len(set(header)) != len(header):
            raise sheet_error(sheet, 1, None, None, f"repeated column name in {header}")
        rows, lines = [], []
        for cells in reader:
            if not any(cell.strip() for cell in cells):
                continue
            line = reader.line_num
            if len(cells) != len(header):
                raise sheet_error(
                    sheet, line, None, None,
                    f"{len(cells)} tab-separated cells, the header has {len(header)}",
                )
            row = {name: cell.strip() for name, cell in zip(header, cells) if cell.strip()}
            for name in integer_columns & row.keys():
                try:
                    row[name] = int(row[name])
                except ValueError:
                    raise sheet_error(
                        sheet, line, row.get("sample"), name,
                        f"expected a whole number, got {row[name]!r}",
                    ) from None
            rows.append(row)
            lines.append(line)
    if not rows:
        raise WorkflowError(f"sample sheet {sheet} has no samples")
    return rows, lines


def validate_rows(sheet, rows, lines):
    """Validate every row against the schema with snakemake's validate; name row and column."""
    import jsonschema
    import pandas as pd

    try:
        # object dtype: whole numbers stay ints (a column with gaps would turn float)
        frame = pd.DataFrame(rows, dtype=object)
        validate(frame, "../schemas/samples.schema.yaml", set_default=False)
    except WorkflowError as err:
        # validate() names the row index in its message and chains the jsonschema error
        cause = err.__context__
        index = next((i for i, word in enumerate(str(err).split()) if word == "row"), None)
        if not isinstance(cause, jsonschema.ValidationError) or index is None:
            raise WorkflowError(f"sample sheet {sheet}: {err}") from err
        i = int(str(err).split()[index + 1])
        field = cause.path[0] if cause.path else None
        message = cause.message
        if cause.validator == "required":
            field = message.split("'")[1]
            message = "empty cell, a value is required"
        raise sheet_error(sheet, lines[i], rows[i].get("sample"), field, message) from None


def check_samples(sheet, rows, lines):
    """Sheet-level rules the schema cannot state: unique names, inputs that exist or are made."""
    first_line = {}
    for row, line in zip(rows, lines):
        name = row["sample"]
        if name in first_line:
            raise sheet_error(
                sheet, line, name, "sample", f"duplicate sample (first on line {first_line[name]})"
            )
        first_line[name] = line
        path = row["path"]
        if demo_sample_of(path) is None and not os.path.exists(path):
            raise sheet_error(
                sheet, line, name, "path",
                f"{path!r} does not exist (relative paths are from {Path.cwd()}; paths under "
                f"{DEMO_DIR}/NAME/ are generated by the demo_data rule)",
            )


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


def check_server_mode(sheet, samples, rows, lines):
    """The llm policy needs a server: vllm (made here) or external (given in config)."""
    mode = SERVER["mode"]
    llm = [i for i, row in enumerate(rows) if samples[row["sample"]]["policy"] == "llm"]
    if mode == "none" and llm:
        problem = (
            f"policy 'llm' needs a model server but config server.mode is 'none' ({len(llm)} llm "
            "sample(s)); set server.mode to 'vllm' or 'external', or the policy to 'reference'"
        )
        first = llm[0]
        if "policy" in rows[first]:
            raise sheet_error(sheet, lines[first], rows[first]["sample"], "policy", problem)
        raise WorkflowError(f"config analysis.policy: {problem}")
    if mode == "external":
        for key in ("base_url", "api_key_file"):
            if not SERVER[key]:
                raise WorkflowError(f"config server.{key} is required when server.mode is 'external'")
        if not os.path.isfile(SERVER["api_key_file"]):
            raise WorkflowError(
                f"config server.api_key_file: {SERVER['api_key_file']!r} is not a file"
            )


def load_samples(sheet):
    with SAMPLE_SCHEMA.open() as handle:
        schema = yaml.safe_load(handle)
    rows, lines = read_sheet(sheet, schema)
    validate_rows(sheet, rows, lines)
    check_samples(sheet, rows, lines)
    samples = resolve_samples(rows)
    check_server_mode(sheet, samples, rows, lines)
    return samples


SAMPLES = load_samples(Path(config["samples"]))
SHARDS = assign_shards(SAMPLES, SERVER["samples_per_server"]) if SERVER["mode"] == "vllm" else {}
SHARD_OF = {name: shard for shard, members in SHARDS.items() for name in members}


# ---- functions the rules call (one dict look-up per job) ----


def job_resources(spec):
    """Resources from a config entry; an empty partition is left to the profile's default."""
    return {key: value for key, value in spec.items() if key != "slurm_partition" or value}


def rule_resources(rule_name):
    return job_resources(config["resources"][rule_name])


def server_resources():
    """GPUs as `gres` when a typed string is configured, else Snakemake's `gpu` resource."""
    gpus = {"gres": SERVER["gres"]} if SERVER["gres"] else {"gpu": SERVER["gpus"]}
    return {**job_resources(SERVER["resources"]), **gpus}


def sample_value(key):
    """A per-sample setting as an input function (sheet cell, else the config default)."""
    return lambda wildcards: SAMPLES[wildcards.sample][key]


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


def analyze_input(wildcards):
    inputs = {"data": input_data(wildcards)}
    if wildcards.sample in SHARD_OF:
        inputs["endpoint"] = ENDPOINT.format(shard=SHARD_OF[wildcards.sample])
    return inputs


def analyze_group(wildcards):
    shard = SHARD_OF.get(wildcards.sample)
    return f"server_{shard}" if shard else None


def analyze_args(wildcards):
    """The `agent run` options that vary per sample, shell-quoted."""
    s = SAMPLES[wildcards.sample]
    args = ["--input", s["path"], "--sample", wildcards.sample, "--policy", s["policy"]]
    args += ["--seed", str(s["seed"]), "--max-steps", str(s["max_steps"])]
    if s["brief"]:
        args += ["--brief", s["brief"]]
    if s["policy"] == "llm":
        args += ["--outage-wait", str(SERVER["outage_wait"])]
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


def serve_args(wildcards):
    """The `agent serve` options of one shard, shell-quoted."""
    args = ["--model", SERVER["model"], "--gpus", str(SERVER["gpus"])]
    args += ["--agents", str(len(SHARDS[wildcards.shard])), "--gpu", SERVER["gpu"]]
    args += ["--timeout", str(SERVER["timeout"])]
    if SERVER["max_model_len"]:
        args += ["--max-model-len", str(SERVER["max_model_len"])]
    return shlex.join(args)
