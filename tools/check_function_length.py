#!/usr/bin/env python3
"""Lists functions of the libraries, examples and benchmarks longer than a limit (default 80 lines).

Crude on purpose: comments, string and character literals are blanked, then
braces are counted. A `{` outside any function whose header (the text since
the previous `;`, `{` or `}`) has a parameter list opens a function;
namespace, class, struct, union and enum bodies are scopes whose functions
are counted one by one; everything inside a function (lambdas, local
classes) belongs to it. A function's length runs from the line of its name
to the line of its closing brace.

  tools/check_function_length.py [--max N] [--allow PATH:NAME ...] FILE_OR_DIR...

Directories are searched for *.cc, skipping tests/ (users copy examples, so they are read).
Prints one line per function over the limit ("PATH:LINE NAME N lines") and
exits 1 when one is not allowed, or when an allowed one is no longer over
the limit (so the list of exceptions stays true). Exceptions are justified
in a comment at the function.
"""

import argparse
import os
import re
import sys

SKIP_DIRS = {"tests", "third_party", ".git"}
SCOPE_RE = re.compile(r"\b(namespace|class|struct|union|enum)\b|\bextern\s*\"C\"")
NAME_RE = re.compile(r"((?:[A-Za-z_~][A-Za-z_0-9]*\s*::\s*)*(?:operator\s*[^\s(]+|~?[A-Za-z_][A-Za-z_0-9]*))\s*$")


def blank_comments_and_literals(text):
    """Replaces comments and literals by spaces, keeping newlines."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            k = text.find("(", i)
            delim = ")" + text[i + 2:k] + '"'
            j = text.find(delim, k)
            j = n if j < 0 else j + len(delim)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isalnum():  # digit separator: 1'000
                out.append(" ")
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(" " * (min(j + 1, n) - i))
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def functions(path):
    """Yields (name, first_line, last_line) of each function in `path`."""
    with open(path, encoding="utf-8") as f:
        text = blank_comments_and_literals(f.read())
    text = re.sub(r"(?m)^[ \t]*#.*$", "", text)  # preprocessor lines
    stack = []  # "scope" or "other"; a function is not pushed (depth_in_function counts inside it)
    header_start = 0
    depth_in_function = 0
    skip_depth = 0  # inside a brace initialiser in a header (f(T{}) or a member's x_{...})
    function = None  # (name, first line)
    line = 1
    for i, c in enumerate(text):
        if c == "\n":
            line += 1
        if depth_in_function or skip_depth:
            depth = 1 if c == "{" else -1 if c == "}" else 0
            if skip_depth:
                skip_depth += depth
            else:
                depth_in_function += depth
                if depth_in_function == 0:
                    yield function[0], function[1], line
                    header_start = i + 1
            continue
        if c == "{":
            header = text[header_start:i]
            before = header.rstrip()
            if header.count("(") > header.count(")") or (
                    re.search(r"\)\s*:(?!:)", header) and header.endswith(before[-1:]) and
                    re.match(r"[A-Za-z_0-9>]", before[-1:] or " ")):
                skip_depth = 1  # not a block: an argument's or a member initialiser's braces
            elif SCOPE_RE.search(header) and "(" not in header:
                stack.append("scope")
            elif ")" in header and "=" not in header.split("(")[0]:
                bare = header
                while re.search(r"<[^<>()]*>", bare):  # template arguments: std::function<void()> F(
                    bare = re.sub(r"<[^<>()]*>", "", bare)
                bare = re.sub(r"<[^<>]*>", "", bare)
                m = NAME_RE.search(bare[:bare.find("(")])
                name = re.sub(r"\s+", "", m.group(1)) if m else "?"
                start = header_start + (header.find(m.group(1)) if m else 0)
                function = (name, line - text[start:i].count("\n"))
                depth_in_function = 1
            else:
                stack.append("other")
                header_start = i + 1
        elif c == "}":
            if stack:
                stack.pop()
            header_start = i + 1
        elif c == ";":
            header_start = i + 1


def sources(paths):
    for p in paths:
        if os.path.isfile(p):
            yield p
            continue
        if not any(f.endswith(".cc") for _, _, fs in os.walk(p) for f in fs):
            sys.exit(f"no .cc file under '{p}': a wrong path, or (under Bazel) the sources are not in data")
        for root, dirs, files in os.walk(p):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
            for f in sorted(files):
                if f.endswith(".cc"):
                    yield os.path.join(root, f)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max", type=int, default=80, help="longest allowed function, in lines (default 80)")
    ap.add_argument("--allow", action="append", default=[], metavar="PATH:NAME",
                    help="a function allowed to be longer (justified in a comment at it)")
    ap.add_argument("paths", nargs="+")
    args = ap.parse_args(argv)
    allowed = set(args.allow)
    seen_allowed = set()
    failed = False
    for path in sources(args.paths):
        rel = os.path.normpath(path)
        for name, first, last in functions(path):
            lines = last - first + 1
            if lines <= args.max:
                continue
            key = f"{rel}:{name}"
            if key in allowed:
                seen_allowed.add(key)
                print(f"{rel}:{first} {name} {lines} lines (allowed)")
            else:
                failed = True
                print(f"{rel}:{first} {name} {lines} lines: over {args.max}; split it by what it does, "
                      f"or justify it in a comment and add --allow {key}")
    for key in sorted(allowed - seen_allowed):
        failed = True
        print(f"{key}: allowed to be over {args.max} lines but is not (or is gone); remove --allow {key}")
    if not failed:
        print(f"no function over {args.max} lines outside the allowed ones")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
