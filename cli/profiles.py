"""`moe-tune validate` and `moe-tune schema`: check a profile, print the schema."""

from __future__ import annotations

import json

import typer
import yaml
from rich.console import Console

from ._common import ProfileArg, SetOption, read_profile

app = typer.Typer()


@app.command()
def validate(profile: ProfileArg, overrides: SetOption = None) -> None:
    """Check a profile and print it resolved (defaults filled in); exit 2 listing every problem."""
    job = read_profile(profile, overrides)
    Console(highlight=False).print(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False), end="", markup=False)
    Console(stderr=True, highlight=False).print(f"{profile}: valid", markup=False)


@app.command()
def schema() -> None:
    """Print the JSON schema of job profiles (every field with its description)."""
    from moe_tune.profiles import json_schema

    print(json.dumps(json_schema(), indent=2))
