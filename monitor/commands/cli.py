"""``kvcanary``: the command line. Thin: every command parses, then calls one function.

Exit codes are part of the interface: 0 ok / all pass, 1 a leak or mismatch (``check``),
2 a bad config or an un-migrated database, 3 only errors kept ``check`` from judging.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from kvcanary.monitor.commands import containment_keys
from kvcanary.monitor.config.settings import ConfigError, Settings, load_settings

app = typer.Typer(
    name="kvcanary",
    help="Catch KV-cache isolation failures in shared LLM serving: probes judged on output.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Database migrations (Alembic).", no_args_is_help=True)
app.add_typer(db_app, name="db")
quarantine_app = typer.Typer(
    help="The targets the gateways are told to stop sending customers to.", no_args_is_help=True
)
app.add_typer(quarantine_app, name="quarantine")
incidents_app = typer.Typer(
    help="An operator's word on a suspected incident: confirm it, or dismiss it as benign.",
    no_args_is_help=True,
)
app.add_typer(incidents_app, name="incidents")
app.add_typer(containment_keys.app, name="containment")

ConfigOpt = Annotated[
    Path, typer.Option("--config", "-c", help="The YAML config file (see kvcanary.example.yml).")
]
EXIT_CONFIG = 2
#: The reference worker, run as a module (the monitor starts workers only as processes).
WORKERS_MODULE = "kvcanary.workers"


def _fail(message: str, code: int = EXIT_CONFIG) -> typer.Exit:
    typer.echo(f"kvcanary: {message}", err=True)
    return typer.Exit(code)


def _settings(path: Path) -> Settings:
    try:
        return load_settings(path)
    except ConfigError as exc:
        raise _fail(f"config error: {exc}") from None


class LogFormat(enum.StrEnum):
    auto = "auto"
    litellm = "litellm"
    sglang = "sglang"
    openai = "openai"


class LogLevel(enum.StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


@contextmanager
def _database_errors(url: str) -> Iterator[None]:
    """Turn an unusable database into exit 2 with one line, not a traceback (no URL password shown)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import SQLAlchemyError

    try:
        yield
    except SQLAlchemyError as exc:
        where = make_url(url).render_as_string(hide_password=True)
        raise _fail(
            f"database error at {where}: {type(exc).__name__}: {getattr(exc, 'orig', None) or exc}"
        ) from None


def _logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # httpx logs every request URL at INFO, and APScheduler each job's start and end (the clock's
    # own jobs run every half second): keep the monitor's own lines readable, unless debugging.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("apscheduler").setLevel(logging.WARNING)


@app.command()
def serve(
    config: ConfigOpt,
    log_level: Annotated[LogLevel, typer.Option(help="How much to log.")] = LogLevel.info,
) -> None:
    """Run the scheduler, the REST API and /metrics until SIGTERM or Ctrl-C."""
    from kvcanary.monitor.commands.serve import serve_forever
    from kvcanary.monitor.storage.db import DatabaseNotMigrated
    from kvcanary.monitor.storage.sqlite_file import DatabaseInUse

    settings = _settings(config)
    _logging(log_level.value)
    try:
        with _database_errors(settings.database_url):
            serve_forever(settings, config)
    except ConfigError as exc:
        raise _fail(f"config error: {exc}") from None
    except (DatabaseNotMigrated, DatabaseInUse) as exc:
        raise _fail(str(exc)) from None


@app.command()
def check(
    config: ConfigOpt,
    json_lines: Annotated[
        bool, typer.Option("--json", help="One JSON object per line instead of a table.")
    ] = False,
    target: Annotated[list[str] | None, typer.Option(help="Only this target (repeatable).")] = None,
) -> None:
    """Run every configured probe once on every target: the deploy gate.

    Run it after every change of weights, quantization, parallelism or memory fraction.
    Exit 0 when all pass, 1 on any leak or mismatch, 3 when only errors kept it from judging.
    """
    from kvcanary.monitor.commands.check import run_check

    settings = _settings(config)
    _logging("warning")
    unknown = [t for t in target or [] if settings.target(t) is None]
    if unknown:
        raise _fail(f"--target: no target named {unknown[0]!r} in {config}")
    try:
        code = run_check(settings, json_lines=json_lines, only=target or None)
    except ConfigError as exc:
        raise _fail(f"config error: {exc}") from None
    raise typer.Exit(code)


@app.command("blast-radius")
def blast_radius(
    incident: Annotated[int, typer.Argument(min=1, help="The incident's id (as in its page and alerts).")],
    config: ConfigOpt,
    logs: Annotated[
        list[str] | None, typer.Option("--logs", help="A glob of the gateway's log files (repeatable).")
    ] = None,
    log_format: Annotated[
        LogFormat, typer.Option(help="The logs' format; auto tells it from the first line.")
    ] = LogFormat.auto,
    litellm_db: Annotated[
        str | None, typer.Option(help="LiteLLM's database URL (its LiteLLM_SpendLogs table).")
    ] = None,
    exclude: Annotated[
        list[str] | None, typer.Option(help="A caller to leave out and count apart (repeatable).")
    ] = None,
    chars_per_token: Annotated[
        float | None,
        typer.Option(min=0.1, max=100.0, help="The target's characters per token, if it is down."),
    ] = None,
    csv: Annotated[
        Path | None, typer.Option(help="Write the request ids to notify to this CSV file.")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="The report as JSON.")] = False,
) -> None:
    """Say which responses an incident exposed, of which callers, between when and when."""
    from kvcanary.monitor.commands.blast import run_blast_radius
    from kvcanary.monitor.storage.db import DatabaseNotMigrated

    settings = _settings(config)
    _logging("warning")
    try:
        with _database_errors(settings.database_url):
            code = run_blast_radius(
                settings, incident, logs=logs or [], log_format=log_format.value, litellm_db=litellm_db,
                exclude=exclude or [], chars_per_token=chars_per_token, csv_path=csv, as_json=json_out,
            )  # fmt: skip
    except (ConfigError, DatabaseNotMigrated) as exc:
        raise _fail(str(exc)) from None
    except (OSError, ValueError) as exc:  # an unreadable log file, a CSV that cannot be written
        raise _fail(f"blast-radius: {exc}") from None
    raise typer.Exit(code)


def _quarantine(config: Path, action: str, target: str | None = None, reason: str = "") -> None:
    from kvcanary.monitor.commands.quarantine import run_quarantine
    from kvcanary.monitor.storage.db import DatabaseNotMigrated

    settings = _settings(config)
    _logging("warning")
    try:
        with _database_errors(settings.database_url):
            code = run_quarantine(settings, action, target, reason)
    except DatabaseNotMigrated as exc:
        raise _fail(str(exc)) from None
    raise typer.Exit(code)


def _incident_word(config: Path, action: str, incident_id: int, note: str) -> None:
    from kvcanary.monitor.commands.incidents import run_incident_word
    from kvcanary.monitor.storage.db import DatabaseNotMigrated

    settings = _settings(config)
    _logging("warning")
    try:
        with _database_errors(settings.database_url):
            code = run_incident_word(settings, action, incident_id, note)
    except DatabaseNotMigrated as exc:
        raise _fail(str(exc)) from None
    raise typer.Exit(code)


IncidentArg = Annotated[int, typer.Argument(min=1, help="The incident's id (its page's URL, or the API's).")]
NoteOpt = Annotated[str, typer.Option(min=1, max=300, help="Why, in one line: kept in its timeline.")]


@incidents_app.command("confirm")
def incidents_confirm(config: ConfigOpt, incident_id: IncidentArg, note: NoteOpt) -> None:
    """Confirm a suspected incident as a real leak: containment then acts on it as on a certain one."""
    _incident_word(config, "confirm", incident_id, note)


@incidents_app.command("dismiss")
def incidents_dismiss(config: ConfigOpt, incident_id: IncidentArg, note: NoteOpt) -> None:
    """Dismiss a suspected incident as benign (a text the callers share): it resolves."""
    _incident_word(config, "dismiss", incident_id, note)


TargetArg = Annotated[str, typer.Argument(help="The target's name, as in the config.")]
ReasonOpt = Annotated[str, typer.Option(min=1, max=300, help="Why, in one line: shown to on-call.")]


@quarantine_app.command("list")
def quarantine_list(config: ConfigOpt) -> None:
    """Print each quarantined target: enforced or observed, by what, since when, why."""
    _quarantine(config, "list")


@quarantine_app.command("put")
def quarantine_put(target: TargetArg, config: ConfigOpt, reason: ReasonOpt) -> None:
    """Quarantine a target by hand (enforced whatever the policy) until it is lifted by hand."""
    _quarantine(config, "put", target, reason)


@quarantine_app.command("lift")
def quarantine_lift(
    target: TargetArg, config: ConfigOpt, reason: ReasonOpt = "lifted by an operator"
) -> None:
    """Lift a target's quarantine; it holds until a new incident. Exit 1 when there was none."""
    _quarantine(config, "lift", target, reason)


class Topology(enum.StrEnum):
    """The demo's serving topology (``kvcanary demo --topology``)."""

    single = "single"
    pd = "pd"


@app.command()
def demo(
    duration: Annotated[
        float | None, typer.Option(help="Stop after this many seconds (default: run until Ctrl-C).")
    ] = None,
    port: Annotated[int, typer.Option(help="Port for the monitor's REST API and /metrics.")] = 8600,
    workdir: Annotated[Path | None, typer.Option(help="Where to keep the demo database and logs.")] = None,
    until_caught: Annotated[
        bool, typer.Option(help="Exit once the leak is caught and the healthy target is green (for CI).")
    ] = False,
    topology: Annotated[
        Topology,
        typer.Option(
            help="single: a healthy and a defective worker (and a LiteLLM gateway); pd: the "
            "incident's own, SGLang's gateway in PD mode before 2 prefill and 2 decode servers."
        ),
    ] = Topology.single,
) -> None:
    """Start a healthy and a defective reference worker and the monitor; show the leak being caught
    (``--topology pd``: on the incident's prefill/decode topology behind SGLang's gateway)."""
    _logging("warning")
    if topology is Topology.pd:
        from kvcanary.demo.pd import run_pd_demo

        code = run_pd_demo(duration=duration, port=port, workdir=workdir, until_caught=until_caught)
        raise typer.Exit(code)
    from kvcanary.demo.run import run_demo

    raise typer.Exit(run_demo(duration=duration, port=port, workdir=workdir, until_caught=until_caught))


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def worker(ctx: typer.Context) -> None:
    """Run the reference serving worker (torch). All flags go to it: kvcanary worker --help."""
    # The monitor never imports the worker: they meet over HTTP. Hand this process over to it.
    os.execv(sys.executable, [sys.executable, "-m", WORKERS_MODULE, *ctx.args])


@db_app.command("upgrade")
def db_upgrade(
    config: ConfigOpt,
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
) -> None:
    """Migrate the configured database to the newest schema (or --revision)."""
    from kvcanary.monitor.storage.db import upgrade

    settings = _settings(config)
    with _database_errors(settings.database_url):
        upgrade(settings.database_url, revision)
    typer.echo(f"database migrated to {revision}")


@db_app.command("downgrade")
def db_downgrade(
    config: ConfigOpt,
    revision: Annotated[str, typer.Option(help="Target revision, e.g. base or -1.")],
) -> None:
    """Revert the configured database to an older schema."""
    from kvcanary.monitor.storage.db import downgrade

    settings = _settings(config)
    with _database_errors(settings.database_url):
        downgrade(settings.database_url, revision)
    typer.echo(f"database downgraded to {revision}")


dashboards_app = typer.Typer(help="Grafana dashboards (the JSON in dashboards/).", no_args_is_help=True)
app.add_typer(dashboards_app, name="dashboards")


@dashboards_app.command("push")
def dashboards_push(
    grafana_url: Annotated[
        str,
        typer.Option(
            "--grafana-url", envvar="GRAFANA_URL", help="Grafana's base URL, e.g. http://grafana:3000."
        ),
    ],
    token_env: Annotated[
        str, typer.Option("--token-env", help="Environment variable holding a Grafana service account token.")
    ] = "GRAFANA_TOKEN",
    token_file: Annotated[
        Path | None,
        typer.Option("--token-file", help="Read the token from this file instead of --token-env."),
    ] = None,
    folder: Annotated[
        str, typer.Option(help="Uid and title of the Grafana folder; created if missing.")
    ] = "kvcanary",
    files: Annotated[
        list[Path] | None, typer.Argument(help="Dashboard JSON files (default: every dashboards/*.json).")
    ] = None,
) -> None:
    """Save the dashboards into a Grafana folder over its HTTP API, replacing those with the same uid.

    Exit 0 when Grafana saved every dashboard, 1 when it refused one or did not answer, 2 when the
    token, the URL or a dashboard file is missing or unusable. The token is never printed.
    """
    from kvcanary.monitor.commands.dashboards import (
        DashboardPushError,
        dashboard_files,
        push_dashboards,
        read_token,
    )

    _logging("warning")
    try:
        token = read_token(token_env=token_env, token_file=token_file)
        results = push_dashboards(grafana_url, token, files or dashboard_files(), folder=folder)
    except DashboardPushError as exc:
        raise _fail(str(exc), exc.exit_code) from None
    for result in results:
        typer.echo(f"{result.uid}: version {result.version}, {result.url}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
