"""The config cache: the config chosen for each (op, device, world size, shape, dtype).

Two layers: ``jaxtdist/tune/tuned_configs.json`` shipped inside the package
(configs only, measured on the machines named in the keys) and the user's
cache file, which takes precedence and which ``jaxtdist.tune`` writes. The
runtime owns one cache and reads the files once, so a second process start
pays no tuning cost for shapes tuned before. Each entry records the kernel
variant it runs; each file records the jaxtdist, Triton and JAX versions it
was measured with.
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

SHIPPED = pathlib.Path(__file__).parent.parent / "tune" / "tuned_configs.json"
FORMAT = 2


def cache_path() -> pathlib.Path:
    """``$JAXTDIST_TUNING_CACHE``, else ``$XDG_CACHE_HOME/jaxtdist/tuning.json``
    (``~/.cache/jaxtdist/tuning.json``)."""
    explicit = os.environ.get("JAXTDIST_TUNING_CACHE")
    if explicit:
        return pathlib.Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "jaxtdist" / "tuning.json"


def versions() -> dict:
    """The versions a measurement depends on, recorded with every cache file."""
    import jax
    import triton

    from jaxtdist._version import __version__
    return dict(jaxtdist=__version__, triton=triton.__version__, jax=jax.__version__)


def entry_key(op: str, device_kind: str, world: int, shape: tuple[int, ...], dtype) -> str:
    dims = "x".join(str(int(d)) for d in shape)
    return f"{op}|{device_kind}|world={int(world)}|{dims}|{np.dtype(dtype).name}"


def _read(path: pathlib.Path) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (FileNotFoundError, NotADirectoryError):  # no file (yet) at that path
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"jaxtdist: the tuning cache {path} is unreadable ({e}); delete it "
                         f"or point JAXTDIST_TUNING_CACHE elsewhere") from e
    def invalid(what: str) -> ValueError:
        return ValueError(f"jaxtdist: the tuning cache {path} is not a jaxtdist tuning cache "
                          f"({what}); delete it or point JAXTDIST_TUNING_CACHE elsewhere")

    if not isinstance(data, dict):
        raise invalid(f"a JSON {type(data).__name__}, not an object")
    if data.get("format") != FORMAT:
        return {}  # written by another jaxtdist version: ignore rather than misuse
    entries = data.get("entries", {})
    if not isinstance(entries, dict):
        raise invalid(f"its entries are a {type(entries).__name__}, not an object")
    for key, entry in entries.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("config"), dict)):
            raise invalid(f"entry {key!r} has no config object")
    return dict(entries)


class TuningCache:
    """Tuned configs for one device kind; owned by the runtime object.

    The tuner sits above the ops and the runtime: ``import jaxtdist.tune`` installs
    its autotune hook here (``install_autotune``), and a call that misses the cache
    asks it through ``autotuned`` (only under ``JAXTDIST_AUTOTUNE=1``).
    """

    # autotune(op, problem, axis_name) -> tuned config overrides or None: the tuner's.
    _autotune: Callable[[str, Any, Any], dict | None] | None = None

    @classmethod
    def install_autotune(cls, autotune: Callable[[str, Any, Any], dict | None]) -> None:
        """Makes ``autotune`` the tuner a cache miss asks (the last one installed wins)."""
        if not callable(autotune):
            raise ValueError(f"jaxtdist: the autotune hook must be callable, got {autotune!r}")
        cls._autotune = autotune

    def autotuned(self, op: str, problem, axis_name) -> dict | None:
        """The installed tuner's config for ``problem`` when ``JAXTDIST_AUTOTUNE=1``;
        else None (the call takes its defaults)."""
        if self._autotune is None or os.environ.get("JAXTDIST_AUTOTUNE") != "1":
            return None
        tuned = type(self)._autotune(op, problem, axis_name)
        return None if tuned is None else dict(tuned)

    def __init__(self, device_kind: str):
        self.device_kind = device_kind
        self._entries: dict | None = None
        self._sources: dict[str, str] = {}  # the file each entry came from
        self._lock = threading.Lock()

    def _load(self) -> dict:
        if self._entries is None:
            self._entries = {}
            for path in (SHIPPED, cache_path()):  # the user's file over the shipped one
                entries = _read(path)
                self._entries.update(entries)
                self._sources.update(dict.fromkeys(entries, str(path)))
        return self._entries

    def lookup(self, op: str, world: int, shape, dtype) -> dict | None:
        """The tuned config overrides for this call, or None if never tuned."""
        with self._lock:
            entry = self._load().get(entry_key(op, self.device_kind, world, shape, dtype))
        return None if entry is None else dict(entry["config"])

    def source(self, op: str, world: int, shape, dtype) -> str | None:
        """The file the tuned entry for this call came from (None: no entry)."""
        with self._lock:
            self._load()
            return self._sources.get(entry_key(op, self.device_kind, world, shape, dtype))

    def store(self, op: str, world: int, shape, dtype, config: dict, variant: str,
              details: dict | None = None) -> str:
        """Records ``config`` (its kernel ``variant``, and how it was chosen) in memory
        and in the cache file."""
        key = entry_key(op, self.device_kind, world, shape, dtype)
        entry = dict(config=dict(config), variant=variant, **(details or {}))
        path = cache_path()
        with self._lock:
            self._load()[key] = entry
            self._sources[key] = str(path)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                on_disk = _read(path)  # other processes may have added entries
                on_disk[key] = entry
                # Atomic replace: a concurrent reader sees the old or the new file.
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tuning.", suffix=".json")
                with os.fdopen(fd, "w") as f:
                    json.dump(dict(format=FORMAT, entries=on_disk, **versions()), f, indent=1,
                              sort_keys=True)
                os.replace(tmp, path)
            except OSError as e:
                raise OSError(e.errno, f"jaxtdist: cannot write the tuning cache {path} ({e}); "
                              f"the tuned config {dict(config)} for {key} is kept for this "
                              "process only: point JAXTDIST_TUNING_CACHE at a writable file, or "
                              "tune with save=False") from e
        return key
