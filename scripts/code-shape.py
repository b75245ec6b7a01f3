#!/usr/bin/env python3
"""usage: scripts/code-shape.py [--json]

The shape figures the architecture issues are measured by: lines of Rust in `src/` and
`loader/src/`, functions over 80 lines and the longest one, import cycles between the
operator's top-level modules, the loader's and the Python client's modules.

Functions are found by their `fn` line and measured to the brace that closes them (strings,
chars and comments skipped); tests (`#[cfg(test)] mod tests`) count too, as code to read.
"""

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FN = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?fn\s+(\w+)")
LONG = 80


def strip(line, in_block):
    """`line` without strings, chars and comments; whether a block comment is still open."""
    out, i = [], 0
    while i < len(line):
        if in_block:
            end = line.find("*/", i)
            if end < 0:
                return "".join(out), True
            i, in_block = end + 2, False
            continue
        c = line[i]
        if line.startswith("//", i):
            break
        if line.startswith("/*", i):
            in_block, i = True, i + 2
            continue
        if c == '"':
            i += 1
            while i < len(line) and line[i] != '"':
                i += 2 if line[i] == "\\" else 1
            i += 1
            continue
        if c == "'" and re.match(r"'(\\.|[^\\'])'", line[i:]):
            i += len(re.match(r"'(\\.|[^\\'])'", line[i:]).group(0))
            continue
        out.append(c)
        i += 1
    return "".join(out), in_block


def functions(path):
    """(name, first line, length in lines) of every function in a Rust file."""
    lines = path.read_text().splitlines()
    clean, in_block = [], False
    for line in lines:
        text, in_block = strip(line, in_block)
        clean.append(text)
    found = []
    for start, line in enumerate(clean):
        m = FN.match(line)
        if not m:
            continue
        depth, opened = 0, False
        for end in range(start, len(clean)):
            for c in clean[end]:
                if c == "{":
                    depth, opened = depth + 1, True
                elif c == "}":
                    depth -= 1
                elif c == ";" and not opened and depth == 0:
                    break  # a declaration without a body (traits, extern)
            else:
                if opened and depth == 0:
                    found.append((m.group(6), start + 1, end - start + 1))
                    break
                continue
            break
    return found


def non_test_lines(path):
    """Lines of a Rust file before its test module (`#[cfg(test)]`)."""
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "#[cfg(test)]":
            return i
    return len(lines)


def rust_files(top):
    return sorted(p for p in (ROOT / top).rglob("*.rs"))


def module_of(path, top):
    rel = path.relative_to(ROOT / top).with_suffix("")
    return rel.parts[0]


def rust_cycles(top):
    """Cycles between a crate's top-level modules, from `use crate::<module>` lines."""
    edges = {}
    for path in rust_files(top):
        here = module_of(path, top)
        for there in re.findall(r"\bcrate::(\w+)", code_of(path)):
            module = (ROOT / top / f"{there}.rs").exists() or (ROOT / top / there).is_dir()
            if module and there != here:
                edges.setdefault(here, set()).add(there)
    return cycles(edges)


def code_of(path):
    """A Rust file without its comments and strings (doc links are no imports)."""
    out, in_block = [], False
    for line in path.read_text().splitlines():
        text, in_block = strip(line, in_block)
        out.append(text)
    return "\n".join(out)


def python_cycles():
    pkg = ROOT / "clients/python/src/stoker"
    edges = {}
    for path in sorted(pkg.glob("*.py")):
        here = path.stem
        for m in re.finditer(r"^\s*from\s+(?:stoker)?\.?(\w*)\s+import\s+(.*)$", path.read_text(), re.M):
            mod, names = m.group(1), m.group(2)
            targets = [mod] if mod else [n.strip().split(" ")[0] for n in names.split(",")]
            for there in targets:
                if there != here and (pkg / f"{there}.py").exists():
                    edges.setdefault(here, set()).add(there)
    return cycles(edges)


def cycles(edges):
    """Every elementary cycle's nodes, each once (as a sorted tuple), by DFS from each node."""
    found = set()

    def walk(start, node, path):
        for nxt in edges.get(node, ()):
            if nxt == start:
                found.add(tuple(sorted(path)))
            elif nxt not in path and nxt > start:
                walk(start, nxt, path + [nxt])

    for start in sorted(edges):
        walk(start, start, [start])
    return sorted(found)


def main():
    report = {}
    for top in ("src", "loader/src", "contract/src"):
        files = rust_files(top)
        fns = [(f"{p.relative_to(ROOT)}:{line} {name}", n) for p in files for name, line, n in functions(p)]
        long = sorted((f for f in fns if f[1] > LONG), key=lambda f: -f[1])
        report[top] = {
            "lines": sum(len(p.read_text().splitlines()) for p in files),
            "lines_outside_tests": sum(non_test_lines(p) for p in files),
            "functions": len(fns),
            f"over_{LONG}_lines": [f"{name} ({n})" for name, n in long],
            "longest": max(fns, key=lambda f: f[1], default=("", 0)),
        }
    report["src"]["module_cycles"] = rust_cycles("src")
    report["loader/src"]["module_cycles"] = rust_cycles("loader/src")
    report["clients/python"] = {"module_cycles": python_cycles()}
    if "--json" in sys.argv:
        print(json.dumps(report, indent=1))
        return
    for top, r in report.items():
        print(f"== {top}")
        for k, v in r.items():
            if isinstance(v, list) and v and k != "longest":
                print(f"  {k}: {len(v)}")
                for item in v:
                    print(f"    {item}")
            else:
                print(f"  {k}: {v}")


if __name__ == "__main__":
    main()
