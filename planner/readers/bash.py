"""Evaluate a launch script the way bash would, without running it.

The script is parsed by tree-sitter's bash grammar (``tree-sitter-bash``, the grammar GitHub and
editors use); this module walks the tree and performs bash's expansions on it: variables and
``${NAME:-default}`` forms, arrays (``A=(...)``, ``A+=(...)``, ``"${A[@]}"``, ``${A[@]}``),
``$((...))`` arithmetic, quoting, word splitting of unquoted expansions (bash manual, "Shell
Expansions"), here-documents written to files (``cat <<EOF > ds_config.json``) and functions.
Nothing is executed and the environment is never read, so a check gives the same answer everywhere:

* the script is taken as run with no arguments (``$#`` is 0, ``${1:-x}`` is ``x``);
* a variable the script never sets comes from the environment: its value is unknown, except that
  ``${NAME:-default}`` takes the default; Slurm's own variables (``SLURM_NNODES``, ...) are set from
  the ``#SBATCH`` lines as sbatch sets them (sbatch(1), "OUTPUT ENVIRONMENT VARIABLES");
* ``$(...)`` and backquotes are unknown (they would run a command);
* an ``if``/``case``/``while`` whose condition depends on an unknown value (or on a file test) is
  evaluated once per branch: each branch yields its own :class:`World`, labelled with the branch
  taken. A branch that runs ``exit`` is kept (with ``exited``) so callers can drop it.

Unknown text is carried inside words between ``UNKNOWN_OPEN`` and ``UNKNOWN_CLOSE`` with its source
(e.g. ``$DATA_PATH``), so a reader can say which value it could not tell.
"""

from __future__ import annotations

import copy
import fnmatch
import re
from dataclasses import dataclass, field
from functools import lru_cache

from planner.presets import SpecError
from planner.readers.bash_expand import UNKNOWN_CLOSE, UNKNOWN_OPEN, Expander, _int, is_unknown, unknown, unknown_sources

__all__ = ["Command", "World", "evaluate", "is_unknown", "parse", "sbatch_env", "unknown", "unknown_sources"]

MAX_WORLDS = 32          # branch combinations evaluated before the script is refused
MAX_LOOP_ITERATIONS = 256
MAX_DEPTH = 16           # nested functions / eval / bash -c


@dataclass
class Command:
    argv: list[str]
    line: int
    lines: list[int] = field(default_factory=list)  # the source line of each word
    env: dict = field(default_factory=dict)  # the variables the script has set when the command runs, and its prefix


@dataclass
class World:
    """One way the script can run: variables, the commands it runs and the files it writes."""

    env: dict = field(default_factory=dict)          # name -> str | list[str]
    lines: dict = field(default_factory=dict)        # name -> line of the value | lines of the items
    commands: list[Command] = field(default_factory=list)
    files: dict = field(default_factory=dict)        # path -> text written by a here-document
    branch: list[str] = field(default_factory=list)  # the branches taken, e.g. "line 12: case $SIZE in 70b)"
    functions: dict = field(default_factory=dict)
    environment: set = field(default_factory=set)    # variables whose value the environment can change
    positional: list[str] = field(default_factory=list)
    exited: bool = False
    exit_line: int = 0

    def fork(self, label: str) -> World:
        new = copy.copy(self)
        new.env = dict(self.env)
        new.lines = dict(self.lines)
        new.commands = list(self.commands)
        new.files = dict(self.files)
        new.branch = self.branch + [label]
        new.functions = dict(self.functions)
        new.environment = set(self.environment)
        return new


@lru_cache(maxsize=1)
def _parser():
    try:
        import tree_sitter_bash
        from tree_sitter import Language, Parser
    except ImportError as err:
        raise SpecError(f"reading shell scripts needs the tree-sitter and tree-sitter-bash packages ({err.name} is "
                        "missing); reinstall plan3d with its dependencies") from None

    return Parser(Language(tree_sitter_bash.language()))


_SUBSTRING = re.compile(r"\$\{[A-Za-z_]\w*:(?![-=+?])([^{}]*)\}")


def _closed(text: str) -> str:
    """Text bash accepts that tree-sitter-bash 0.25 reports as an error, rewritten to the same meaning:

    * a backslash-newline at the end of the file (bash removes it; the command ends there): a newline
      is added after it;
    * ``${A:$K+1}``, a substring whose offset/length names a variable with ``$``: the offset is an
      arithmetic expression, where ``$K`` and ``K`` are the same value (bash manual, "Shell Arithmetic"),
      so the ``$`` is dropped (``${A:K+1}`` parses).
    """
    def bare(m):
        return m.group(0) if "$" not in m.group(1) else \
            m.group(0).replace(m.group(1), re.sub(r"\$\{?([A-Za-z_]\w*)\}?", r"\1", m.group(1)))

    text = _braced(_SUBSTRING.sub(bare, text))
    return text + "\n" if re.search(r"\\\n[ \t]*\Z", text) else text


def _braced(text: str) -> str:
    """``${A}/$B/x`` unquoted: tree-sitter-bash 0.25 ends the word at ``/$`` and reads ``B/x`` as the next word
    (or, after ``X=``, as a command). In an unquoted word that already holds a ``${...}``, ``$B`` is written
    ``${B}``, the same expansion (bash manual, "Shell Parameter Expansion"); quoted text and comments are
    left alone."""
    out, i, n = [], 0, len(text)
    state, word_has_brace = "plain", False
    while i < n:
        c = text[i]
        if state == "single":
            out.append(c)
            state = "plain" if c == "'" else state
        elif state == "double":
            out.append(c)
            if c == "\\" and i + 1 < n:
                out.append(text[i + 1])
                i += 1
            elif c == '"':
                state = "plain"
        elif c == "\\" and i + 1 < n:
            out.append(text[i:i + 2])
            i += 1
        elif c == "'":
            out.append(c)
            state = "single"
        elif c == '"':
            out.append(c)
            state = "double"
        elif c == "#" and (i == 0 or text[i - 1] in " \t\n;"):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append(text[i:end])
            i = end - 1
        elif c in " \t\n;|&()<>`":
            out.append(c)
            word_has_brace = False
        elif c == "$" and text.startswith("${", i):
            word_has_brace = True
            out.append(c)
        elif c == "$" and word_has_brace and (m := re.match(r"\$([A-Za-z_]\w*)", text[i:])):
            out.append("${" + m.group(1) + "}")
            i += len(m.group(0)) - 1
        else:
            out.append(c)
        i += 1
    return "".join(out)


def parse(text: str, where: str):
    tree = _parser().parse(_closed(text).encode("utf-8"))
    if tree.root_node.has_error:
        bad = _first_error(tree.root_node)
        line = bad.start_point[0] + 1 if bad is not None else 1
        raise SpecError(f"{where}:{line}: not valid bash here (bash -n would reject it); fix the syntax")
    return tree


def _first_error(node):
    if node.type == "ERROR" or node.is_missing:
        return node
    for child in node.children:
        if child.has_error:
            found = _first_error(child)
            if found is not None:
                return found
    return None


def sbatch_env(sbatch: dict[str, str | None]) -> dict[str, str]:
    """The variables sbatch sets from its options (sbatch(1), OUTPUT ENVIRONMENT VARIABLES)."""
    env = {}
    nodes = sbatch.get("--nodes") or sbatch.get("-N")
    if nodes and nodes.isdigit():
        env["SLURM_NNODES"] = env["SLURM_JOB_NUM_NODES"] = nodes
    per_node = sbatch.get("--gpus-per-node")
    if per_node and per_node.split(":")[-1].isdigit():
        env["SLURM_GPUS_PER_NODE"] = env["SLURM_GPUS_ON_NODE"] = per_node.split(":")[-1]
    tasks = sbatch.get("--ntasks-per-node")
    if tasks and tasks.isdigit():
        env["SLURM_NTASKS_PER_NODE"] = tasks
        if nodes and nodes.isdigit():
            env["SLURM_NTASKS"] = str(int(nodes) * int(tasks))
    return env


class Evaluator(Expander):
    """Walks one script's tree; ``run`` returns every World the script can end in."""

    def __init__(self, text: str, where: str):
        self.text = _closed(text)
        self.src = self.text.encode("utf-8")
        self.where = where

    # --- statements ---------------------------------------------------------------------------
    def run(self, world: World) -> list[World]:
        tree = parse(self.text, self.where)
        return self.block(tree.root_node.children, [world], 0)

    def block(self, nodes, worlds: list[World], depth: int) -> list[World]:
        for node in nodes:
            if not node.is_named or node.type == "comment":
                continue
            out = []
            for w in worlds:
                out.extend([w] if w.exited else self.stmt(node, w, depth))
            if len(out) > MAX_WORLDS:
                raise SpecError(f"{self.where}:{self.line(node)}: more than {MAX_WORLDS} combinations of "
                                "if/case branches; check evaluates each branch, so split the script")
            worlds = out
        return worlds

    def stmt(self, node, w: World, depth: int) -> list[World]:
        t = node.type
        if t == "variable_assignment":
            self.assign(node, w, w.env)
            return [w]
        if t in ("variable_assignments", "declaration_command"):
            for child in node.named_children:
                if child.type == "variable_assignment":
                    self.assign(child, w, w.env)
            return [w]
        if t == "command":
            return self.command(node, w, depth)
        if t == "redirected_statement":
            body = node.child_by_field_name("body")
            self.heredocs(node, w)
            return self.stmt(body, w, depth) if body is not None else [w]
        if t == "list":
            return self.list_(node, w, depth)
        if t == "pipeline":
            return self.block(node.named_children, [w], depth)
        if t == "compound_statement" and node.children and node.children[0].type == "((":
            return self.arith_command(self.raw(node)[2:-2], node, w, depth)
        if t in ("subshell", "compound_statement", "do_group"):
            return self.block(node.named_children, [w], depth)
        if t == "if_statement":
            return self.if_(node, w, depth)
        if t == "case_statement":
            return self.case(node, w, depth)
        if t == "for_statement":
            return self.for_(node, w, depth)
        if t in ("while_statement", "until_statement"):
            return self.while_(node, w, depth)
        if t == "function_definition":
            name = node.child_by_field_name("name")
            w.functions[self.raw(name)] = node.child_by_field_name("body")
            return [w]
        if t == "c_style_for_statement":
            return self.c_for(node, w)
        if t == "negated_command":
            return self.block(node.named_children, [w], depth)
        return [w]  # test_command as a statement, (( )), unset, ...: no effect on the launch

    def c_for(self, node, w: World) -> list[World]:
        """``for (( i = 0; i < n; i++ ))``: not run. A loop that holds a launch (or a ``--flag``) is refused;
        otherwise the variables it assigns (Megatron-DeepSpeed's checkpoint-pointer loop over nodes) take an
        unknown value after it, since it may run any number of times."""
        body = self.raw(node)
        if " --" in body:
            raise SpecError(f"{self.where}:{self.line(node)}: a C-style for loop runs a command with flags; check "
                            "cannot evaluate it without running the script")
        names = set(re.findall(r"([A-Za-z_]\w*)\s*(?:[-+*/%]?=(?!=)|\+\+|--)", body.split(")")[0]))
        stack = [node]
        while stack:
            n = stack.pop()
            if n.type == "variable_assignment" and n.child_by_field_name("name") is not None:
                names.add(self.raw(n.child_by_field_name("name")).split("[")[0])
            stack.extend(n.children)
        for name in names:
            w.env[name] = unknown(f"the C-style for loop at line {self.line(node)}")
            w.environment.discard(name)
        return [w]

    def refuse_if_it_matters(self, node, w: World, what: str) -> list[World]:
        body = self.raw(node)
        if "=" in body or " --" in body:
            raise SpecError(f"{self.where}:{self.line(node)}: {what} sets variables or runs the launch; "
                            "check cannot evaluate it without running the script")
        return [w]

    def arith_command(self, text: str, node, w: World, depth: int) -> list[World]:
        """``(( N = N * 2 ))``, ``(( N++ ))``, ``let N=N+1``: the assignment, as ``N=$(( ... ))`` would do it.
        An arithmetic command that assigns in another form makes the variable unknown."""
        text = text.strip()
        m = re.fullmatch(r"([A-Za-z_]\w*)\s*([-+*/%]?)=\s*(.+)", text, flags=re.S)
        inc = re.fullmatch(r"(\+\+|--)?\s*([A-Za-z_]\w*)\s*(\+\+|--)?", text)
        if m:
            name, op, rhs = m.group(1), m.group(2), m.group(3)
            script = f"{name}=$(( {name} {op} ({rhs}) ))" if op else f"{name}=$(( {rhs} ))"
        elif inc and (inc.group(1) or inc.group(3)):
            name = inc.group(2)
            script = f"{name}=$(( {name} {'+' if '+' in (inc.group(1) or inc.group(3)) else '-'} 1 ))"
        else:
            for assigned in re.findall(r"([A-Za-z_]\w*)\s*(?:[-+*/%]?=(?!=)|\+\+|--)", text):
                w.env[assigned] = unknown(f"(( {text} ))")
            return [w]
        try:
            tree = parse(script, self.where)
        except SpecError:
            w.env[name] = unknown(f"(( {text} ))")
            return [w]
        sub = Evaluator(script, self.where)
        worlds = sub.block(tree.root_node.children, [w], depth + 1)
        for x in worlds:
            x.lines[name] = self.line(node)
        return worlds

    def list_(self, node, w: World, depth: int) -> list[World]:
        """``a && b`` runs both; ``a || b`` runs only ``a`` (commands are taken to succeed)."""
        kids = node.children
        worlds = self.stmt(kids[0], w, depth)
        i = 1
        while i + 1 < len(kids):
            op, right = kids[i].type, kids[i + 1]
            if op == "&&":
                worlds = self.block([right], worlds, depth)
            i += 2
        return worlds

    def assign(self, node, w: World, env: dict) -> None:
        name_node = node.child_by_field_name("name")
        value = node.child_by_field_name("value")
        append = any(c.type == "+=" for c in node.children)
        if name_node is None:
            return
        if name_node.type == "subscript":  # A[0]=x
            name = self.raw(name_node.child_by_field_name("name"))
            idx = self.arith_text(name_node.child_by_field_name("index"), w)
            arr = env.get(name, [])
            arr = list(arr) if isinstance(arr, list) else [arr]
            val = self.word(value, w, split=False)[0] if value is not None else ""
            if idx is not None and 0 <= idx < 1024:
                arr += [""] * (idx + 1 - len(arr))
                arr[idx] = val
                env[name] = arr
            return
        name = self.raw(name_node)
        if env is w.env:
            if value is not None and self.from_environment(value, w):
                w.environment.add(name)
            else:
                w.environment.discard(name)
        lines = w.lines if env is w.env else {}
        if value is not None and value.type == "array":
            items, item_lines = [], []
            for el in value.named_children:
                if el.type != "comment":
                    f = self.fields(el, w, split=True)
                    items += f.fields
                    item_lines += f.lines
            old, old_lines = env.get(name, []), lines.get(name, [])
            if append:
                items = (list(old) if isinstance(old, list) else [old]) + items
                item_lines = (list(old_lines) if isinstance(old_lines, list) else [old_lines]) + item_lines
            env[name], lines[name] = items, item_lines
            return
        val = "" if value is None else self.word(value, w, split=False)[0]
        if append:
            old = env.get(name, "")
            if isinstance(old, list):
                env[name] = old + [val]
                lines[name] = list(lines.get(name, [])) + [self.line(node)]
                return
            val = old + val
        env[name], lines[name] = val, self.line(node)

    def heredocs(self, node, w: World) -> None:
        """``cat <<EOF > path``: the here-document's text (expanded unless the delimiter is quoted) is
        recorded as the content of ``path``."""
        for redirect in node.children_by_field_name("redirect"):
            if redirect.type != "heredoc_redirect":
                continue
            body = next((c for c in redirect.children if c.type == "heredoc_body"), None)
            start = next((c for c in redirect.children if c.type == "heredoc_start"), None)
            target = None
            for c in redirect.children:
                if c.type == "file_redirect":
                    dest = c.child_by_field_name("destination")
                    if dest is not None and any(x.type in (">", ">>", ">|") for x in c.children):
                        target = self.word(dest, w, split=False)[0]
            if body is None or target is None:
                continue
            quoted = start is not None and any(q in self.raw(start) for q in "'\"\\")
            w.files[target] = self.raw(body) if quoted else self.pieces(body, w)

    def command(self, node, w: World, depth: int) -> list[World]:
        env_prefix = {}
        argv: list[str] = []
        lines: list[int] = []
        for child in node.children:
            if child.type == "variable_assignment":
                self.assign(child, w, env_prefix)
                continue
            if child.type == "command_name":
                child = child.named_children[0]
            elif not child.is_named or child.type in ("comment", "file_redirect", "herestring_redirect"):
                continue
            f = self.fields(child, w, split=True)
            argv += f.fields
            lines += f.lines
        if not argv:
            w.env.update(env_prefix)
            return [w]
        name = argv[0]
        if name == "exit":
            w.exited, w.exit_line = True, self.line(node)
            return [w]
        if name in ("export", "declare", "typeset", "local", "readonly"):
            return [w]
        if name == "let":
            worlds = [w]
            for expr in argv[1:]:
                worlds = [y for x in worlds for y in self.arith_command(expr, node, x, depth)]
            return worlds
        if name in ("source", ".") and len(argv) > 1 and depth < MAX_DEPTH:
            return self.source(argv[1], node, w, depth)
        if name in w.functions and depth < MAX_DEPTH:
            saved = w.positional
            w.positional = argv[1:]
            body = w.functions[name]
            worlds = self.block(body.named_children if body.type == "compound_statement" else [body], [w], depth + 1)
            for x in worlds:
                x.positional = saved
            return worlds
        w.commands.append(Command(argv=argv, line=self.line(node), lines=lines, env={**w.env, **env_prefix}))
        inner = _inline_script(argv)
        if inner is not None and depth < MAX_DEPTH:
            return self.inline(inner, w, depth, self.line(node))
        return [w]

    def inline(self, inner: str, w: World, depth: int, line: int) -> list[World]:
        """Runs the script of ``eval``/``bash -c``. Unknown pieces of it (``DIR=`pwd```, an unset variable)
        stand in as variables holding the unknown value, so ``eval "deepspeed ${DIR}/pretrain_gpt.py ..."``
        is read with only that path unknown."""
        holders = {}

        def hold(m):
            name = f"__plan3d_unknown_{len(holders)}"
            holders[name] = m.group(0)
            return "${" + name + "}"

        script = re.sub(f"{UNKNOWN_OPEN}.*?{UNKNOWN_CLOSE}", hold, inner, flags=re.S)
        w.env.update(holders)
        sub = Evaluator(script, self.where)
        sub.first_line = line
        worlds = sub.block(parse(script, self.where).root_node.children, [w], depth + 1)
        for x in worlds:
            for name in holders:
                x.env.pop(name, None)
        return worlds

    def source(self, name: str, node, w: World, depth: int) -> list[World]:
        """``source FILE`` / ``. FILE``: a file next to the script is read in the same World; one that is
        not there leaves its variables unknown (flags that use them say so)."""
        from pathlib import Path

        target = Path(name) if Path(name).is_absolute() else Path(self.where).parent / name
        if is_unknown(name) or not target.is_file() or target.stat().st_size > 1_000_000:
            return [w]
        try:
            text = target.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return [w]
        sub = Evaluator(text, str(target))
        return sub.block(parse(text, str(target)).root_node.children, [w], depth + 1)

    # --- branches -----------------------------------------------------------------------------
    def if_(self, node, w: World, depth: int) -> list[World]:
        clauses = []  # (condition nodes or None for else, body nodes, label)
        cond, body, state = [], [], "cond"
        for child in node.children:
            if child.type in ("if", ";"):
                continue
            if child.type == "then":
                state = "body"
            elif child.type in ("elif_clause", "else_clause"):
                pass
            elif child.type == "fi":
                break
            elif state == "cond":
                cond.append(child)
            elif child.is_named and child.type != "comment":
                body.append(child)
        clauses.append((cond, body, f"line {self.line(node)}: if {self.cond_text(cond)}"))
        for child in node.children:
            if child.type == "elif_clause":
                c, b, s = [], [], "cond"
                for x in child.children:
                    if x.type in ("elif", ";"):
                        continue
                    if x.type == "then":
                        s = "body"
                    elif s == "cond":
                        c.append(x)
                    elif x.is_named and x.type != "comment":
                        b.append(x)
                clauses.append((c, b, f"line {self.line(child)}: elif {self.cond_text(c)}"))
            elif child.type == "else_clause":
                b = [x for x in child.named_children if x.type != "comment"]
                clauses.append((None, b, f"line {self.line(child)}: else"))
        if clauses[-1][0] is not None:
            clauses.append((None, [], f"line {self.line(node)}: if {self.cond_text(clauses[0][0])} not taken"))
        return self.choose(clauses, w, depth)

    def cond_text(self, nodes) -> str:
        return " ".join(self.raw(n) for n in nodes if n.is_named)[:60]

    def choose(self, clauses, w: World, depth: int) -> list[World]:
        """Take the first clause whose condition holds; where a condition is unknown, fork: one World
        takes the clause, the rest go on to the next clause."""
        decided = ((True if cond is None else self.condition(cond, w), body, label) for cond, body, label in clauses)
        return self._take(decided, w, depth)

    def _take(self, decided, w: World, depth: int) -> list[World]:
        """Run the first clause that holds; a clause whose condition is unknown (None) forks: one World
        takes it, the rest go on. ``decided`` yields (True/False/None, body, label), lazily."""
        out, forked = [], False
        for value, body, label in decided:
            if value is False:
                continue
            if value is True:
                return out + self.block(body, [w.fork(label) if forked else w], depth)
            out.extend(self.block(body, [w.fork(label)], depth))
            forked = True
        return out

    def case(self, node, w: World, depth: int) -> list[World]:
        value_node = node.child_by_field_name("value")
        value = self.word(value_node, w, split=False)[0]
        clauses, all_patterns = [], []
        for item in node.children:
            if item.type != "case_item":
                continue
            patterns = [self.word(v, w, split=False)[0] for v in item.children_by_field_name("value")]
            all_patterns += patterns
            body, seen_paren = [], False
            for x in item.children:
                if x.type == ")":
                    seen_paren = True
                elif seen_paren and x.is_named and x.type != "comment" and x.type not in ("extglob_pattern",):
                    body.append(x)
            label = f"line {self.line(item)}: case {self.raw(value_node)} in {'|'.join(patterns)})"
            if is_unknown(value) or any(is_unknown(p) for p in patterns):
                match = None
            else:
                match = any(fnmatch.fnmatchcase(value, p) for p in patterns)
            clauses.append((match, body, label))
        catch_all = any(p == "*" for p in all_patterns)
        if not catch_all:
            clauses.append((None, [], f"line {self.line(node)}: no pattern of the case matches"))
        return self._take(clauses, w, depth)

    def for_(self, node, w: World, depth: int) -> list[World]:
        var = self.raw(node.child_by_field_name("variable"))
        values = node.children_by_field_name("value")
        items = [x for v in values for x in self.word(v, w, split=True)] if values else list(w.positional)
        body = node.child_by_field_name("body")
        if any(is_unknown(x) for x in items) or len(items) > MAX_LOOP_ITERATIONS:
            return self.refuse_if_it_matters(body, w, f"the for loop over {' '.join(items)[:40]}")
        worlds = [w]
        for item in items:
            for x in worlds:
                x.env[var] = item
            worlds = self.block(body.named_children, worlds, depth)
        return worlds

    def while_(self, node, w: World, depth: int) -> list[World]:
        cond = node.children_by_field_name("condition")
        body = node.child_by_field_name("body")
        until = node.type == "until_statement"
        worlds, done = [w], []
        for _ in range(MAX_LOOP_ITERATIONS):
            nxt = []
            for x in worlds:
                value = self.condition(cond, x)
                if value is not None and until:
                    value = not value
                if value is False:
                    done.append(x)
                elif value is None:
                    done.extend(self.refuse_if_it_matters(body, x, "a while loop on an unknown condition"))
                else:
                    nxt.extend(self.block(body.named_children, [x], depth))
            worlds = [x for x in nxt if not x.exited] 
            done += [x for x in nxt if x.exited]
            if not worlds:
                return done
        raise SpecError(f"{self.where}:{self.line(node)}: a loop runs more than {MAX_LOOP_ITERATIONS} times")

    # --- conditions: True, False or None (unknown) ----------------------------------------------
    def condition(self, nodes, w: World):
        """A condition that reads a variable the environment can set (even one with a ``:-`` default)
        is unknown: the script can take either branch, so both are evaluated."""
        value = True
        for n in nodes:
            if n.is_named and n.type != "comment":
                value = None if self.from_environment(n, w) else self.cond(n, w)
        return value

    def from_environment(self, node, w: World) -> bool:
        """Whether ``node`` reads a variable the script does not set, or one set from such a variable
        (positional parameters excepted: the script is taken as run with no arguments)."""
        stack = [node]
        while stack:
            n = stack.pop()
            if n.type in ("simple_expansion", "expansion", "arithmetic_expansion", "subscript") or \
                    (n.type == "variable_name" and n.parent is not None and n.parent.type.endswith("expression")):
                for v in [n] + list(n.children):
                    if v.type == "variable_name":
                        name = self.raw(v)
                        if name.isdigit():
                            continue  # a positional parameter: the script is run with no arguments
                        if name not in w.env or name in w.environment:
                            return True
            if n.type == "command_substitution":
                return True
            stack.extend(n.children)
        return False

    def cond(self, node, w: World):
        t = node.type
        if t == "test_command":
            inner = [c for c in node.named_children if c.type != "comment"]
            return self.test(inner[0], w) if inner else False
        if t == "list":
            left = self.cond(node.children[0], w)
            for i in range(1, len(node.children) - 1, 2):
                op, right = node.children[i].type, self.cond(node.children[i + 1], w)
                left = _and(left, right) if op == "&&" else _or(left, right)
            return left
        if t == "negated_command":
            return _not(self.cond(node.named_children[0], w))
        if t == "compound_statement" and node.children and node.children[0].type == "((" and node.named_children:
            value = self.arith(node.named_children[0], w)  # (( expr )): true when not 0
            return None if value is None else value != 0
        if t == "command":
            argv = self.word_list(node, w)
            if argv and argv[0] in ("true", ":"):
                return True
            if argv and argv[0] == "false":
                return False
            if argv and argv[0] == "test":
                return _test_argv(argv[1:])
            return None
        if t == "parenthesized_expression":
            return self.test(node.named_children[0], w)
        return None

    def word_list(self, node, w: World) -> list[str]:
        out = []
        for child in node.children:
            if child.type == "command_name":
                out += self.word(child.named_children[0], w, split=True)
            elif child.is_named and child.type not in ("comment", "variable_assignment", "file_redirect"):
                out += self.word(child, w, split=True)
        return out

    def test(self, node, w: World):
        t = node.type
        if t == "binary_expression":
            op = node.child_by_field_name("operator")
            op_text = self.raw(op) if op is not None else ""
            left, right = node.child_by_field_name("left"), node.child_by_field_name("right")
            if op_text in ("&&", "-a", "||", "-o"):
                a, b = self.test(left, w), self.test(right, w)
                return _and(a, b) if op_text in ("&&", "-a") else _or(a, b)
            lv = self.word(left, w, split=False)[0]
            rv = self.word(right, w, split=False)[0]
            return _binary(op_text, lv, rv, glob=right.type not in ("string", "raw_string"))
        if t == "unary_expression":
            op = node.child_by_field_name("operator")
            op_text = self.raw(op) if op is not None else self.raw(node.children[0])
            arg = node.named_children[-1]
            if op_text == "!":
                return _not(self.test(arg, w))
            value = self.word(arg, w, split=False)[0]
            if is_unknown(value):
                return None
            return {"-z": value == "", "-n": value != ""}.get(op_text)  # file tests: unknown
        if t == "parenthesized_expression":
            return self.test(node.named_children[0], w)
        value = self.word(node, w, split=False)[0]
        return None if is_unknown(value) else value != ""

# --- helpers ------------------------------------------------------------------------------------
def _inline_script(argv: list[str]) -> str | None:
    """The script of ``bash -c '...'`` / ``sh -c`` / ``eval ...`` inside a command line."""
    if argv[0] == "eval":
        return " ".join(argv[1:])
    for i, word in enumerate(argv[:-2]):
        if word.rsplit("/", 1)[-1] in ("bash", "sh") and argv[i + 1] == "-c":
            return argv[i + 2]
    return None


def _binary(op: str, a: str, b: str, glob: bool):
    if is_unknown(a) or is_unknown(b):
        return None
    if op in ("=", "=="):
        return fnmatch.fnmatchcase(a, b) if glob else a == b
    if op == "!=":
        return not (fnmatch.fnmatchcase(a, b) if glob else a == b)
    if op in ("-eq", "-ne", "-lt", "-le", "-gt", "-ge"):
        x, y = _int(a or "0"), _int(b or "0")
        if x is None or y is None:
            return None
        return {"-eq": x == y, "-ne": x != y, "-lt": x < y, "-le": x <= y, "-gt": x > y, "-ge": x >= y}[op]
    if op in ("<", ">"):
        return a < b if op == "<" else a > b
    return None  # =~ and file comparisons


def _test_argv(args: list[str]):
    if any(is_unknown(a) for a in args):
        return None
    if len(args) == 3:
        return _binary(args[1], args[0], args[2], glob=False)
    if len(args) == 2:
        return {"-z": args[1] == "", "-n": args[1] != ""}.get(args[0])
    if len(args) == 1:
        return args[0] != ""
    return None


def _and(a, b):
    if a is False or b is False:
        return False
    return None if a is None or b is None else True


def _or(a, b):
    if a is True or b is True:
        return True
    return None if a is None or b is None else False


def _not(a):
    return None if a is None else not a


def evaluate(text: str, where: str, env: dict[str, str] | None = None) -> list[World]:
    """Every World the script can end in (one per combination of undecidable branches)."""
    return Evaluator(text, where).run(World(env=dict(env or {})))
