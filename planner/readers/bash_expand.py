"""Word expansion as bash performs it (bash manual, "Shell Expansions"): parameters and their
``${...}`` forms, arrays, arithmetic (C integer semantics, "Shell Arithmetic"), quote removal and
word splitting of unquoted expansions on blanks (default IFS). Used by planner/readers/bash.py.

Unknown text (a variable the environment sets, ``$(...)``) is carried inside words between
``UNKNOWN_OPEN`` and ``UNKNOWN_CLOSE`` with its source, so a reader can say what it could not tell.
"""

from __future__ import annotations

import fnmatch
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planner.readers.bash import World

UNKNOWN_OPEN, UNKNOWN_CLOSE = "\ue000", "\ue001"
_DOLLAR_NODES = ("simple_expansion", "expansion", "command_substitution", "arithmetic_expansion")
_LEADING_GAP = re.compile(rb"(?:[ \t\n]|\\\n)*")


def unknown(source: str) -> str:
    return f"{UNKNOWN_OPEN}{source}{UNKNOWN_CLOSE}"


def is_unknown(word: str) -> bool:
    return UNKNOWN_OPEN in word


def unknown_sources(word: str) -> list[str]:
    return re.findall(f"{UNKNOWN_OPEN}(.*?){UNKNOWN_CLOSE}", word)


class Expander:
    """Expansion of tree-sitter-bash word nodes against a World's variables (``self.src``: the
    script's bytes)."""

    first_line = 1  # the line of the script where this text starts (an ``eval``'s string: the eval's line)

    def line(self, node) -> int:
        return node.start_point[0] + self.first_line

    def raw(self, node) -> str:
        return self.src[self.start(node):node.end_byte].decode("utf-8")

    def start(self, node) -> int:
        """Where a node's text begins. Inside a double-quoted string tree-sitter-bash starts an expansion
        that follows another one at the whitespace before it (``"$A ${B}"``, ``"$A \\<newline> $B"``: the
        ``$``/``${`` token takes the gap); that gap is the string's text, not the expansion's."""
        if node.type in _DOLLAR_NODES:
            gap = _LEADING_GAP.match(self.src, node.start_byte, node.end_byte)
            return gap.end()
        return node.start_byte

    # --- words ----------------------------------------------------------------------------------
    def word(self, node, w: World, split: bool) -> list[str]:
        """The fields one word expands to (``split``: word splitting of unquoted expansions)."""
        return self.fields(node, w, split).fields

    def fields(self, node, w: World, split: bool) -> _Fields:
        f = _Fields(split, self.line(node))
        self.expand(node, w, f, quoted=False)
        f.close()
        if not split and not f.fields:
            f.fields, f.lines = [""], [self.line(node)]
        return f

    def expand(self, node, w: World, f: _Fields, quoted: bool) -> None:
        t = node.type
        if t in ("word", "number", "extglob_pattern", "regex", "special_variable_name", "variable_name"):
            text = self.raw(node)
            f.lit(text if quoted else _unescape(text), self.line(node))
        elif t == "raw_string":
            f.lit(self.raw(node)[1:-1], self.line(node))
        elif t == "ansi_c_string":
            f.lit(self.raw(node)[2:-1].encode("utf-8").decode("unicode_escape", errors="replace"))
        elif t == "string":
            if self.empty_at_list(node, w):  # "$@", "${A[@]}" of nothing: no word at all (bash manual, "Special
                return                       # Parameters": "When there are no positional parameters, "$@" ...
            f.lit("", self.line(node))       # expand to nothing"; "Arrays": likewise "${name[@]}")
            self.pieces(node, w, skip=('"',), fields=f)
        elif t == "concatenation":
            for child in node.children:
                self.expand(child, w, f, quoted)
        elif t == "simple_expansion":
            self.expand_var(self.raw(node)[1:], None, w, f, quoted)
        elif t == "expansion":
            self.expansion(node, w, f, quoted)
        elif t == "arithmetic_expansion":
            value = self.arith(node.named_children[0], w) if node.named_children else 0
            f.lit(unknown(self.raw(node)) if value is None else str(value))
        elif t in ("command_substitution", "process_substitution"):
            f.lit(unknown(self.raw(node)))
        elif t == "array":
            for el in node.named_children:
                self.expand(el, w, f, quoted)
        else:
            f.lit(self.raw(node))

    def empty_at_list(self, node, w: World) -> bool:
        """Whether a double-quoted string is exactly ``"$@"``, ``"${@}"`` or ``"${name[@]}"`` and that list is empty."""
        kids = [c for c in node.children if c.type != '"']
        if len(kids) != 1 or self.raw(node)[1:-1] != self.raw(kids[0]):
            return False
        kid = kids[0]
        if kid.type == "simple_expansion":
            name = self.raw(kid)[1:]
            if name != "@":
                return False
        elif kid.type == "expansion":
            inner = [c for c in kid.children if c.type not in ("${", "}")]
            if len(inner) != 1:
                return False
            target = inner[0]
            if target.type == "subscript":
                if self.raw(target.child_by_field_name("index")) != "@":
                    return False
                name = self.raw(target.child_by_field_name("name"))
            else:  # "${@}"; "${A}" of an empty array is one empty word, as "$A" is
                name = self.raw(target)
                if name != "@":
                    return False
        else:
            return False
        value = self.lookup(name, w)
        return isinstance(value, list) and not value

    def pieces(self, node, w: World, skip=(), fields: _Fields | None = None):
        """Text of a double-quoted string or here-document: literal gaps plus expanded children."""
        f = fields if fields is not None else _Fields(split=False)
        pos = node.start_byte
        kids = [c for c in node.children if c.type not in skip and c.type not in ("string_content", "heredoc_content")]
        start = node.start_byte + (1 if node.type == "string" else 0)
        end = node.end_byte - (1 if node.type == "string" else 0)
        pos = start
        for child in kids:
            begin = self.start(child)
            if begin > pos:
                f.lit(_unescape_dq(self.src[pos:begin].decode("utf-8")))
            self.expand(child, w, f, quoted=True)
            pos = child.end_byte
        if end > pos:
            f.lit(_unescape_dq(self.src[pos:end].decode("utf-8")))
        if fields is None:
            return "".join(f.done())
        return None

    def lookup(self, name: str, w: World):
        """A variable's value: str, list, or None when it comes from the environment."""
        if name.isdigit():
            i = int(name)
            return w.positional[i - 1] if 0 < i <= len(w.positional) else ""
        if name == "#":
            return str(len(w.positional))
        if name in ("@", "*"):
            return list(w.positional)
        if name in w.env:
            return w.env[name]
        return None

    def expand_var(self, name: str, index, w: World, f: _Fields, quoted: bool) -> None:
        if name in ("@", "*"):
            index = name
        value = self.lookup(name, w)
        where = w.lines.get(name)
        if value is None:
            f.lit(unknown("$" + name))
            return
        if isinstance(value, list):
            lines = where if isinstance(where, list) else [where or f.line] * len(value)
            if index in ("@", "*"):
                if quoted and index == "*":
                    f.lit(" ".join(value), lines[0] if lines else None)
                else:
                    f.many(value, quoted, lines)
                return
            i = 0 if index is None else _int(index)
            ok = i is not None and 0 <= i < len(value)
            f.add(value[i] if ok else "", quoted, lines[i] if ok and i < len(lines) else None)
            return
        if index not in (None, "0", "@", "*"):
            value = ""
        f.add(value, quoted, where if isinstance(where, int) else None)

    def expansion(self, node, w: World, f: _Fields, quoted: bool) -> None:
        kids = [c for c in node.children if c.type not in ("${", "}")]
        if not kids:
            return
        length = kids[0].type == "#" and len(kids) > 1
        if length or kids[0].type == "!":
            kids = kids[1:]
        target = kids[0]
        index = None
        if target.type == "subscript":
            name = self.raw(target.child_by_field_name("name"))
            idx_node = target.child_by_field_name("index")
            index = self.raw(idx_node)
            if index not in ("@", "*"):
                i = self.arith_text(idx_node, w)
                index = None if i is None else str(i)
        elif target.type in ("variable_name", "special_variable_name"):
            name = self.raw(target)
        else:
            f.lit(unknown(self.raw(node)))
            return
        if node.children[1].type == "!":  # ${!X}: indirection
            f.lit(unknown(self.raw(node)))
            return
        value = self.lookup(name, w)
        if length:
            if value is None:
                f.lit(unknown(self.raw(node)))
            elif isinstance(value, list) and index in ("@", "*"):
                f.lit(str(len(value)))
            else:
                f.lit(str(len(value if isinstance(value, str) else (value[0] if value else ""))))
            return
        rest = kids[1:]
        if not rest:
            self.expand_var(name, index, w, f, quoted)
            return
        op = self.raw(rest[0])
        arg_nodes = rest[1:]
        arg = "".join(self.word(a, w, split=False)[0] for a in arg_nodes) if arg_nodes else ""
        scalar = value if isinstance(value, str) or value is None else (
            " ".join(value) if index in ("@", "*") else (value[0] if value else ""))
        unset = value is None and not name.isdigit()
        empty = scalar in ("", None)
        if name.isdigit() and scalar == "":
            unset = False
        if op in (":-", "-", ":=", "="):
            use_default = (empty if op.startswith(":") else value is None) or (name.isdigit() and scalar == "")
            if use_default:
                if op in (":=", "="):
                    w.env[name] = arg
                f.add(arg, quoted)
            else:
                self.expand_var(name, index, w, f, quoted)
        elif op in (":+", "+"):
            if unset:
                f.lit(unknown(self.raw(node)))
            elif not empty:
                f.add(arg, quoted)
        elif op in (":?", "?"):
            if unset or empty:
                f.lit(unknown(self.raw(node)))
            else:
                self.expand_var(name, index, w, f, quoted)
        elif op in ("%", "%%", "#", "##") and not unset and not is_unknown(arg):
            f.add(_trim(scalar, op, arg), quoted)
        else:
            f.lit(unknown(self.raw(node)))

    # --- arithmetic (bash manual, "Shell Arithmetic": C integer semantics) ----------------------
    def arith_text(self, node, w: World):
        if node is None:
            return None
        if node.type in ("number", "word") and _int(self.raw(node)) is not None:
            return _int(self.raw(node))
        return self.arith(node, w)

    def arith(self, node, w: World):
        t = node.type
        if t == "number":
            return _int(self.raw(node))
        if t in ("variable_name", "word"):
            value = self.lookup(self.raw(node), w)
            if value is None:
                return None
            value = value[0] if isinstance(value, list) and value else value
            return 0 if value in ("", []) else _int(value)
        if t in ("simple_expansion", "expansion", "string"):
            value = self.word(node, w, split=False)[0]
            return None if is_unknown(value) else (0 if value == "" else _int(value))
        if t == "parenthesized_expression":
            return self.arith(node.named_children[0], w)
        if t == "unary_expression":
            op = self.raw(node.children[0])
            v = self.arith(node.named_children[-1], w)
            if v is None:
                return None
            return {"-": -v, "+": v, "!": int(not v), "~": ~v}.get(op)
        if t == "ternary_expression":
            c = self.arith(node.named_children[0], w)
            if c is None:
                return None
            return self.arith(node.named_children[1 if c else 2], w)
        if t == "binary_expression":
            a = self.arith(node.child_by_field_name("left"), w)
            b = self.arith(node.child_by_field_name("right"), w)
            op = self.raw(node.child_by_field_name("operator"))
            if a is None or b is None:
                return None
            return _arith_op(op, a, b)
        return None


class _Fields:
    """Builds the fields of one word: quoted text joins the current field; unquoted expansions are
    split on blanks (default IFS)."""

    def __init__(self, split: bool, line: int = 1):
        self.splitting = split
        self.fields: list[str] = []
        self.lines: list[int] = []
        self.cur: str | None = None
        self.cur_line = line
        self.line = line  # where the word being expanded is written

    def lit(self, text: str, line: int | None = None) -> None:
        if self.cur is None or (self.cur == "" and line is not None):
            self.cur_line = line or self.line
        self.cur = (self.cur or "") + text

    def add(self, value: str, quoted: bool, line: int | None = None) -> None:
        if quoted or not self.splitting:
            self.lit(value, line)
            return
        if value == "":
            return
        # the blanks of the known text split (bash's word splitting); an unknown piece stays whole inside
        # its field ("--data-cache-path ${PWD}/cache" is two words whatever $PWD holds)
        parts = _split_known(value)
        if not parts or value[0].isspace():
            self.close()
        for i, part in enumerate(parts):
            if i:
                self.close()
            self.lit(part, line)
        if value[-1].isspace():
            self.close()

    def many(self, items: list[str], quoted: bool, lines: list[int]) -> None:
        if not self.splitting:
            self.lit(" ".join(items), lines[0] if lines else None)
            return
        for i, item in enumerate(items):
            if i:
                self.close()
            line = lines[i] if i < len(lines) else None
            self.add(item, quoted, line)
            if quoted and self.cur is None:
                self.lit("", line)

    def close(self) -> None:
        if self.cur is not None:
            self.fields.append(self.cur)
            self.lines.append(self.cur_line)
            self.cur = None

    def done(self) -> list[str]:
        self.close()
        return self.fields


def _split_known(value: str) -> list[str]:
    """``value.split()``, blanks inside an unknown piece (between UNKNOWN_OPEN and UNKNOWN_CLOSE) kept."""
    pieces = re.split(f"({UNKNOWN_OPEN}.*?{UNKNOWN_CLOSE})", value, flags=re.S)
    parts, cur = [], ""
    for i, piece in enumerate(pieces):
        if i % 2:  # an unknown piece
            cur += piece
            continue
        words = re.split(r"\s+", piece)
        for j, word in enumerate(words):
            if j:
                if cur:
                    parts.append(cur)
                cur = ""
            cur += word
    if cur:
        parts.append(cur)
    return parts


def _unescape(text: str) -> str:
    """Quote removal in an unquoted word: ``\\x`` -> ``x``, ``\\<newline>`` -> nothing."""
    return re.sub(r"\\(.)", r"\1", text.replace("\\\n", ""), flags=re.S)


def _unescape_dq(text: str) -> str:
    """Inside double quotes a backslash escapes only $ ` " \\ and newline (bash manual, "Double Quotes")."""
    return re.sub(r'\\([$`"\\\n])', lambda m: "" if m.group(1) == "\n" else m.group(1), text)


def _int(text):
    """A decimal (or 0x hexadecimal) integer, else None."""
    s = str(text).strip()
    if re.fullmatch(r"[-+]?\d+", s):
        return int(s)
    if re.fullmatch(r"0[xX][0-9a-fA-F]+", s):
        return int(s, 16)
    return None


def _trim(value: str, op: str, pattern: str) -> str:
    if op in ("%", "%%"):
        cuts = [i for i in range(len(value) + 1) if fnmatch.fnmatchcase(value[i:], pattern)]
        if not cuts:
            return value
        return value[: (max(cuts) if op == "%" else min(cuts))]
    cuts = [i for i in range(len(value) + 1) if fnmatch.fnmatchcase(value[:i], pattern)]
    if not cuts:
        return value
    return value[(min(cuts) if op == "#" else max(cuts)):]


def _arith_op(op: str, a: int, b: int):
    if op in ("/", "%") and b == 0:
        return None
    if op == "/":
        q = abs(a) // abs(b)
        return q if (a >= 0) == (b >= 0) else -q
    if op == "%":
        return a - b * _arith_op("/", a, b)
    ops = {"+": a + b, "-": a - b, "*": a * b, "**": a ** b if 0 <= b < 64 else None,
           "<<": a << b if 0 <= b < 64 else None, ">>": a >> b if b >= 0 else None,
           "&": a & b, "|": a | b, "^": a ^ b, "<": int(a < b), ">": int(a > b), "<=": int(a <= b),
           ">=": int(a >= b), "==": int(a == b), "!=": int(a != b), "&&": int(bool(a and b)),
           "||": int(bool(a or b))}
    return ops.get(op)
