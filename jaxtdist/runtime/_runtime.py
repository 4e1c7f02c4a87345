"""The jaxtdist runtime: the one object that owns the symmetric heap.

It maps the mesh onto heaps (one per device), lays out the reserved part of
each heap (error record, scratch word, context templates), hands out
symmetric workspaces, and registers everything with the native FFI state.
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import threading
import time
import warnings
from collections.abc import Sequence

import jax
import numpy as np

from jaxtdist.language import _layout as L
from jaxtdist.runtime import _bootstrap, _ffi, _native
from jaxtdist.runtime._backend import BackendSpec, create_backend
from jaxtdist.runtime import _builtin_backends  # noqa: F401  (registers the built-ins)
from jaxtdist.runtime._config_cache import TuningCache
from jaxtdist._errors import HeapExhaustedError, NotInitializedError, WaitTimeoutError

_ALIGN = 256
_TEMPLATE_START = 4096
_MAX_LAYOUTS = 96
_RESERVED_BYTES = _TEMPLATE_START + _MAX_LAYOUTS * L.CTX_WORDS * 8

DEFAULT_HEAP_BYTES = {"cpu": 32 << 20, "gpu": 1 << 30}
_REMOTE_HEAP = -2  # the device ordinal of a heap of another process (runtime_state.h)
# Seconds a kernel's wait spins before it gives up and reports a timeout, the
# same on CPU and GPU. Long enough for a peer that is legitimately late (a
# straggler's host busy with data loading, a checkpoint write, a first-call
# compile on another process), short enough that a deadlock surfaces as an
# error within minutes rather than as a hang. Tests use seconds.
DEFAULT_WAIT_TIMEOUT_S = 300.0
# How long a host thread waits for its group at a launch rendezvous
# (csrc/launch_align.h) before it launches anyway. Waiting for a member that
# comes late costs no more than launching early (the kernel would wait for
# it on the device), so the bound only has to catch members that never come;
# it sits well above the host delays seen on the 4 x H200 VM (late threads
# reaching their handler in 4 ms steps, up to 17.6 ms: docs/perf).
LAUNCH_ALIGN_TIMEOUT_US = 50_000
# How long of that an early arrival spins before it sleeps until the last
# member wakes it. Launches of one call arrive microseconds apart; spinning
# longer holds CPUs that late members' host threads need (with 10 ms of
# spinning, 10 of 18 test_launchers parametrizations had a timeout there).
LAUNCH_ALIGN_SPIN_US = 200


@dataclasses.dataclass(frozen=True)
class Layout:
    """The groups of a collective over ``axes`` of the mesh."""
    axes: tuple[str, ...]
    world: int
    template_offset: int


@dataclasses.dataclass(frozen=True)
class Workspace:
    """A symmetric region of every heap plus its epoch counter."""
    key: tuple
    offset: int
    nbytes: int
    counter_id: int


def _platform(devices) -> str:
    platforms = {d.platform for d in devices}
    if len(platforms) != 1:
        raise ValueError(f"jaxtdist: the mesh mixes platforms {sorted(platforms)}")
    platform = platforms.pop()
    if platform == "cpu":
        return "cpu"
    if platform in ("gpu", "cuda"):
        return "gpu"
    raise ValueError(f"jaxtdist supports CPU and CUDA devices, not {platform!r}")


# Who launches Triton kernels on GPUs: jaxtdist's FFI handler
# (csrc/triton_launch.cc), or jaxlib's Triton custom call through jax-triton.
LAUNCHERS = ("native", "jax-triton")


def _check_launcher(launcher: str) -> str:
    if launcher not in LAUNCHERS:
        raise ValueError(f"jaxtdist: launcher={launcher!r}; allowed: 'native' (jaxtdist's own "
                         "FFI launcher, the default) or 'jax-triton' (jaxlib's Triton custom "
                         "call; kernels with device-side TMA descriptors still use 'native')")
    return launcher


_HEAP_GRANULE = 4096


def _rounded_heap(heap_bytes: int) -> int:
    """``heap_bytes`` rounded up to a multiple of 4 KiB: every device's heap then
    starts aligned where heaps are laid out one after another (CPU), which the
    kernels' 16-byte signals and vector accesses need."""
    return -(-int(heap_bytes) // _HEAP_GRANULE) * _HEAP_GRANULE


def _check_settings(mesh, heap_bytes, wait_timeout_s, align_launches, launcher,
                    bootstrap_timeout_s) -> None:
    """``initialize``'s arguments, each checked before anything is torn down or
    allocated: a rejected call leaves the runtime in place."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"jaxtdist.initialize: mesh must be a jax.sharding.Mesh (e.g. "
                        f"jax.make_mesh((n,), ('tp',))), got {type(mesh).__name__}")
    if heap_bytes is not None:
        if isinstance(heap_bytes, bool) or not isinstance(heap_bytes, (int, np.integer)):
            raise TypeError(f"jaxtdist.initialize: heap_bytes={heap_bytes!r} must be an int "
                            "(bytes per device), or None for the default")
        if heap_bytes < 2 * _RESERVED_BYTES:
            raise ValueError(f"jaxtdist.initialize: heap_bytes={heap_bytes} is below the "
                             f"minimum {2 * _RESERVED_BYTES} (None: the default)")
    if wait_timeout_s is not None:
        if isinstance(wait_timeout_s, bool) or not isinstance(wait_timeout_s,
                                                              (int, float, np.number)):
            raise TypeError(f"jaxtdist.initialize: wait_timeout_s={wait_timeout_s!r} must be "
                            "a number of seconds")
        if not 0 < float(wait_timeout_s) <= 1e6:
            raise ValueError(f"jaxtdist: wait_timeout_s={wait_timeout_s!r}; allowed: seconds "
                             "in (0, 1e6]")
    if align_launches is not None and not isinstance(align_launches, (bool, np.bool_)):
        raise TypeError(f"jaxtdist.initialize: align_launches={align_launches!r} must be True "
                        "or False")
    if launcher is not None:
        _check_launcher(launcher)
    if bootstrap_timeout_s is not None:
        _bootstrap.bootstrap_timeout_s(bootstrap_timeout_s)


class Runtime:
    """Owns the symmetric heap of one mesh. Create it with ``jaxtdist.initialize``."""

    def __init__(self, mesh, heap_bytes: int | None = None,
                 wait_timeout_s: float | None = None,
                 align_launches: bool = True, launcher: str = "native",
                 bootstrap_timeout_s: float | None = None):
        _check_settings(mesh, heap_bytes, wait_timeout_s, align_launches, launcher,
                        bootstrap_timeout_s)
        devices = list(mesh.devices.flat)
        self.mesh = mesh
        # Every prologue carries them: a shard_map over other devices is refused.
        self.device_ids = _ffi.device_ids(mesh)
        # Mesh positions of this process's devices: the heaps this process sets up
        # and whose kernels it runs (every position unless the mesh spans processes).
        me = jax.process_index()
        self.local_positions = tuple(p for p, d in enumerate(devices) if d.process_index == me)
        if not self.local_positions:
            raise ValueError(
                f"jaxtdist: none of the mesh's {len(devices)} devices belongs to this process "
                f"(process {me}); pass jaxtdist.initialize the mesh this process's shard_map "
                "runs on, which includes its devices")
        self.bootstrap_timeout_s = _bootstrap.bootstrap_timeout_s(bootstrap_timeout_s)
        self.platform = _platform(devices)
        self.heap_bytes = _rounded_heap(DEFAULT_HEAP_BYTES[self.platform] if heap_bytes is None
                                        else heap_bytes)
        # SMs a persistent grid may fill (devices of one mesh are of one kind).
        self.sms = int(getattr(devices[self.local_positions[0]], "core_count", None) or 132)
        self.wait_timeout_s = float(DEFAULT_WAIT_TIMEOUT_S if wait_timeout_s is None
                                    else wait_timeout_s)
        self.native = _native.native()
        if self.platform == "gpu" and not self.native.with_cuda:
            raise RuntimeError(
                "jaxtdist's native library was built without CUDA (no CUDA headers were "
                "found at build time); reinstall on a machine with the CUDA toolkit")
        self._lock = threading.Lock()
        self.tuning = TuningCache(devices[0].device_kind)
        global _GENERATION
        _GENERATION += 1
        self.generation = _GENERATION
        # The last jaxtdist output traced in each recent trace (``ops._protocol``'s
        # program order): the next op traced in that trace depends on it, so that
        # every device runs jaxtdist ops (and advances their epochs) in one program
        # order (nested bodies are ordered when lowered, ``_call_order``).
        self.order_records: list = []
        self._layouts: dict[tuple[str, ...], Layout] = {}
        self._workspaces: dict[tuple, Workspace] = {}
        self._next_offset = _RESERVED_BYTES
        self.native.reset(self.generation)
        self._align_launches = bool(align_launches)
        self.native.configure_launch_alignment(self._align_launches, LAUNCH_ALIGN_TIMEOUT_US,
                                               LAUNCH_ALIGN_SPIN_US)
        self._launcher = _check_launcher(launcher)
        started = time.perf_counter()
        self.backend_name, self.backend = create_backend(
            BackendSpec(self.platform, tuple(devices), self.heap_bytes, self.native,
                        process_index=me, generation=self.generation,
                        bootstrap_timeout_s=self.bootstrap_timeout_s))
        # Seconds from here to a ready heap on every process (docs/multiprocess.md).
        self.heap_ready_s = time.perf_counter() - started
        # The launch rendezvous meets host threads of one process; a group spanning
        # processes has none to meet (its kernels wait for each other on the device).
        self.multi_process = len(set(self.backend.positions)) < len(devices)
        if self.multi_process and self._align_launches:
            self.align_launches = False
        for pos in self.backend.positions:
            self.native.register_heap(pos, self.backend.ordinal_of(pos),
                                      self.backend.base_of(pos), self.heap_bytes,
                                      self.backend.error_record(pos))
        # Other processes' heaps mapped into this one: copy-engine pushes' targets.
        for pos, base in getattr(self.backend, "remote_bases", {}).items():
            self.native.register_heap(pos, _REMOTE_HEAP, base, self.heap_bytes, 0)
        if self.platform == "gpu":
            # The prologue's context writer, loaded before any kernel of ours runs
            # (csrc/ctx_writer.h); where it cannot load, prologues copy the template.
            for pos in self.backend.positions:
                try:
                    self.native.preload_context_writer(self.backend.ordinal_of(pos))
                except RuntimeError as err:
                    warnings.warn(f"jaxtdist: the context writer did not load ({err}); "
                                  "every call copies its context instead (slower)")

    # -- launch alignment -----------------------------------------------------

    @property
    def align_launches(self) -> bool:
        """Whether collective kernels' host threads meet before launching (GPUs)."""
        return self._align_launches

    @align_launches.setter
    def align_launches(self, enabled: bool) -> None:
        # Read by the handlers at run time: compiled programs need no retrace.
        self._align_launches = bool(enabled) and not getattr(self, "multi_process", False)
        self.native.configure_launch_alignment(self._align_launches, LAUNCH_ALIGN_TIMEOUT_US,
                                               LAUNCH_ALIGN_SPIN_US)

    @property
    def launcher(self) -> str:
        """Who launches Triton kernels on GPUs, read when an op is traced.

        "native" (default): jaxtdist's FFI handler. "jax-triton": jaxlib's
        Triton custom call; on 4 x H200 the devices of one call then started
        6-14 us apart, against 2-3 us natively (docs/perf, run U). Kernels with
        device-side TMA descriptors always run natively (jaxlib passes them no
        global scratch).
        """
        return self._launcher

    @launcher.setter
    def launcher(self, launcher: str) -> None:
        # Programs traced before keep the launcher they were traced with.
        self._launcher = _check_launcher(launcher)

    def launch_alignment_stats(self) -> dict:
        """Host rendezvous before collective launches so far: ``enabled``, ``met``
        and ``timed_out`` (arrivals), why alignment turned itself off, if it did
        (``disabled_because``), the largest first-to-last arrival gap
        (``max_spread_us``), and per rendezvous with a timeout (``late``, the
        first 32) each member's mesh ``position``, ``entered_us`` (its handler
        began) and ``arrived_us``, in microseconds after the first arrival."""
        return dict(self.native.launch_alignment_stats())

    # -- layouts --------------------------------------------------------------

    def layout(self, axis_name: str | Sequence[str]) -> Layout:
        """The group layout of a collective over ``axis_name`` (one axis or several)."""
        names = tuple(self.mesh.axis_names)
        if isinstance(axis_name, str):
            axes = (axis_name,)
        elif isinstance(axis_name, (tuple, list)):
            axes = tuple(axis_name)
        else:
            # An int, bytes or set would be iterated (or fail to be) into nonsense.
            raise ValueError(f"jaxtdist: axis_name must be a mesh axis name (a str) or a tuple "
                             f"of them, got {axis_name!r} ({type(axis_name).__name__}); the "
                             f"mesh's axes are {names}")
        for a in axes:
            if a not in names:
                raise ValueError(f"jaxtdist: axis_name {a!r} is not an axis of the mesh passed "
                                 f"to jaxtdist.initialize; its axes are {names}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"jaxtdist: axis_name {axis_name!r} repeats an axis")
        with self._lock:
            if axes in self._layouts:
                return self._layouts[axes]
            if len(self._layouts) >= _MAX_LAYOUTS:
                raise HeapExhaustedError(f"jaxtdist: more than {_MAX_LAYOUTS} axis layouts")
            shape = tuple(self.mesh.devices.shape)
            world = math.prod(shape[names.index(a)] for a in axes)
            if world > L.MAX_WORLD:
                raise ValueError(f"jaxtdist: a group of {world} ranks exceeds the maximum "
                                 f"{L.MAX_WORLD}")
            offset = _TEMPLATE_START + len(self._layouts) * L.CTX_WORDS * 8
            for pos in self.backend.positions:
                words = self._template(pos, axes, world).tobytes()
                self.backend.write(pos, offset, words)
                self.native.register_template(pos, offset, words)  # the prologue's copy
            layout = Layout(axes, world, offset)
            self._layouts[axes] = layout
            return layout

    def _template(self, pos: int, axes: tuple[str, ...], world: int) -> np.ndarray:
        names = tuple(self.mesh.axis_names)
        shape = tuple(self.mesh.devices.shape)
        coords = list(np.unravel_index(pos, shape))
        axis_ids = [names.index(a) for a in axes]
        rank = int(np.ravel_multi_index([coords[i] for i in axis_ids],
                                        [shape[i] for i in axis_ids]))
        words = np.zeros(L.CTX_WORDS, np.int64)
        words[L.CTX_RANK] = rank
        words[L.CTX_WORLD] = world
        words[L.CTX_WAIT_TIMEOUT_NS] = int(self.wait_timeout_s * 1e9)
        words[L.CTX_ERR_ADDR] = self.backend.error_record(pos)
        words[L.CTX_HEAP_BASE] = self.backend.base_of(pos)
        words[L.CTX_POSITION] = pos
        words[L.CTX_SCRATCH_ADDR] = self.backend.scratch(pos)
        for r, member in enumerate(self._group_of(pos, axes)):
            words[L.CTX_PEER_BASES + r] = self.backend.base_of(member)
        return words

    def _group_of(self, pos: int, axes: tuple[str, ...]) -> list[int]:
        """Mesh positions of ``pos``'s group over ``axes``, in rank order."""
        names = tuple(self.mesh.axis_names)
        shape = tuple(self.mesh.devices.shape)
        coords = list(np.unravel_index(pos, shape))
        axis_ids = [names.index(a) for a in axes]
        members = []
        for r in range(math.prod(shape[i] for i in axis_ids)):
            member = list(coords)
            for i, c in zip(axis_ids, np.unravel_index(r, [shape[i] for i in axis_ids])):
                member[i] = int(c)
            members.append(int(np.ravel_multi_index(member, shape)))
        return members

    def group_table(self, layout: Layout) -> np.ndarray:
        """int64 [positions * world]: row ``pos`` lists ``pos``'s group in rank order
        (for native handlers, which see only their device's mesh position)."""
        return np.array([self._group_of(pos, layout.axes)
                         for pos in range(self.mesh.devices.size)], np.int64).reshape(-1)

    # -- workspaces -----------------------------------------------------------

    def workspace(self, key: tuple, nbytes: int) -> Workspace:
        """A symmetric workspace for ``key``, allocated once and reused by every call."""
        with self._lock:
            ws = self._workspaces.get(key)
            if ws is not None:
                return ws
            nbytes = max(_ALIGN, -(-int(nbytes) // _ALIGN) * _ALIGN)
            available = self.heap_bytes - self._next_offset
            if nbytes > available:
                raise HeapExhaustedError(
                    f"jaxtdist: the symmetric heap is exhausted: {key[0]} needs a workspace of "
                    f"{nbytes} bytes but {available} of {self.heap_bytes} bytes are free "
                    f"({len(self._workspaces)} workspaces allocated{self._usage()}). Raise the "
                    f"heap with jaxtdist.initialize(mesh, heap_bytes=...) (at least "
                    f"{self._next_offset + nbytes} bytes). Each shape an op is called with "
                    f"keeps its own workspace for the runtime's life: a program called with "
                    f"many batch sizes or lengths needs fewer if they are padded to a few "
                    f"buckets.")
            ws = Workspace(key, self._next_offset, nbytes, len(self._workspaces) + 1)
            self._next_offset += nbytes
            self._workspaces[key] = ws
            return ws

    def _usage(self) -> str:
        """``: <name> <count> x <mean size>, ...``: the workspaces in use by name,
        largest total first (what an exhausted heap's error lists)."""
        by_name: dict[str, list[int]] = {}
        for key, ws in self._workspaces.items():
            by_name.setdefault(str(key[0]), []).append(ws.nbytes)
        if not by_name:
            return ""
        def size(n: float) -> str:
            return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"

        ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))
        return ": " + ", ".join(f"{name} {len(sizes)} x {size(sum(sizes) / len(sizes))}"
                                for name, sizes in ranked[:4]) + (", ..." if len(ranked) > 4
                                                                  else "")

    @property
    def bytes_in_use(self) -> int:
        return self._next_offset

    # -- errors ---------------------------------------------------------------

    def check_errors(self) -> None:
        """Raises ``WaitTimeoutError`` if any kernel's wait has timed out."""
        for pos in self.backend.positions:
            message = self.native.recorded_timeout(pos)
            if message:
                raise WaitTimeoutError(message.replace("in an earlier call ", ""))

    def is_current(self) -> bool:
        """Whether this is still the process's runtime (no ``shutdown()`` or other
        ``initialize`` since): backends ask it from launch callbacks, which must not
        run for a runtime that is gone, without importing this module."""
        return _RUNTIME is self

    def close(self) -> None:
        self.native.reset(0)
        self.backend.close()


_RUNTIME: Runtime | None = None
_RUNTIME_LOCK = threading.Lock()
_GENERATION = 0  # counts runtimes: programs traced for an older one are refused


def initialize(mesh, *, heap_bytes: int | None = None, wait_timeout_s: float | None = None,
               align_launches: bool | None = None, launcher: str | None = None,
               bootstrap_timeout_s: float | None = None) -> Runtime:
    """Creates the symmetric heap for ``mesh``; jaxtdist ops need it.

    Args:
      mesh: the ``jax.sharding.Mesh`` whose axes collectives name. Ranks and
        peer tables are per group of each collective's axes.
      heap_bytes: bytes of symmetric heap per device (default 1 GiB on GPUs,
        32 MiB on CPU), rounded up to a multiple of 4 KiB. Workspaces are carved
        out of it.
      wait_timeout_s: seconds a kernel's wait spins before it gives up and reports
        a ``WaitTimeoutError`` naming rank, peer and signal (default 300 s on CPU
        and GPU: long enough for a legitimately late peer; tests use seconds).
      align_launches: on GPUs (default True), the host threads that launch one
        collective's kernels on the group's devices meet just before the
        launch, as XLA's own collectives do, so that no device's kernel waits
        long for a peer that was launched late. Changing only this setting
        keeps the runtime and compiled programs. Off in a mesh spanning
        processes (the threads to meet are in other processes).
      launcher: who launches Triton kernels on GPUs: "native" (default,
        jaxtdist's FFI handler) or "jax-triton" (jaxlib's Triton custom call).
        Read when ops are traced; changing only this setting keeps the
        runtime, and programs traced before keep their launcher.
      bootstrap_timeout_s: for a mesh spanning processes (``jax.distributed``),
        seconds this call waits for the other processes to set up their part of
        the heap before it raises an error naming the missing ones (default
        ``$JAXTDIST_BOOTSTRAP_TIMEOUT_S``, else 300 s). Every process of the mesh
        must call ``initialize`` with the same mesh and settings.

    Returns:
      The runtime. Calling it again with the same mesh returns the existing
      runtime; with another mesh (or other settings), it replaces it and
      clears JAX's compilation caches, since traced programs hold the old
      heap's offsets (a stale compiled program is refused with an error).

    Example:
      >>> mesh = jax.make_mesh((jax.device_count(),), ("tp",))
      >>> rt = jaxtdist.initialize(mesh)
    """
    global _RUNTIME
    _check_settings(mesh, heap_bytes, wait_timeout_s, align_launches, launcher,
                    bootstrap_timeout_s)
    with _RUNTIME_LOCK:
        if _RUNTIME is not None:
            same = (_RUNTIME.mesh == mesh
                    and (heap_bytes is None or _rounded_heap(heap_bytes) == _RUNTIME.heap_bytes)
                    and (bootstrap_timeout_s is None
                         or float(bootstrap_timeout_s) == _RUNTIME.bootstrap_timeout_s)
                    and (wait_timeout_s is None
                         or float(wait_timeout_s) == _RUNTIME.wait_timeout_s))
            if same:
                if align_launches is not None:
                    _RUNTIME.align_launches = align_launches
                if launcher is not None:
                    _RUNTIME.launcher = launcher
                return _RUNTIME
            _close_runtime(finish_in_flight=True)
        _RUNTIME = Runtime(mesh, heap_bytes, wait_timeout_s,
                           True if align_launches is None else align_launches,
                           launcher or "native", bootstrap_timeout_s)
        return _RUNTIME


def shutdown() -> None:
    """Waits for the programs still running, then frees the heap and stops
    interpreter workers. Safe to call twice."""
    _shutdown(finish_in_flight=True)


def _shutdown(finish_in_flight: bool) -> None:
    with _RUNTIME_LOCK:
        _close_runtime(finish_in_flight)


def _close_runtime(finish_in_flight: bool) -> None:
    """Closes the current runtime, if any (``_RUNTIME_LOCK`` held). Programs traced
    for it hold its offsets: JAX's caches are cleared so that they are retraced."""
    global _RUNTIME
    if _RUNTIME is not None:
        if finish_in_flight:
            _finish_programs_in_flight()
        _RUNTIME.close()
        _RUNTIME = None
        jax.clear_caches()


def _finish_programs_in_flight() -> None:
    """Waits until the programs already dispatched have run (their outputs are the
    live arrays), before their runtime goes: replaced under a running program,
    some devices' calls failed against the new runtime while the others went on
    into an XLA collective and waited there for ever (4 CPU devices: a hang, then
    XLA's abort), and on GPUs a kernel would read a freed heap. A program that
    failed leaves its error to whoever reads its outputs."""
    for array in jax.live_arrays():
        try:
            array.block_until_ready()
        except Exception:  # noqa: BLE001 - the program's error, not this call's
            pass


# Workers and shared memory must not outlive the process (at exit, without waiting
# for programs that may be waiting for a dead peer).
atexit.register(_shutdown, False)


def runtime() -> Runtime:
    """The current runtime; raises ``NotInitializedError`` before ``initialize``."""
    if _RUNTIME is None:
        raise NotInitializedError(
            "jaxtdist: the symmetric heap is not initialized. Call "
            "jaxtdist.initialize(mesh) with the mesh your shard_map uses before calling "
            "jaxtdist ops.")
    return _RUNTIME


def is_initialized() -> bool:
    return _RUNTIME is not None
