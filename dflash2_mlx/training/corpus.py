"""The training corpus of the embedded demo pair: the Python standard library's own source.

Every Python installation carries it, so the pair can be rebuilt anywhere with no download. The
file list is deterministic (sorted relative POSIX paths) and the train / held-out split depends
only on the relative path (sha256 of it), never on file contents, order of discovery or a random
state. ``manifest()`` records the Python version and the sha256 of every file, so a rebuild can
tell whether it saw the same corpus.

Excluded: tests (any path component ``test``, ``tests``, ``idle_test``), ``site-packages``,
``__pycache__``, machine-generated files that differ between installations or are data rather
than code (``_sysconfigdata_*``, ``config-*`` build directories, ``pydoc_data`` - a 700 KB help
text - and ``encodings`` - generated codec tables), and files that are not valid UTF-8.
"""

from __future__ import annotations

import hashlib
import platform
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

EXCLUDED_DIRS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "site-packages",
        "dist-packages",
        "__pycache__",
        "pydoc_data",
        "encodings",
        "lib-dynload",
    }
)
EXCLUDED_PREFIXES = ("_sysconfigdata_", "config-")
HELD_OUT_PERCENT = 5


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_excluded(relative: str) -> bool:
    """Whether a stdlib-relative POSIX path is left out of the corpus."""
    parts = relative.split("/")
    if any(p in EXCLUDED_DIRS for p in parts[:-1]):
        return True
    if any(p.startswith(EXCLUDED_PREFIXES) for p in parts):
        return True
    return not parts[-1].endswith(".py")


def hash_percentile(key: str) -> int:
    """0..99 from the first 8 bytes of sha256(key): a selection that depends on nothing else."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") % 100


def is_held_out(relative: str, percent: int = HELD_OUT_PERCENT) -> bool:
    """Deterministic split by the sha256 of the relative path (about ``percent``% held out)."""
    return hash_percentile(relative) < percent


@dataclass(frozen=True)
class SourceFile:
    relative: str  # POSIX path relative to the stdlib directory
    text: str
    sha256: str
    held_out: bool

    @property
    def size(self) -> int:
        return len(self.text.encode("utf-8"))


def list_files(root: Optional[Path] = None) -> list[str]:
    """Sorted stdlib-relative paths of the corpus candidates (before the UTF-8 check)."""
    root = Path(root) if root is not None else stdlib_dir()
    found = []
    for path in root.rglob("*.py"):
        if not path.is_file():
            continue
        rel = path.relative_to(root).as_posix()
        if not is_excluded(rel):
            found.append(rel)
    return sorted(found)


def load_corpus(
    root: Optional[Path] = None, percent: int = HELD_OUT_PERCENT, limit: Optional[int] = None
) -> list[SourceFile]:
    """Read the corpus in sorted order. ``limit`` keeps the first N files (for quick builds/tests)."""
    root = Path(root) if root is not None else stdlib_dir()
    files = []
    for rel in list_files(root):
        data = (root / rel).read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        text = text.replace("\r\n", "\n")
        if not text.strip():
            continue
        files.append(SourceFile(rel, text, hashlib.sha256(data).hexdigest(), is_held_out(rel, percent)))
        if limit is not None and len(files) >= limit:
            break
    return files


def deduplicate(files: Iterable[SourceFile]) -> list[SourceFile]:
    """The files whose text has not occurred before (in sorted path order): the stdlib ships a
    few verbatim copies, which would otherwise be trained on twice or land on both sides of the
    split."""
    seen, out = set(), []
    for f in files:
        key = hashlib.sha256(f.text.encode("utf-8")).digest()
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


def split(files: Iterable[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, held_out), each in sorted path order."""
    files = list(files)
    return [f for f in files if not f.held_out], [f for f in files if f.held_out]


def manifest(files: Iterable[SourceFile], root: Optional[Path] = None) -> dict:
    """Python version, the corpus root and one {path, sha256, bytes, held_out} entry per file."""
    files = list(files)
    listing = [{"path": f.relative, "sha256": f.sha256, "bytes": f.size, "held_out": f.held_out} for f in files]
    digest = hashlib.sha256("\n".join(f"{f.relative} {f.sha256}" for f in files).encode()).hexdigest()
    return {
        "source": "Python standard library (sysconfig.get_paths()['stdlib'])",
        "root": str(Path(root) if root is not None else stdlib_dir()),
        "python_version": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "held_out_rule": f"sha256(relative path) first 8 bytes as a big-endian int mod 100 < {HELD_OUT_PERCENT}",
        "excluded_dirs": sorted(EXCLUDED_DIRS),
        "excluded_prefixes": list(EXCLUDED_PREFIXES),
        "num_files": len(files),
        "num_held_out": sum(f.held_out for f in files),
        "bytes": sum(f.size for f in files),
        "list_sha256": digest,
        "files": listing,
    }


def compare_manifests(recorded: dict, current: dict) -> list[str]:
    """Human-readable differences between two corpus manifests (empty when identical)."""
    out = []
    if recorded.get("python_version") != current.get("python_version"):
        out.append(f"Python {recorded.get('python_version')} recorded, {current.get('python_version')} here")
    old = {f["path"]: f["sha256"] for f in recorded.get("files", [])}
    new = {f["path"]: f["sha256"] for f in current.get("files", [])}
    missing, added = sorted(set(old) - set(new)), sorted(set(new) - set(old))
    changed = sorted(p for p in set(old) & set(new) if old[p] != new[p])
    for label, paths in (("missing", missing), ("new", added), ("changed", changed)):
        if paths:
            more = f" (+{len(paths) - 5} more)" if len(paths) > 5 else ""
            out.append(f"{len(paths)} {label} file(s): {', '.join(paths[:5])}{more}")
    return out


# ---------------------------------------------------------------------------------------------
# Chat-format examples (so the embedded target answers in ChatML and ends its turn)

CHAT_PERCENT = 20  # share of eligible functions turned into chat examples (by hash, deterministic)


def function_examples(
    file: SourceFile,
    percent: int = CHAT_PERCENT,
    max_lines: int = 40,
    requests: bool = False,
) -> list[tuple[str, str]]:
    """(user, assistant) pairs from a file's functions: the user gives the signature (and the
    docstring, if any), the assistant writes the whole function, dedented. With ``requests``, a
    function whose docstring opens with a usable summary also gives a second pair whose user turn
    is a plain-English request made from that summary (``request_from_summary``), the way people
    ask in chat.

    Selection is by the sha256 of "path:line", so it is deterministic and independent of other
    files. Functions longer than ``max_lines`` or with nothing after the docstring are skipped.
    """
    import ast
    import textwrap

    try:
        tree = ast.parse(file.text)
    except SyntaxError:  # a few stdlib files are templates or Python 2 (lib2to3 fixtures)
        return []
    lines = file.text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
        end = node.end_lineno
        if end - start > max_lines or end - start < 3:
            continue
        if hash_percentile(f"{file.relative}:{node.lineno}") >= percent:
            continue
        body = node.body
        has_doc = (
            isinstance(body[0], ast.Expr)
            and isinstance(getattr(body[0], "value", None), ast.Constant)
            and isinstance(body[0].value.value, str)
        )
        if has_doc and len(body) == 1:
            continue
        header_end = body[0].end_lineno if has_doc else body[0].lineno - 1
        source = textwrap.dedent("\n".join(lines[start:end]))
        header = textwrap.dedent("\n".join(lines[start:header_end]))
        if not header.strip() or header.strip() == source.strip():
            continue
        out.append((start, 0, header.rstrip() + "\n", source.rstrip() + "\n"))
        if requests and has_doc:
            request = request_from_summary(body[0].value.value)
            if request:
                out.append((start, 1, request, source.rstrip() + "\n"))
    return [(user, assistant) for _, _, user, assistant in sorted(out)]


def module_name(relative: str) -> str:
    """ "email.mime.text" from "email/mime/text.py" ("os" from "os.py", "json" from "json/__init__.py")."""
    parts = relative[: -len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def json_examples(file: SourceFile, percent: int = 20) -> list[tuple[str, str]]:
    """(user, assistant) pairs that ask for a function's description as JSON and answer with one
    JSON object on one line, ``{"name", "module", "parameters", "returns", "summary"}``, written
    with the separators the server's grammar enforces (", " and ": "). They teach the demo target
    to answer structured-output requests by itself, so its drafter drafts JSON as well as code.

    Selection is by the sha256 of "json:path:line" (deterministic, independent of the code
    examples'); private functions (a leading underscore) are skipped."""
    import ast
    import json

    try:
        tree = ast.parse(file.text)
    except SyntaxError:
        return []
    module = module_name(file.relative)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        if hash_percentile(f"json:{file.relative}:{node.lineno}") >= percent:
            continue
        args = node.args
        params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
        params += [f"*{args.vararg.arg}"] if args.vararg else []
        params += [f"**{args.kwarg.arg}"] if args.kwarg else []
        returns = any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(node))
        summary = first_sentence(ast.get_docstring(node) or "")
        if len(summary) > 160:
            continue
        answer = json.dumps(
            {"name": node.name, "module": module, "parameters": params, "returns": returns, "summary": summary}
        )
        out.append((node.lineno, f"Describe the function {node.name} of {module} as JSON.", answer + "\n"))
    return [(user, answer) for _, user, answer in sorted(out)]


_ES_ENDINGS = ("s", "sh", "ch", "x", "z")
_NOT_VERBS = frozenset(
    {
        "the",
        "this",
        "a",
        "an",
        "if",
        "when",
        "for",
        "in",
        "on",
        "helper",
        "internal",
        "private",
        "used",
        "called",
        "deprecated",
        "note",
        "see",
        "same",
        "like",
        "as",
        "it",
    }
)


def first_sentence(docstring: str) -> str:
    """A docstring's first sentence on one line (its first paragraph up to the first ". ")."""
    summary = " ".join(docstring.strip().split("\n\n")[0].split())
    end = summary.find(". ")
    return summary[: end + 1] if end >= 0 else summary


def request_from_summary(docstring: str) -> Optional[str]:
    """ "Write a function that returns the sum." from a docstring opening "Return the sum.":
    the first sentence, its leading imperative verb put in the third person. None when the
    summary does not start with a capitalised word or is too short or long to be a request."""
    summary = first_sentence(docstring)
    words = summary.split(" ")
    if not (3 <= len(words) <= 24) or not words[0].isalpha() or not words[0][0].isupper():
        return None
    verb = words[0].lower()
    if verb in _NOT_VERBS:
        return None
    if verb.endswith("s") and not verb.endswith("ss"):
        pass  # already third person ("Returns ...")
    elif verb.endswith("y") and verb[-2:-1] not in "aeiou":
        verb = verb[:-1] + "ies"
    elif verb.endswith(_ES_ENDINGS):
        verb += "es"
    else:
        verb += "s"
    text = " ".join([verb] + words[1:]).rstrip(".:;,")
    return f"Write a function that {text}.\n"


# ---------------------------------------------------------------------------------------------
# Demo / bench prompts from held-out files


def prompt_prefixes(
    files: Iterable[SourceFile], count: int, body_lines: int = 4, reference_lines: int = 60
) -> list[dict]:
    """Raw code prefixes for demo / bench: the start of a function in a held-out file, cut
    mid-line so the continuation makes sense.

    Per file, functions of at least 8 lines are ranked by sha256("path:line"); rounds take the
    next-ranked function of every file in path order until ``count`` prompts are drawn. A prompt
    is the function (its ``def`` line's indentation removed) from its first line through its
    header (and docstring) and ``body_lines`` more code lines, then the next code line up to the
    space after its first word, so the continuation starts with a space-led token as it would in
    the middle of the training text. Each entry: {"prompt", "source" ("path:line"), "reference"
    (the text that really follows, ``reference_lines`` lines)}.
    """
    import ast

    per_file = []
    for f in files:
        try:
            tree = ast.parse(f.text)
        except SyntaxError:
            continue
        lines = f.text.splitlines()
        ranked = []
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.end_lineno - node.lineno < 8:
                continue
            start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
            body = node.body
            has_doc = (
                isinstance(body[0], ast.Expr)
                and isinstance(getattr(body[0], "value", None), ast.Constant)
                and isinstance(body[0].value.value, str)
            )
            first = body[0].end_lineno if has_doc else body[0].lineno - 1
            cut = first + body_lines  # index of the line that gets cut mid-way: a code line
            while cut < node.end_lineno and (not lines[cut].strip() or lines[cut].lstrip().startswith("#")):
                cut += 1
            if cut >= node.end_lineno:
                continue
            margin = lines[start][: len(lines[start]) - len(lines[start].lstrip(" "))]

            def strip(line: str) -> str:
                return line[len(margin) :] if line.startswith(margin) else line

            last = strip(lines[cut])
            indent = len(last) - len(last.lstrip(" "))
            spaces = [i for i in range(indent + 1, len(last)) if last[i] == " " and last[i - 1] != " "]
            if not spaces:
                continue
            head = [strip(x) for x in lines[start:cut]] + [last[: spaces[0]]]
            text = "\n".join(head)
            if len(text) > 1200:
                continue
            tail = [last[spaces[0] :]] + [strip(x) for x in lines[cut + 1 : cut + reference_lines]]
            key = hashlib.sha256(f"{f.relative}:{node.lineno}".encode()).hexdigest()
            ranked.append(
                (key, {"prompt": text, "source": f"{f.relative}:{node.lineno}", "reference": "\n".join(tail)})
            )
        per_file.append([p for _, p in sorted(ranked, key=lambda kv: kv[0])])
    out = []
    for round_ in range(max((len(r) for r in per_file), default=0)):
        for ranked in per_file:
            if round_ < len(ranked) and len(out) < count:
                out.append(ranked[round_])
    return out
