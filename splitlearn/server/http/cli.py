"""``python -m splitlearn.server``: the command line, and serving the app with waitress (in
process, one model copy shared by its threads, keep-alive, TCP_NODELAY) set up by
:mod:`.frontdoor` (docs/INTERNALS.md, 'HTTP on loopback', 'waitress and the front door').
A token generated for a run goes to a 0600 file, never to the log.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from ...errors import ConfigError, SplitLearnError
from ..config import GROUPS, LoraOptions, Observability, ServerConfig
from ..options import add_options, options_of


#: the options ``--help`` shows (by group); ``--help-all`` shows every one (issue 54: 81 options in
#: 319 lines before). Every option parses either way.
ESSENTIAL = frozenset({"model", "segment", "cuts", "device", "dtype", "optimizer", "lr", "checkpoint_dir",
                       "tokens", "host", "port", "listen", "max_memory_bytes", "torch_threads", "federation",
                       "clients_per_round", "lora_r", "offload", "log_level", "metrics_port"})


class _Help(argparse.Action):
    """``--help``: the essential options by group and a line naming ``--help-all``; ``--help-all``:
    every option."""

    def __init__(self, option_strings, dest, full: bool = False, help=None):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help)
        self.full = full

    def __call__(self, parser, namespace, values, option_string=None):
        print(help_text(parser, self.full), end="")
        parser.exit()


def help_text(p: argparse.ArgumentParser, full: bool) -> str:
    if full:
        return p.format_help()
    hidden = [a for a in p._actions if a.dest not in ESSENTIAL and a.option_strings and not isinstance(a, _Help)
              and a.help is not argparse.SUPPRESS]
    saved, groups = [(a, a.help) for a in hidden], list(p._action_groups)
    try:
        for a in hidden:
            a.help = argparse.SUPPRESS
        p._action_groups[:] = [g for g in groups if any(a.help is not argparse.SUPPRESS for a in g._group_actions)]
        return p.format_help() + f"\n{len(hidden)} more options (limits, scheduling, federation, the door...): --help-all\n"
    finally:
        p._action_groups[:] = groups
        for a, h in saved:
            a.help = h


def parser() -> argparse.ArgumentParser:
    """The command line, generated from the fields of the config's groups (:mod:`..config`)."""
    p = argparse.ArgumentParser(prog="python -m splitlearn.server", allow_abbrev=False, add_help=False,
                                usage="%(prog)s (--model MODEL | --segment SEGMENT) [--cut CUT ...] [options]",
                                description="serve one segment of a GPT-2 over HTTP; every option below "
                                            "is optional except the model source")
    p.add_argument("-h", "--help", action=_Help, help="the essential options, by group")
    p.add_argument("--help-all", action=_Help, full=True, help="every option")
    for group in GROUPS:
        add_options(p, group)
    return p


def parse_args(argv=None) -> ServerConfig:
    a = parser().parse_args(argv)
    from .accesslog import configure as configure_logging
    logs = Observability(**options_of(Observability, a))
    configure_logging(logs.log_level, logs.log_format, logs.access_log)
    lora = LoraOptions(**options_of(LoraOptions, a)).spec()
    return ServerConfig(**{k: v for group in GROUPS if group is not LoraOptions
                           for k, v in options_of(group, a).items()}, lora=lora)


def write_generated_token(cfg: ServerConfig) -> Path:
    """Write the token made up for this run to a new file only its owner can read; its path.

    The token itself never goes to the log (logs are collected, shipped and kept)."""
    from ...model.checkpoint import check_parents, private_dir, write_private

    path = Path(cfg.token_out or Path(cfg.checkpoint_dir or ".") / "splitlearn-token")
    try:  # refused (ConfigError, the reason): a directory or a file of another user's (SECURITY.md)
        if os.path.lexists(path.parent):
            check_parents(path)
        else:
            private_dir(path.parent)
        write_private(path, cfg.tokens[0].encode() + b"\n")  # temp + rename: never through a link
    except OSError as e:
        raise ConfigError(f"no token given, and the one generated cannot be written to {path}: {e}; "
                          f"give --token-out PATH, --token-file or $SPLITLEARN_TOKEN") from None
    return path.resolve()


def start_profiler(rt):
    """``--profile-dir``: torch.profiler over the server's life, started on its compute thread
    (the profiler records the CPU ops of the thread that starts it: the one that runs the
    model; CUDA kernels and copies of every thread on a GPU)."""
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU]
    if getattr(getattr(rt, "device", None), "type", "cpu") == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=acts)
    rt.compute.run(prof.__enter__)
    return prof


def write_profile(prof, rt, directory: Path) -> Path:
    """Stop ``prof`` (on the compute thread); its key averages by self CPU time (and by device
    time on a GPU) to ``directory/server-profile.txt``."""
    device = getattr(rt, "device", None)
    rt.compute.run(lambda: prof.__exit__(None, None, None))
    from ...model.checkpoint import private_dir, write_private

    private_dir(directory)  # 0700, this user's own; the file 0600 (docs/SECURITY.md)
    avg = prof.key_averages()
    text = avg.table(sort_by="self_cpu_time_total", row_limit=50)
    if getattr(device, "type", "cpu") == "cuda":
        text += "\n\n" + avg.table(sort_by="self_device_time_total", row_limit=30)
    return write_private(directory / "server-profile.txt", text.encode())


def serve(cfg: ServerConfig) -> None:
    """Build the app and serve it until SIGTERM/SIGINT, checkpointing on the way out."""
    from ...procs.idlepoll import IdlePoller
    from .app import create_app
    from .frontdoor import make_server

    app = create_app(cfg)
    rt = app.extensions["splitlearn"]
    server = make_server(app, cfg.tenants, host=cfg.host, port=cfg.port, threads=cfg.threads,
                         max_body_bytes=cfg.max_body_bytes, limits=cfg.door_limits()) if cfg.tcp else None
    unix_doors = []
    if cfg.listen:  # --listen unix:///PATH.sock: the same app without HTTP (unixdoor.py)
        from ..config import socket_path
        from .unixdoor import UnixDoor
        unix_doors = [UnixDoor(app, cfg.tenants, socket_path(url), max_body_bytes=cfg.max_body_bytes,
                               limits=cfg.door_limits(), mode=int(cfg.unix_mode, 8)).start()
                      for url in cfg.listen]

    poller = IdlePoller().start() if cfg.poll_idle else None
    profiler = start_profiler(rt) if cfg.profile_dir else None
    scrape = app.extensions["splitlearn.metrics"].serve_loopback(cfg.metrics_port, cfg.tenants) if cfg.metrics_port else None

    def stop(signum, _frame):
        if cfg.drain_s > 0 and not getattr(rt, "draining", False):
            # draining: /v1/ready answers 503, everything else is served as before, then this
            # handler runs again (or at once on a second signal)
            rt.draining = True
            logging.getLogger(__name__).info("signal %d: draining for %gs (GET /v1/ready: 503), then stopping",
                                             signum, cfg.drain_s)
            timer = threading.Timer(cfg.drain_s, os.kill, (os.getpid(), signal.SIGTERM))
            timer.daemon = True
            timer.start()
            return
        rt.draining = True
        logging.getLogger(__name__).info("signal %d: checkpointing and stopping", signum)
        if poller is not None:
            poller.stop()
        if scrape is not None:
            scrape.shutdown()
        rt.compute.run(rt.checkpoint)
        if profiler is not None:
            write_profile(profiler, rt, Path(cfg.profile_dir))
        for door in unix_doors:
            door.close()
        if server is not None:
            server.close()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if cfg.generated_token:
        path = write_generated_token(cfg)
        print(f"no token given: generated one for this run, written to {path} (mode 0600); "
              f"clients: --token-file {path}", file=sys.stderr)
    if cfg.offload:
        what = f"masked offload of {len(rt.layers)} linear layers of {cfg.model} on cpu"
    else:
        seg = rt.segment
        what = f"{seg.kind} blocks [{seg.start}, {seg.end}) on {rt.device}"
    where = ([f"http://{cfg.host}:{cfg.port}"] if server is not None else []) + [d.url for d in unix_doors]
    print(f"splitlearn server: {what} at {' and '.join(where)} (ready)", file=sys.stderr, flush=True)
    if server is not None:
        server.run()
    else:  # --no-tcp: the doors' threads serve; this one waits for SIGTERM/SIGINT. Not
        # signal.pause(): a signal the kernel hands to another thread never wakes it, while a
        # sleep returns and runs the handler Python has pending (within the half second)
        while True:
            time.sleep(0.5)


def main(argv=None) -> int:
    try:
        cfg = parse_args(argv)
        serve(cfg)
    except SplitLearnError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0

