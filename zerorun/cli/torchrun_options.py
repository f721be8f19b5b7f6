"""torchrun's rendezvous options on zerorun's static world (pure).

zerorun's workers meet where torch's ``env://`` rendezvous says: ``MASTER_ADDR:MASTER_PORT``,
the first host and a free port unless told. torchrun's options map onto that where they mean
the same, and are refused with what to use where they do not:

    --standalone               one host, a free local port: zerorun's default (refused beside
                               --hostfile; an --rdzv-endpoint is ignored, as torchrun does)
    --rdzv-backend c10d|static the same meeting point; etcd/etcd-v2 are refused
    --rdzv-endpoint HOST[:PORT] = --master-addr HOST --master-port PORT
    --rdzv-id ID               accepted; a run is told apart by its run directory (a note)
    --rdzv-conf K=V,...        refused: join_timeout is --startup-timeout; the others tune
                               elastic membership, which a static world does not have
"""

from __future__ import annotations

from zerorun.errors import LaunchError

STATIC_BACKENDS = ("c10d", "static")


def rendezvous(*, standalone: bool, backend: str | None, endpoint: str | None, rdzv_id: str | None,
               conf: str | None, master_addr: str | None, master_port: int | None,
               hostfile: str | None) -> tuple[str | None, int | None, list[str]]:
    """(master address, master port, notes) once torchrun's options are applied."""
    notes: list[str] = []
    if backend is not None and backend.lower() not in STATIC_BACKENDS:
        raise LaunchError(f"--rdzv-backend {backend}: zerorun's workers meet at one address (torch's env:// "
                          "rendezvous), not through an external store",
                          hint="--rdzv-backend c10d --rdzv-endpoint HOST:PORT, or --master-addr HOST --master-port PORT")
    if conf is not None:
        wanted = [part.partition("=")[0].strip() for part in conf.split(",") if part.strip()]
        hint = ("--startup-timeout SECONDS (how long a rank may take to join)" if "join_timeout" in wanted
                else "leave it out: it tunes elastic membership, which zerorun's static world does not have")
        raise LaunchError(f"--rdzv-conf {conf}: has no meaning for zerorun's rendezvous", hint=hint)
    if standalone and hostfile is not None:
        raise LaunchError("--standalone runs on this host only, with a free local port",
                          hint="leave out --standalone to use --hostfile")
    if standalone and endpoint is not None:
        notes.append(f"--standalone: --rdzv-endpoint {endpoint} ignored, as torchrun does (this host, a free port)")
        endpoint = None
    if endpoint is not None:
        host, _, port_text = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
        port = None
        if port_text:
            if not port_text.isdigit() or not 0 < int(port_text) < 65536:
                raise LaunchError(f"--rdzv-endpoint {endpoint}: the port must be a number from 1 to 65535",
                                  hint="--rdzv-endpoint HOST:PORT, e.g. localhost:29400")
            port = int(port_text)
        if not host:
            raise LaunchError(f"--rdzv-endpoint {endpoint}: no host", hint="--rdzv-endpoint HOST:PORT")
        if master_addr is not None and master_addr != host or master_port is not None and port is not None \
                and master_port != port:
            raise LaunchError(f"--rdzv-endpoint {endpoint} and --master-addr/--master-port name different places",
                              hint="give one of them")
        master_addr, master_port = host, port if port is not None else master_port
    if rdzv_id is not None:
        notes.append(f"--rdzv-id {rdzv_id}: accepted; zerorun tells runs apart by their run directory")
    return master_addr, master_port, notes
