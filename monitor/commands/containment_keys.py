"""``kvcanary containment keygen --out DIR``: a key pair for the quarantine set's signature
(``monitor/containment/signing.py``), written as ``monitor/containment/key_files.py`` says."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvcanary.monitor.containment.key_files import KeyExists, write_key_pair

app = typer.Typer(help="The key that signs the quarantine set the gateways read.", no_args_is_help=True)


@app.command("keygen")
def keygen(
    out: Annotated[Path, typer.Option("--out", help="The folder to write the two key files into.")],
) -> None:
    """Make a key pair: the monitors' private key and the public key the gateways' taps hold.
    Exit 1 when a key file is there already (nothing is written)."""
    try:
        pair = write_key_pair(out)
    except KeyExists as exc:
        typer.echo(f"kvcanary: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"key {pair.key_id}")
    typer.echo(f"  monitors : containment_signing.key_file: {pair.private}   (keep it secret)")
    typer.echo(f"  gateways : KVCANARY_TAP_QUARANTINE_PUBLIC_KEYS_FILE={pair.public}")
