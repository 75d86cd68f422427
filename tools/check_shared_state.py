#!/usr/bin/env python3
"""Refuse writable file-scope and function-static state in a compiled hw_fsdp.c (the build runs it).

    check_shared_state.py SRC OBJ

The ranks are threads of one process (the CPU runtime and the one-GPU CUDA runtime), so a variable
with static storage in the student's file -- `static int calls;` at file scope, `static float *buf;`
in a hook, or a plain global -- exists once, and every rank reads and writes the same copy. What that
gives is a race whose symptom changes from run to run (a SIGSEGV once, a watchdog timeout the next
time, a different rank each time). This check makes it one line at build time instead, the same on
every build.

What counts: the object's symbols of type OBJECT that live in a writable allocated section (.data,
.bss and the like: section flags W and A) or are COMMON (-fcommon), except
  .data.rel.ro*   read-only once relocated (`static const char *const names[]` under -fPIE),
  thread-local    .tdata/.tbss (TLS symbols): one copy per thread, hence per rank, so not shared.
.rodata* is never writable, so `static const int table[]` passes. Compiler labels (.LC0) are not
OBJECT symbols; sanitizer bookkeeping (names starting with "__" or "."), which -fsanitize adds to
the same sections, is the compiler's, not the student's.

The C name, the function a function-static sits in, its type and its line come from the object's
DWARF (the build compiles with -g); without it the symbol's name is enough: GCC names a
function-static `calls` `calls.0`, clang `fsdp_pre_forward.calls`.

Exit status 0 and no output when the file has none; else one line on stderr, in the compiler's
`file:line: error:` form (the grader quotes the first `error:` line of a failed build), and 1.
Usage errors (no readelf, no object) exit 2.
"""
import os
import re
import shutil
import subprocess
import sys

ADVICE = ("ranks are threads of one process, so a file-scope or static variable exists once and every rank reads "
          "and writes the same copy; keep per-rank state in your struct Fsdp (fsdp_init returns it, every hook "
          "gets it) or per module in mod->fsdp, and declare a table you only read const "
          "(static const int t[], static const char *const names[])")


def fail_usage(msg):
    print("check_shared_state: error: " + msg, file=sys.stderr)
    sys.exit(2)


def readelf(args, obj):
    """readelf's output (its stderr, warnings about relocations it cannot apply to DWARF, is not ours)."""
    p = subprocess.run(["readelf", "--wide"] + args + [obj], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    if p.returncode != 0:
        fail_usage("readelf %s %s failed (is %s an object file?)" % (" ".join(args), obj, obj))
    return p.stdout.decode("utf-8", "replace")


SECTION = re.compile(r"^\s*\[\s*(\d+)\]\s+(\S+)\s+\S+\s+[0-9a-f]+\s+[0-9a-f]+\s+[0-9a-f]+\s+[0-9a-f]+\s+([A-Za-z]*)\s+\d+")
SYMBOL = re.compile(r"^\s*\d+:\s+([0-9a-f]+)\s+\d+\s+(\w+)\s+(\w+)\s+\w+\s+(\w+)\s+(\S+)\s*$")


def shared_symbols(obj):
    """[(symbol name, value, local)] of the writable data symbols, in symbol-table order."""
    sections = {}  # index -> (name, flags)
    for line in readelf(["--section-headers"], obj).splitlines():
        m = SECTION.match(line)
        if m:
            sections[m.group(1)] = (m.group(2), m.group(3))
    found = []
    for line in readelf(["--syms"], obj).splitlines():
        m = SYMBOL.match(line)
        if not m:
            continue
        value, typ, bind, ndx, name = m.groups()
        if typ != "OBJECT" or name.startswith(("__", ".")):
            continue
        if ndx != "COM":
            sec_name, flags = sections.get(ndx, ("", ""))
            if "W" not in flags or "A" not in flags or "T" in flags or sec_name.startswith(".data.rel.ro"):
                continue
        found.append((name, int(value, 16), bind == "LOCAL"))
    return found


DIE = re.compile(r"^\s*<(\d+)><([0-9a-f]+)>: Abbrev Number: (\d+)(?: \((DW_TAG_\w+)\))?")
ATTR = re.compile(r"^\s*<[0-9a-f]+>\s+(DW_AT_\w+)\s*:\s*(.*?)\s*$")
REF = re.compile(r"<0x([0-9a-f]+)>")


def dwarf_dies(obj):
    """[(depth, offset, tag, {attr: value})] of .debug_info (empty without -g)."""
    dies = []
    for line in readelf(["--debug-dump=info"], obj).splitlines():
        m = DIE.match(line)
        if m:
            dies.append((int(m.group(1)), int(m.group(2), 16), m.group(4), {}))
            continue
        m = ATTR.match(line)
        if m and dies:
            value = m.group(2)
            form = re.match(r"\((\w+)\) (.*)", value)  # readelf --wide's "(strp) (offset: 0x7): calls", "(data1) 2"
            if form:
                value = form.group(2)
            if value.startswith(("(indirect", "(offset")) and "): " in value:  # (indirect string, offset: 0x93): calls
                value = value.split("): ", 1)[1]
            dies[-1][3][m.group(1)] = value
    return dies


class Dwarf:
    """The variables the object's DWARF declares: C name, enclosing function, type, line, address."""

    def __init__(self, obj):
        dies = dwarf_dies(obj)
        self.by_offset = {off: (tag, attrs) for _, off, tag, attrs in dies}
        self.vars = []  # (name, function or None, type offset or None, line or None, address or None)
        stack = []  # (depth, tag, name) of the enclosing DIEs
        for depth, off, tag, attrs in dies:
            while stack and stack[-1][0] >= depth:
                stack.pop()
            if tag is None:  # a null entry: the end of a DIE's children
                continue
            if tag == "DW_TAG_variable":
                attrs = self.merged(attrs)
                addr = re.search(r"\(DW_OP_addr: ([0-9a-f]+)\)", attrs.get("DW_AT_location", ""))
                func = next((n for _, t, n in reversed(stack) if t == "DW_TAG_subprogram" and n), None)
                line = re.match(r"0x[0-9a-f]+|\d+", attrs.get("DW_AT_decl_line", ""))
                if "DW_AT_name" in attrs:
                    self.vars.append((attrs["DW_AT_name"], func, self.ref(attrs.get("DW_AT_type")),
                                      int(line.group(0), 0) if line else None,
                                      int(addr.group(1), 16) if addr else None))
            name = self.merged(attrs).get("DW_AT_name") if tag == "DW_TAG_subprogram" else None
            stack.append((depth, tag, name))

    @staticmethod
    def ref(value):
        m = REF.search(value or "")
        return int(m.group(1), 16) if m else None

    def merged(self, attrs):
        """attrs completed by the DIE it specifies or is an instance of (a definition after a declaration)."""
        for link in ("DW_AT_specification", "DW_AT_abstract_origin"):
            target = self.by_offset.get(self.ref(attrs.get(link)))
            if target:
                return dict(self.merged(target[1]), **attrs)
        return attrs

    def type_name(self, off, depth=0):
        """A C-ish spelling of the type at `off`: int, float *, struct Foo, const char *[]."""
        tag, attrs = self.by_offset.get(off, (None, {}))
        if tag is None or depth > 8:
            return "void"
        inner = lambda: self.type_name(self.ref(attrs.get("DW_AT_type")), depth + 1)
        name = attrs.get("DW_AT_name")
        if tag in ("DW_TAG_base_type", "DW_TAG_typedef"):
            return name or inner()
        kind = {"DW_TAG_structure_type": "struct", "DW_TAG_union_type": "union", "DW_TAG_enumeration_type": "enum"}.get(tag)
        if kind:
            return "%s %s" % (kind, name) if name else "anonymous " + kind
        if tag == "DW_TAG_pointer_type":
            return inner() + (" *" if not inner().endswith("*") else "*")
        if tag in ("DW_TAG_const_type", "DW_TAG_volatile_type", "DW_TAG_atomic_type"):
            return "%s %s" % (tag[len("DW_TAG_"):-len("_type")].replace("atomic", "_Atomic"), inner())
        if tag == "DW_TAG_array_type":
            return inner() + "[]"
        if tag == "DW_TAG_subroutine_type":
            return "function"
        return name or "variable"

    def find(self, c_name, value, in_function):
        """The variable named c_name at address `value` (or the only one so named), a function's own when
        in_function (True, False, or None: unknown); None if there is no telling."""
        named = [v for v in self.vars if v[0] == c_name and (in_function is None or (v[1] is not None) == in_function)]
        return next((v for v in named if v[4] == value), named[0] if len(named) == 1 else None)


def c_name_of(symbol):
    """(C name, function or None) from the symbol alone: GCC's calls.0, clang's fsdp_pre_forward.calls."""
    m = re.fullmatch(r"(\w+)\.\d+", symbol)
    if m:
        return m.group(1), "a function"
    if "." in symbol:
        func, _, name = symbol.rpartition(".")
        return name, func
    return symbol, None


def describe(src, obj):
    """The error line for the object's shared state, or None when it has none."""
    found = shared_symbols(obj)
    if not found:
        return None
    dwarf = Dwarf(obj)
    try:
        with open(src, errors="replace") as f:
            source = f.read().splitlines()
    except OSError:
        source = []
    items = []  # (line or a large number, name, description, line or None)
    for symbol, value, local in found:
        name, func = c_name_of(symbol)
        var = dwarf.find(name, value, func is not None if local else False)
        typ, line = None, None
        if var:
            func, typ, line = var[1] or func, dwarf.type_name(var[2]) if var[2] is not None else None, var[3]
        # a line that does not name the variable is another file's (a header's): not given
        if line is not None and not (0 < line <= len(source) and re.search(r"\b%s\b" % re.escape(name), source[line - 1])):
            line = None
        what = " ".join(w for w in ("static" if local else None, typ or "variable") if w)
        where = "in %s" % func if func else "at file scope"
        items.append((line if line is not None else 1 << 30, name, "%s %s" % (what, where), line))
    items.sort()
    _, name, desc, line = items[0]
    subject = "'%s' (%s)" % (name, desc)
    if len(items) > 1:
        more = ", ".join("'%s'%s" % (n, " line %d" % l if l is not None else "") for _, n, _, l in items[1:])
        subject += " and %d more (%s) are" % (len(items) - 1, more)
    else:
        subject += " is"
    return "%s%s: error: %s writable state shared by every rank: %s" % (
        src, ":%d" % line if line is not None else "", subject, ADVICE)


def main(argv):
    if len(argv) != 3:
        fail_usage("usage: check_shared_state.py SRC OBJ")
    src, obj = argv[1], argv[2]
    if shutil.which("readelf") is None:
        fail_usage("readelf not found (Debian: sudo apt-get install binutils)")
    if not os.path.exists(obj):
        fail_usage("no such object file: " + obj)
    line = describe(src, obj)
    if line is None:
        return 0
    print(line, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
