"""csrc/sources.bzl is the one source list of both native builds (csrc/BUILD
loads it, csrc/CMakeLists.txt parses it): every C++ file in csrc/ is in it,
once, in the plain form CMake's parser reads."""

from __future__ import annotations

import ast
import pathlib
import re

CSRC = pathlib.Path(__file__).resolve().parents[1] / "csrc"


def _lists() -> dict[str, list[str]]:
    text = (CSRC / "sources.bzl").read_text()
    tree = ast.parse(text)  # the file is plain Starlark assignments of string lists
    lists = {}
    for node in tree.body:
        assert isinstance(node, ast.Assign), ast.dump(node)
        lists[node.targets[0].id] = ast.literal_eval(node.value)
    # What CMake's jaxtdist_source_list() matches: "\nNAME = [" ... "]".
    for name, files in lists.items():
        block = re.search(rf"\n{name} = \[[^\]]*\]", text)
        assert block and re.findall(r'"([^"]+)"', block.group(0)) == files, name
    return lists


def test_every_csrc_file_is_listed_once():
    lists = _lists()
    assert set(lists) == {"COMMON_SRCS", "COMMON_HDRS", "CUDA_SRCS", "CUDA_HDRS"}
    listed = [f for files in lists.values() for f in files]
    assert len(listed) == len(set(listed)), "a file is listed twice"
    on_disk = {p.name for p in CSRC.iterdir() if p.suffix in (".cc", ".h")}
    assert set(listed) == on_disk, (set(listed) ^ on_disk)
    for name, files in lists.items():
        suffix = ".cc" if name.endswith("SRCS") else ".h"
        assert all(f.endswith(suffix) for f in files), name


def test_both_builds_read_the_list():
    assert 'load(":sources.bzl"' in (CSRC / "BUILD").read_text()
    cmake = (CSRC / "CMakeLists.txt").read_text()
    assert "sources.bzl" in cmake
    assert not re.search(r"\w+\.cc\b", cmake), "CMakeLists.txt names a source of its own"
