"""`moe-tune validate` and `moe-tune schema`: check a profile and its data, print the schema."""

from __future__ import annotations

import json
from typing import Annotated

import typer
import yaml

from moe_tune.profiles import bounded_line, escape_unprintable, resolve_profile_path
from moe_tune.profiles.schema import ignored_setting_notes

from ._common import ProfileArg, SetOption, err_console, fail, read_profile, user_errors

app = typer.Typer()


NoDataOption = Annotated[
    bool, typer.Option("--no-data", help="check the profile only; do not read the data (large datasets)")
]


ShowOption = Annotated[int, typer.Option(
    "--show", min=0, metavar="N",
    help="also print the first N training documents as the model reads them, the trained tokens between \u27e6 \u27e7",
)]  # fmt: skip


@app.command()
def validate(profile: ProfileArg, overrides: SetOption = None, no_data: NoDataOption = False,
             show: ShowOption = 0) -> None:  # fmt: skip
    """Check a profile and print it resolved (defaults filled in) on stdout; then read its data as finetune would and
    report it on stderr (records, tokens, trained tokens per source, the optimizer steps, with --show the first
    documents and what they train); exit 2 listing every problem."""
    if no_data and show:
        fail([f"--show ({show}) reads the data, which --no-data skips: give one"])
    job = read_profile(profile, overrides)
    from moe_tune.engine.plan import count_parameters
    from moe_tune.engine.train.trainer import check_chunked_expert_adapters
    from moe_tune.engine.train.run_dir import check_reads_apart, output_dir_problems, previous_run_outputs, run_reads

    with user_errors():
        # What finetune refuses once the model is built: adapters on layers the model does not have, modules PEFT
        # cannot train in full; an output.dir it cannot write.
        count_parameters(job.model, job.lora)
        check_chunked_expert_adapters(job)
        check_reads_apart(job.output.dir, {"PROFILE": resolve_profile_path(profile), **run_reads(job)})
        if problems := output_dir_problems(job.output.dir):
            fail(problems)
    # Written as it is: a console would wrap lines longer than the terminal (a long path) and break the YAML.
    typer.echo(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False), nl=False)
    notes = ignored_setting_notes(job)
    if job.output.dir.is_dir() and (found := previous_run_outputs(job.output.dir)):
        notes.append(f"note: output.dir ({job.output.dir}) holds a previous run ({', '.join(found)}): finetune "
                     "continues it with --resume or replaces its outputs with --overwrite")
    for note in notes:
        err_console.print(bounded_line(note), markup=False, emoji=False)
    if no_data:
        err_console.print(f"{profile}: valid (data not read: --no-data)", markup=False)
        return
    from moe_tune.engine.data.survey import TRAINED_CLOSE, TRAINED_OPEN, survey_data

    with user_errors():
        survey = survey_data(job, show=show)
    for line in survey.lines():
        err_console.print(f"data: {bounded_line(line)}", markup=False, emoji=False)
    if survey.schedule is not None:
        err_console.print(survey.schedule.line(), markup=False)
    for index, text in enumerate(survey.shown, 1):
        total = survey.summary.train.documents
        err_console.print(f"document {index} of {total} (trained tokens between {TRAINED_OPEN} {TRAINED_CLOSE}):",
                          markup=False, emoji=False, highlight=False)  # fmt: skip
        # Line ends kept, other controls, bidirectional and zero-width characters escaped: a record cannot rewrite
        # the terminal or hide a character.
        err_console.print("\n".join(escape_unprintable(line) for line in text.split("\n")), markup=False,
                          emoji=False, highlight=False, soft_wrap=True)  # fmt: skip
    err_console.print(f"{profile}: valid", markup=False)


@app.command()
def schema() -> None:
    """Print the JSON schema of job profiles (every field with its description)."""
    from moe_tune.profiles import json_schema

    print(json.dumps(json_schema(), indent=2))
