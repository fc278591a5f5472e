# `snakemake` from the repository root runs the workflow, whose main Snakefile is
# workflow/Snakefile (the layout the Snakemake workflow catalog and snakedeploy expect). The
# `include:` directive never takes an included file's default target, so the call keeps its
# `rule all` the default here too.

workflow.include("workflow/Snakefile", overwrite_default_target=True)
