"""``python -m jaxtdist.launch --nproc-per-node N [options] prog.py ARGS``.

Starts N processes of one program on this host, each ready for
``jaxtdist.launch.initialize_from_env()`` (docs/multiprocess.md).

Example:
  python -m jaxtdist.launch --nproc-per-node 2 examples/multiprocess_tp.py
"""

from __future__ import annotations

import argparse
import sys

from jaxtdist.launch._supervisor import LaunchOptions, run


def parse(argv: list[str]) -> LaunchOptions:
    parser = argparse.ArgumentParser(
        prog="python -m jaxtdist.launch",
        description="Start N processes of a JAX program on this host with what "
                    "jax.distributed.initialize needs (call "
                    "jaxtdist.launch.initialize_from_env() in the program). Each output line "
                    "is prefixed with its rank; the job ends as soon as one rank fails.")
    parser.add_argument("--nproc-per-node", type=int, required=True, metavar="N",
                        help="processes to start (ranks 0..N-1)")
    parser.add_argument("--share-gpu", action="store_true",
                        help="every rank sees the same GPU (the first visible one), for "
                             "development under MPS; default: rank i sees GPU i")
    parser.add_argument("--cpu-devices-per-process", type=int, default=1, metavar="K",
                        help="JAX CPU devices per process (JAX_NUM_CPU_DEVICES; default 1)")
    parser.add_argument("--failure-grace-s", type=float, default=0.0, metavar="S",
                        help="after a rank fails, seconds the others get to exit on their own "
                             "(and report their own errors) before SIGTERM (default 0)")
    parser.add_argument("--kill-after-s", type=float, default=5.0, metavar="S",
                        help="seconds between SIGTERM and SIGKILL (default 5)")
    parser.add_argument("--port", type=int, default=None,
                        help="coordinator port on 127.0.0.1 (default: a free one)")
    parser.add_argument("-m", dest="module", action="store_true",
                        help="run the program as a module (python -m prog)")
    parser.add_argument("program", help="the Python script (or module, with -m) to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    ns = parser.parse_args(argv)
    if ns.nproc_per_node < 1:
        parser.error(f"--nproc-per-node {ns.nproc_per_node}: give at least 1")
    if ns.cpu_devices_per_process < 1:
        parser.error(f"--cpu-devices-per-process {ns.cpu_devices_per_process}: give at least 1")
    command = [sys.executable] + (["-m"] if ns.module else []) + [ns.program, *ns.args]
    return LaunchOptions(nproc=ns.nproc_per_node, command=command, share_gpu=ns.share_gpu,
                         cpu_devices=ns.cpu_devices_per_process,
                         failure_grace_s=ns.failure_grace_s, kill_after_s=ns.kill_after_s,
                         port=ns.port)


def main(argv: list[str] | None = None) -> int:
    return run(parse(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
